import os

import pytest

# Keep libp2p quiet and deterministic in tests.
os.environ.setdefault("SWARMTRAIN_LOG_LEVEL", "WARNING")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SWARMTRAIN_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow soak test: set SWARMTRAIN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
