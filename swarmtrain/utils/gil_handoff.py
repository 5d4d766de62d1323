"""Hand the GIL to the process's other threads while swarmtrain's background loop is busy.

An asyncio trainer shares its process with swarmtrain's background trio loop. CPython lets a
thread that waits for the GIL ask for it only after ``sys.getswitchinterval()`` (5 ms), and
starts that wait over whenever the holder lets go for a moment without anybody else taking
it (every socket call, every poll of trio's loop): so while the background loop stays busy
(an epoch end: matchmaking, DHT traffic, progress gossip, all-reduce), the asyncio loop can
wait for its whole busy stretch, not 5 ms. Lowering the switch interval did not help
(benchmarks/RESULTS.md, "asyncio trainer: who holds the loop back").

``GILHandOff`` is a trio instrument on the background loop: after a task step, once the loop
has run ``slice_s`` seconds without blocking, it sleeps ``pause_s`` (a real release that a
waiting thread takes) and starts a new slice. Only swarmtrain's loop thread changes; nothing
process-wide. The background runtime installs it when an asyncio caller appears
(``BackgroundRuntime.serve_asyncio``); a plain blocking trainer does not get it (there the
main thread computing in Python should not take more of the GIL from the network loop).
``SWARMTRAIN_DISABLE_GIL_HANDOFF=1`` leaves it out (to measure without it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import trio

#: seconds the loop may run without blocking before it hands the GIL over
SLICE_S = 0.002
#: seconds it sleeps to hand it over: long enough for a waiting thread to be woken and take it
PAUSE_S = 0.0002


def disabled() -> bool:
    return os.environ.get("SWARMTRAIN_DISABLE_GIL_HANDOFF") == "1"


class HandOffSchedule:
    """When the loop should hand the GIL over (pure: times come in as arguments).

    The loop is *busy* from the moment it wakes from a blocking wait (or a hand-off) until it
    blocks again; a hand-off is due after a task step that ends ``slice_s`` or more into a busy
    stretch.
    """

    def __init__(self, slice_s: float = SLICE_S) -> None:
        if slice_s <= 0:
            raise ValueError(f"slice_s must be positive, got {slice_s}")
        self.slice_s = slice_s
        self.busy_since: float | None = None  # None: blocked (or not started)
        self.hand_offs = 0

    def woke(self, now: float) -> None:
        """The loop runs again after a blocking wait or a hand-off."""
        self.busy_since = now

    def blocking(self) -> None:
        """The loop is about to block (its I/O wait has a timeout above 0)."""
        self.busy_since = None

    def after_step(self, now: float) -> bool:
        """A task step ended at ``now``: whether to hand the GIL over now."""
        if self.busy_since is None:  # the first step after a wait we did not see start
            self.busy_since = now
            return False
        if now - self.busy_since < self.slice_s:
            return False
        self.hand_offs += 1
        return True


class GILHandOff(trio.abc.Instrument):
    """The trio instrument applying a :class:`HandOffSchedule` on the loop it is added to."""

    def __init__(
        self,
        slice_s: float = SLICE_S,
        pause_s: float = PAUSE_S,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.schedule = HandOffSchedule(slice_s)
        self.pause_s = pause_s
        self._clock, self._sleep = clock, sleep

    @property
    def hand_offs(self) -> int:
        return self.schedule.hand_offs

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.schedule.after_step(self._clock()):
            self._sleep(self.pause_s)  # blocking on purpose: the GIL is free meanwhile
            self.schedule.woke(self._clock())

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self.schedule.blocking()

    def after_io_wait(self, timeout: float) -> None:
        if self.schedule.busy_since is None:
            self.schedule.woke(self._clock())
