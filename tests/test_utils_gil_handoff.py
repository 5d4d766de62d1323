"""``swarmtrain.utils.gil_handoff``: the background loop hands the GIL over while it is busy.

The schedule is pure (times passed in); the instrument is driven through its hooks with a fake
clock; then the real background runtime: blocking callers leave the loop as it was, the first
asyncio caller (an ``.aio`` call, a thread-based ``.aio`` method, ``aio_create``) installs the
hand-off, and a loop busy for longer than a slice hands off. No timing is asserted.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from swarmtrain.utils import gil_handoff
from swarmtrain.utils.background import BackgroundRuntime, BackgroundService
from swarmtrain.utils.facade import (
    aio_property,
    forward,
    run_in_worker_thread,
    thread_aio_property,
)
from swarmtrain.utils.gil_handoff import GILHandOff, HandOffSchedule


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ------------------------------------------------------------------------ the schedule


def test_no_hand_off_within_a_slice():
    schedule = HandOffSchedule(slice_s=0.002)
    schedule.woke(10.0)
    assert not schedule.after_step(10.0005)
    assert not schedule.after_step(10.0019)
    assert schedule.hand_offs == 0


def test_a_hand_off_once_a_busy_stretch_reaches_the_slice_then_a_new_slice():
    schedule = HandOffSchedule(slice_s=0.002)
    schedule.woke(10.0)
    assert schedule.after_step(10.002)
    schedule.woke(10.0022)  # back from the hand-off
    assert not schedule.after_step(10.003)
    assert schedule.after_step(10.0045)
    assert schedule.hand_offs == 2


def test_a_blocking_wait_ends_the_busy_stretch():
    schedule = HandOffSchedule(slice_s=0.002)
    schedule.woke(10.0)
    assert not schedule.after_step(10.0015)
    schedule.blocking()
    schedule.woke(10.0016)
    assert not schedule.after_step(10.003)  # 1.4 ms into the new stretch


def test_a_step_before_any_wake_starts_the_stretch():
    schedule = HandOffSchedule(slice_s=0.002)
    assert not schedule.after_step(5.0)  # installed mid-stretch: starts counting here
    assert schedule.after_step(5.01)


def test_the_slice_must_be_positive():
    with pytest.raises(ValueError, match="slice_s"):
        HandOffSchedule(slice_s=0)


# ------------------------------------------------------------------------ the instrument


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_instrument_sleeps_after_a_step_that_ends_a_slice():
    fake = FakeTime()
    hand_off = GILHandOff(0.002, 0.0002, clock=fake.clock, sleep=fake.sleep)
    hand_off.after_io_wait(0.0)  # woke
    fake.now += 0.001
    hand_off.after_task_step(None)
    assert fake.sleeps == []
    fake.now += 0.0015
    hand_off.after_task_step(None)
    assert fake.sleeps == [0.0002] and hand_off.hand_offs == 1
    fake.now += 0.001
    hand_off.after_task_step(None)  # a new slice began after the sleep
    assert hand_off.hand_offs == 1


def test_the_instrument_does_not_sleep_across_blocking_waits():
    fake = FakeTime()
    hand_off = GILHandOff(0.002, 0.0002, clock=fake.clock, sleep=fake.sleep)
    for _ in range(10):  # 1 ms of work, then a real wait, ten times
        hand_off.after_io_wait(0.0)
        fake.now += 0.001
        hand_off.after_task_step(None)
        hand_off.before_io_wait(0.5)
        fake.now += 0.01
    assert fake.sleeps == []
    hand_off.after_io_wait(0.5)
    for _ in range(3):  # polls without blocking (timeout 0) do not end a busy stretch
        fake.now += 0.001
        hand_off.after_task_step(None)
        hand_off.before_io_wait(0.0)
        hand_off.after_io_wait(0.0)
    assert fake.sleeps == [0.0002]


# ------------------------------------------------------------------ on the real runtime


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def busy_until_handed_off(runtime: BackgroundRuntime) -> bool:
    """Task steps of 5 ms without blocking until the loop handed off (at most 200)."""
    for _ in range(200):
        spin(0.005)
        await trio.lowlevel.checkpoint()
        if runtime.hand_off is not None and runtime.hand_off.hand_offs > 0:
            return True
    return False


class Work:
    async def busy(self, runtime: BackgroundRuntime) -> bool:
        return await busy_until_handed_off(runtime)

    async def noop(self) -> None:
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def serve_work() -> AsyncIterator[Work]:
    yield Work()


class WorkFacade(BackgroundService):
    busy = forward(Work.busy)
    noop = forward(Work.noop)
    aio = aio_property()

    def __init__(self) -> None:
        self._start_in_background(serve_work)

    def runtime(self) -> BackgroundRuntime:
        return self._running()[0]


class ThreadWorkFacade(WorkFacade):
    def ping(self) -> str:
        return "pong"

    aio = thread_aio_property("ping")


def test_blocking_callers_do_not_install_it():
    with WorkFacade() as facade:
        facade.noop()
        assert facade.runtime().hand_off is None


@pytest.mark.anyio
async def test_an_aio_call_installs_it_and_a_busy_loop_hands_off():
    with WorkFacade() as facade:
        runtime = facade.runtime()
        assert await facade.aio.busy(runtime)
        assert runtime.hand_off is not None and runtime.hand_off.hand_offs >= 1
        installed = runtime.hand_off
        await facade.aio.busy(runtime)
        assert runtime.hand_off is installed  # once per runtime


@pytest.mark.anyio
async def test_thread_aio_methods_and_aio_create_install_it():
    with ThreadWorkFacade() as facade:
        assert await facade.aio.ping() == "pong"
        assert facade.runtime().hand_off is not None
    made = await run_in_worker_thread(WorkFacade)
    try:
        assert made.runtime().hand_off is not None
    finally:
        made.shutdown()


@pytest.mark.anyio
async def test_thread_aio_methods_after_shutdown_do_not_touch_the_stopped_loop():
    facade = ThreadWorkFacade()
    facade.shutdown()  # the last reference: the loop stopped
    assert await facade.aio.ping() == "pong"
    assert facade._runtime.hand_off is None


@pytest.mark.anyio
async def test_the_environment_can_leave_it_out(monkeypatch):
    monkeypatch.setenv("SWARMTRAIN_DISABLE_GIL_HANDOFF", "1")
    assert gil_handoff.disabled()
    with WorkFacade() as facade:
        await facade.aio.noop()
        assert facade.runtime().hand_off is None
