"""``swarmtrain.utils.loop_stalls``: a real trio loop, a task that blocks it for a known time.

The histogram and the stall kinds are pure; then real runs: a task that ``time.sleep``s holds
the loop and is reported by name with where it resumed, where it stopped and the sampled stack
(the sleeping frame); a task that yields often is not; a busy loop of Python code spends its
CPU time in the step, a sleep is ``starved`` (no CPU); records are bounded; the env variable
switches it on for a real host. Thresholds are far below the blocking times and far above a yielding
task's steps, so load cannot turn a pass into a fail.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time

import pytest
import trio
import trio.lowlevel

from swarmtrain.utils import loop_stalls
from swarmtrain.utils.loop_stalls import (
    LoopStall,
    LoopStallDetector,
    StepHistogram,
    detect_loop_stalls,
    threshold_from_env,
    watch_loop_stalls,
)

# ------------------------------------------------------------------------ pure parts


def test_histogram_quantiles_are_bucket_upper_bounds():
    histogram = StepHistogram()
    assert histogram.quantile(0.99) == 0.0
    for _ in range(990):
        histogram.add(0.0001)
    for _ in range(10):
        histogram.add(2.0)
    assert 0.0001 <= histogram.quantile(0.99) < 0.0001 * 1.2
    assert 2.0 <= histogram.quantile(0.999) < 2.0 * 1.2
    histogram.add(1e9)  # beyond the last bucket: counted there
    assert histogram.total == 1001


def _stall(wall: float, cpu: float, gc: float = 0.0, runqueue: float | None = None) -> LoopStall:
    return LoopStall("t", wall, cpu, gc, "a.py:1 f", "a.py:2 f", 0.0, runqueue_s=runqueue)


def test_a_stall_is_gc_starved_waiting_or_blocking():
    assert _stall(1.0, 0.1).kind == "starved"  # run queue unknown
    assert _stall(1.0, 0.1, runqueue=0.8).kind == "starved"
    assert _stall(1.0, 0.1, runqueue=0.1).kind == "waiting"  # the GIL, a lock, a sleep
    assert _stall(1.0, 0.9, gc=0.6).kind == "gc"
    assert _stall(1.0, 0.3, gc=0.6).kind == "gc"  # a collection on a busy box
    assert _stall(1.0, 0.9, gc=0.1).kind == "blocking"
    assert "blocking" in _stall(1.0, 0.9).describe()


def test_bad_settings_raise():
    with pytest.raises(ValueError):
        LoopStallDetector(0)
    with pytest.raises(ValueError):
        LoopStallDetector(0.1, max_records=0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", None), ("0", None), ("0.25", 0.25), ("x", None), ("-1", None), ("nan", None)],
)
def test_threshold_from_env(monkeypatch, text, expected):
    monkeypatch.setenv(loop_stalls.LOOP_STALLS_ENV, text)
    assert threshold_from_env() == expected


# ------------------------------------------------------------------------ a real trio loop


def _sampled(detector: LoopStallDetector | None) -> bool:
    """Whether the watchdog has taken the stack of the loop step in progress (a busy box may
    schedule its thread late: a step that must show a sample lasts until it has one)."""
    if detector is None:
        return True
    sampled = detector._sampled
    return sampled is not None and sampled[0] == detector._step_seq


def _blocks_the_loop(seconds: float, detector: LoopStallDetector | None = None) -> None:
    end = time.monotonic() + seconds
    limit = end + 10.0
    while time.monotonic() < end or (not _sampled(detector) and time.monotonic() < limit):
        time.sleep(0.01)


async def blocking_task(detector: LoopStallDetector | None = None) -> None:
    await trio.lowlevel.checkpoint()
    _blocks_the_loop(0.6, detector)
    await trio.lowlevel.checkpoint()


async def yielding_task() -> None:
    for _ in range(100_000):  # until cancelled
        await trio.sleep(0.001)


def _busy(seconds: float, detector: LoopStallDetector | None = None) -> int:
    end, n = time.thread_time() + seconds, 0
    limit = time.monotonic() + 10.0
    while time.thread_time() < end or (not _sampled(detector) and time.monotonic() < limit):
        n += 1
    return n


async def busy_task(detector: LoopStallDetector | None = None) -> None:
    await trio.lowlevel.checkpoint()
    _busy(0.4, detector)


@pytest.mark.trio
async def test_a_blocking_task_is_reported_with_its_name_and_place(caplog):
    caplog.set_level(logging.WARNING, logger=loop_stalls.__name__)
    with detect_loop_stalls(0.2) as detector:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(yielding_task, name="yielder")
            nursery.start_soon(blocking_task, detector, name="blocker")
            await trio.sleep(0.05)
            nursery.start_soon(busy_task, detector, name="busy")
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    stalls = detector.stalls
    names = [stall.task for stall in stalls]
    assert "blocker" in names and "busy" in names
    assert "yielder" not in names
    blocker = stalls[names.index("blocker")]
    assert blocker.wall_s >= 0.6
    assert blocker.cpu_s < 0.3  # sleeping uses no CPU: it waited
    assert blocker.kind in ("waiting", "starved")
    if sys.platform == "linux":  # /proc/<tid>/schedstat
        assert blocker.runqueue_s is not None
    assert "blocking_task" in blocker.resumed_at and "blocking_task" in blocker.suspended_at
    assert any("_blocks_the_loop" in frame for frame in blocker.stack)  # the watchdog's sample
    busy = stalls[names.index("busy")]
    assert busy.cpu_s >= 0.4  # its own work (its kind depends on the box's load)
    assert busy.suspended_at == ""  # the task finished in that step
    assert any("_busy" in frame for frame in busy.stack)
    statistics = detector.statistics()
    assert statistics.stalls == len(stalls) and statistics.max_stall_s >= 0.6
    assert statistics.starved + statistics.waiting >= 1
    assert statistics.steps > 10 and statistics.step_max_s >= 0.6
    logged = [r.getMessage() for r in caplog.records if r.name == loop_stalls.__name__]
    assert any("'blocker'" in line and blocker.kind in line for line in logged)


@pytest.mark.trio
async def test_a_task_that_yields_often_is_not_reported():
    with detect_loop_stalls(0.2, sample_stacks=False) as detector:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(yielding_task, name="yielder")
            for _ in range(20):
                _busy(0.005)  # short steps of our own
                await trio.lowlevel.checkpoint()
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert detector.stalls == ()
    assert detector.statistics().stalls == 0


@pytest.mark.trio
async def test_records_are_bounded():
    with detect_loop_stalls(0.01, max_records=2, log=False, sample_stacks=False) as detector:
        await trio.lowlevel.checkpoint()  # the step that added the detector is not timed
        for _ in range(4):
            _blocks_the_loop(0.03)
            await trio.lowlevel.checkpoint()
    assert len(detector.stalls) == 2
    assert detector.statistics().stalls == 4


@pytest.mark.trio
async def test_watch_loop_stalls_adds_one_detector_per_loop():
    first = watch_loop_stalls(0.5, log=False)
    assert watch_loop_stalls(0.1) is first and first.threshold == 0.5
    await trio.lowlevel.checkpoint()
    _blocks_the_loop(0.6)
    await trio.lowlevel.checkpoint()
    assert [stall.wall_s >= 0.5 for stall in first.stalls] == [True]


def test_the_detector_stops_its_watchdog_when_the_run_ends():
    detectors = []

    async def main() -> None:
        detectors.append(watch_loop_stalls(0.05))
        await trio.sleep(0.01)

    trio.run(main)
    (detector,) = detectors
    assert detector._watchdog is not None and not detector._watchdog.is_alive()


@pytest.mark.trio
async def test_the_env_variable_switches_it_on_for_a_host(monkeypatch):
    from swarmtrain.p2p import P2P

    monkeypatch.setenv(loop_stalls.LOOP_STALLS_ENV, "0.3")
    async with P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]):
        detector = watch_loop_stalls()
        assert detector.threshold == 0.3
        _blocks_the_loop(0.4)
        await trio.lowlevel.checkpoint()
    assert detector.statistics().stalls >= 1


@pytest.mark.trio
@pytest.mark.skipif(sys.platform != "linux", reason="threads' CPU from /proc")
async def test_other_threads_cpu_and_collections_are_attributed():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spinner")
    collector = threading.Thread(target=gc.collect, name="collector")
    with detect_loop_stalls(0.2) as detector:
        await trio.lowlevel.checkpoint()
        spinner.start()
        collector.start()
        try:
            _blocks_the_loop(0.6)  # while another thread spins and one collects garbage
            collector.join()
            await trio.lowlevel.checkpoint()  # the step ends while the spinner still runs
        finally:
            stop.set()
            spinner.join()
    (stall,) = [stall for stall in detector.stalls if stall.wall_s >= 0.6]
    assert stall.gc_others_s > 0 and stall.gc_s == 0
    assert "spinner" in [name for name, _ in stall.busy_threads]
    assert "spinner" in stall.describe()
    assert "spin" in stall.others_at["spinner"]  # where it was when the watchdog looked


def _holds_the_gil(after: float, iterations: int) -> None:
    time.sleep(after)
    sum(range(iterations))  # a C loop: no bytecode, so the GIL is never handed over
    time.sleep(0.5)  # alive while the stall is recorded (its CPU is read from /proc)


@pytest.mark.trio
async def test_a_loop_that_cannot_wake_up_on_time_is_reported():
    """While the loop sleeps, another thread holds the GIL: the loop's I/O wait overruns its
    timeout; no task step is long, the scheduler's wake-up is late."""
    holder = threading.Thread(target=_holds_the_gil, args=(0.15, 60_000_000), name="holder")
    with detect_loop_stalls(0.1) as detector:
        await trio.lowlevel.checkpoint()
        started = time.perf_counter()
        holder.start()
        await trio.sleep(0.4)
        overslept = time.perf_counter() - started - 0.4
        await trio.to_thread.run_sync(holder.join)
    wakes = [stall for stall in detector.stalls if stall.task == loop_stalls.IO_WAIT_TASK]
    if overslept > 0.2:  # the sum outlasted the sleep (it takes ~1 s on a quiet box)
        assert wakes and wakes[0].wall_s > 0.1
        assert wakes[0].kind in ("waiting", "starved")
        if sys.platform == "linux":  # the watchdog could not run, yet the holder is named
            assert "holder" in [name for name, _ in wakes[0].busy_threads]
