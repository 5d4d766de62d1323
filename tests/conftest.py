import functools
import gc
import inspect
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


# A trio test that hangs is failed by a watchdog in its own trio run, a little before
# pytest-timeout would fire: pytest-timeout interrupts trio's internals, which leaves the run
# half-open and fails every later trio test ("Attempted to call run() from inside a run()").
# The watchdog's error lists where every task was waiting, so a hang in CI says where it was.
_WATCHDOG_MARGIN = 20.0  # the test's own cleanup gets the rest


def _timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


def _task_tree(task, depth: int = 0) -> list[str]:
    """One line per task: the innermost frames it waits in, trio's own left out."""
    frames = [
        f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{lineno} {frame.f_code.co_name}"
        for frame, lineno in task.iter_await_frames()
        if "/trio/" not in frame.f_code.co_filename
    ]
    lines = [f"{'  ' * depth}{task.name}: {' > '.join(frames[-5:]) or '(in trio)'}"]
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            lines.extend(_task_tree(child, depth + 1))
    return lines


def _with_watchdog(test, limit: float):
    """``test`` (an async test function), failed with the task tree after ``limit`` s."""
    import trio

    @functools.wraps(test)
    async def guarded(**kwargs):
        tree: list[str] = []
        try:
            async with trio.open_nursery() as nursery:

                async def watch():
                    await trio.sleep(limit)
                    tree.extend(_task_tree(trio.lowlevel.current_root_task()))
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await test(**kwargs)
                nursery.cancel_scope.cancel()
        except BaseException as e:
            if tree:
                gc.collect()  # what the cancelled test left unclosed is reported here
                raise _hung(limit, tree) from e
            raise
        if tree:
            gc.collect()
            raise _hung(limit, tree)

    return guarded


def _hung(limit: float, tree: list[str]) -> TimeoutError:
    return TimeoutError(f"test still running after {limit:.0f} s; tasks:\n" + "\n".join(tree))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    """Runs before pytest-trio's wrapper, so the watchdog runs inside the test's trio run."""
    limit = _timeout_of(item) - _WATCHDOG_MARGIN
    obj = getattr(item, "obj", None)
    if (
        item.get_closest_marker("trio") is not None
        and limit > 0
        and inspect.iscoroutinefunction(obj)
        and not hasattr(obj, "hypothesis")
    ):
        item.obj = _with_watchdog(obj, limit)
    yield
