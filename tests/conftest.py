import os

import pytest
from hypothesis import HealthCheck, settings

# Keep libp2p quiet and deterministic in tests.
os.environ.setdefault("SWARMTRAIN_LOG_LEVEL", "WARNING")

# Hypothesis profiles of the property tests (tests/test_fuzz_*.py):
# - "ci": few examples, derandomized (the same examples every run: a CI failure reproduces);
#   chosen when CI=true;
# - "dev": the default elsewhere, random and a few times more examples;
# - "large": a long fuzzing run, e.g. `pytest tests/test_fuzz_*.py --hypothesis-profile=large`
#   or SWARMTRAIN_HYPOTHESIS_PROFILE=large (with `--timeout=0`: the 120 s per-test timeout is
#   sized for CI runs).
# Deadlines are off: a busy 2-core box makes single examples slow, which says nothing.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
_BASE = settings.get_profile("default")  # (else a profile loaded later inherits from "ci")
settings.register_profile(
    "ci",
    parent=_BASE,
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "dev",
    parent=_BASE,
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "large",
    parent=_BASE,
    max_examples=3000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
_default_profile = "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
settings.load_profile(os.environ.get("SWARMTRAIN_HYPOTHESIS_PROFILE", _default_profile))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SWARMTRAIN_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow soak test: set SWARMTRAIN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
