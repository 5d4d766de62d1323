"""Find what blocks a trio event loop: task steps that ran longer than a threshold.

A trio task runs from one ``await`` that suspends to the next without giving the loop back; a
*step* that takes 8 s freezes every other task of the process (a peer's gossip, its DHT
answers, its all-reduce parts) for 8 s. :class:`LoopStallDetector` is a trio
``Instrument`` that times every step and records those over ``threshold`` seconds:

- the task's name, where it resumed (the ``await`` its step started from) and where it
  suspended again (the next ``await``; empty when the task finished), the innermost frames of
  our code or a library's, not trio's;
- the step's wall time, the loop thread's CPU time during it (``time.thread_time``), on Linux
  its time runnable but not on a core (the run queue, ``/proc/.../schedstat``), and the
  garbage collector's time in that thread, so a stall is one of: *gc* (mostly a cyclic
  collection), *starved* (waiting for a core: the machine's load), *waiting* (neither running
  nor runnable: waiting for the GIL that another thread of the process holds, or in a
  blocking call) or *blocking* (the step's own CPU work: serialization, tensor math);
- with ``sample_stacks`` (default), a watchdog thread that looks every ``threshold / 2`` s
  and, while one step is still running past the threshold, takes the loop thread's stack:
  the code that actually held the loop, which the two ``await`` points only bracket.

Memory is bounded: the last ``max_records`` stalls are kept, plus counters and a fixed
log-scale histogram of every step's wall time (for percentiles). Each stall is logged at
WARNING on this module's logger.

Off by default. ``SWARMTRAIN_LOOP_STALLS=0.1`` (seconds) in the environment makes every
swarmtrain host (``P2P.create``, so every DHT, averager and optimizer, trio or blocking) add a
detector to the loop it runs in, once per loop. In code: ``watch_loop_stalls(0.1)`` from a
trio task (returns the detector, idempotent per loop), or ``detect_loop_stalls(0.1)`` as a
context manager around part of a run.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import trio

from swarmtrain.utils.thread_probes import (
    awaiting_at,
    awaiting_position,
    busiest,
    code_text,
    other_threads_at,
    thread_stack,
    threads_cpu,
)

logger = logging.getLogger(__name__)

#: the environment variable: a threshold in seconds (``0.1``); unset, empty or ``0``: off
LOOP_STALLS_ENV = "SWARMTRAIN_LOOP_STALLS"
DEFAULT_THRESHOLD = 0.1
DEFAULT_MAX_RECORDS = 256
#: a stall whose CPU time is below this fraction of its wall time was not running: it waited
#: (for a core: starved; for the GIL, a lock or a call: waiting)
STARVED_CPU_FRACTION = 0.5
#: the task name of a stall outside task steps: an I/O wait that overran its timeout
IO_WAIT_TASK = "<trio scheduler: I/O wait past its timeout>"

_detector_of_run: trio.lowlevel.RunVar[LoopStallDetector] = trio.lowlevel.RunVar(
    "swarmtrain_loop_stall_detector"
)


@dataclass(frozen=True)
class LoopStall:
    """One task step that held the loop longer than the threshold."""

    task: str
    wall_s: float
    cpu_s: float  # the loop thread's CPU time during the step
    gc_s: float  # cyclic garbage collection in the loop thread during the step
    resumed_at: str  # ``path:line function`` of the await the step started from
    suspended_at: str  # the await it stopped at; "" if the task finished
    ended_at: float  # ``time.time()`` when the step ended
    stack: tuple[str, ...] = ()  # the loop thread's stack sampled during the step, innermost first
    runqueue_s: float | None = None  # runnable but not on a core (Linux); None: unknown
    gc_others_s: float = 0.0  # collections in other threads meanwhile (they hold the GIL)
    #: other threads' CPU seconds during the step (from the watchdog's last look before it,
    #: at most ``threshold / 2`` earlier), busiest first (Linux): who held the GIL meanwhile
    busy_threads: tuple[tuple[str, float], ...] = ()
    #: where the other threads were when the watchdog sampled the loop's stack (by name)
    others_at: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``gc`` (a cyclic collection took half the step or more); else, with CPU time well
        below wall time, ``starved`` (most of the rest in the run queue, or unknown) or
        ``waiting`` (the GIL, a lock, a blocking call); else ``blocking``."""
        if self.gc_s + self.gc_others_s >= 0.5 * self.wall_s:
            return "gc"
        if self.cpu_s < STARVED_CPU_FRACTION * self.wall_s:
            off_cpu = self.wall_s - self.cpu_s
            if self.runqueue_s is None or self.runqueue_s >= 0.5 * off_cpu:
                return "starved"
            return "waiting"
        return "blocking"

    def describe(self) -> str:
        where = self.stack[0] if self.stack else self.suspended_at or "(task finished)"
        others = ""
        if self.gc_others_s:
            others += f", gc in other threads {_ms(self.gc_others_s)}"
        if self.busy_threads:
            busy = ", ".join(
                f"{name} {_ms(cpu)}"
                + (f" at {self.others_at[name]}" if name in self.others_at else "")
                for name, cpu in self.busy_threads
            )
            others += f", other threads' cpu: {busy}"
        return (
            f"{self.wall_s * 1000:.0f} ms ({self.kind}: cpu {self.cpu_s * 1000:.0f} ms, "
            f"gc {self.gc_s * 1000:.0f} ms, run queue {_ms(self.runqueue_s)}{others}) "
            f"in task {self.task!r}, "
            f"from {self.resumed_at} to {self.suspended_at or '(task finished)'}; at {where}"
        )


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f} ms"


@dataclass(frozen=True)
class LoopStallStatistics:
    steps: int
    stalls: int
    starved: int
    waiting: int
    gc: int
    blocking: int
    max_stall_s: float
    stalled_s: float  # total wall time of the stalls
    step_p99_s: float  # upper bound of the 99th percentile of every step's wall time
    step_max_s: float


class StepHistogram:
    """Counts durations in fixed log-scale buckets (4 per doubling, 10 us to ~3 h): bounded
    memory, percentiles accurate to a bucket (19%)."""

    BASE_S = 1e-5
    PER_DOUBLING = 4
    BUCKETS = 4 * 30

    def __init__(self) -> None:
        self.counts = [0] * self.BUCKETS
        self.total = 0

    def add(self, seconds: float) -> None:
        if seconds <= self.BASE_S:
            index = 0
        else:
            index = int(math.log2(seconds / self.BASE_S) * self.PER_DOUBLING) + 1
        self.counts[min(index, self.BUCKETS - 1)] += 1
        self.total += 1

    def upper_bound(self, index: int) -> float:
        return self.BASE_S * 2 ** (index / self.PER_DOUBLING)

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the ``q`` quantile (0 when empty)."""
        if not self.total:
            return 0.0
        rank = math.ceil(q * self.total)
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return self.upper_bound(index)
        return self.upper_bound(self.BUCKETS - 1)


class LoopStallDetector(trio.abc.Instrument):
    """A trio instrument recording task steps longer than ``threshold`` seconds (see the
    module's docstring). Add it with ``watch_loop_stalls`` or ``detect_loop_stalls``; read
    ``stalls`` and ``statistics()``; ``close()`` (or the end of the run) stops its watchdog."""

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        max_records: int = DEFAULT_MAX_RECORDS,
        sample_stacks: bool = True,
        log: bool = True,
    ) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be positive seconds, got {threshold}")
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        self.threshold = threshold
        self.log = log
        self._records: deque[LoopStall] = deque(maxlen=max_records)
        self._histogram = StepHistogram()
        self._counts = {"starved": 0, "waiting": 0, "gc": 0, "blocking": 0}
        self._max_stall = self._stalled = self._max_step = 0.0
        self._loop_ident: int | None = None
        # the running step: (perf_counter, thread_time, gc seconds, run queue, other threads'
        # gc seconds); None between steps
        self._step: tuple[float, float, float, float, float] | None = None
        self._schedstat: int | None = None  # the loop thread's /proc schedstat (Linux)
        self._resumed_at: tuple[CodeType, int | None] | None = None
        self._step_seq = 0
        # the I/O wait in progress: (perf_counter, timeout, thread_time, run queue, other
        # threads' gc seconds); None between waits
        self._io_wait: tuple[float, float, float, float, float] | None = None
        self._gc_seconds = 0.0  # in the loop thread
        self._gc_other_seconds = 0.0  # in other threads
        self._gc_started: float | None = None
        # (step seq, the loop thread's stack, {other thread's name: its innermost frame})
        self._sampled: tuple[int, tuple[str, ...], dict[str, str]] | None = None
        # (perf_counter, {native thread id: (name, cpu seconds)}) noted by the watchdog (Linux),
        # the last 32 thresholds' worth: a longer stall counts other threads' CPU from then
        self._threads_seen: deque[tuple[float, dict[int, tuple[str, float]]]] | None = (
            deque(maxlen=64) if sys.platform == "linux" else None
        )
        self._lock = threading.Lock()  # the watchdog's sample vs. the step's end
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._sample_stacks = sample_stacks
        gc.callbacks.append(self._on_gc)

    # ------------------------------------------------------------------ reading

    @property
    def stalls(self) -> tuple[LoopStall, ...]:
        """The most recent stalls, oldest first (at most ``max_records``)."""
        return tuple(self._records)

    def statistics(self) -> LoopStallStatistics:
        counts = self._counts
        return LoopStallStatistics(
            steps=self._histogram.total,
            stalls=sum(counts.values()),
            starved=counts["starved"],
            waiting=counts["waiting"],
            gc=counts["gc"],
            blocking=counts["blocking"],
            max_stall_s=self._max_stall,
            stalled_s=self._stalled,
            step_p99_s=self._histogram.quantile(0.99),
            step_max_s=self._max_step,
        )

    def close(self) -> None:
        """Stop the watchdog thread and the GC callback (idempotent). Records stay readable."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()

    # ------------------------------------------------------------------ trio hooks

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._loop_ident is None:
            self._start(threading.get_ident())
        self._step_seq += 1
        self._resumed_at = awaiting_position(task.coro)
        self._step = (
            time.perf_counter(),
            time.thread_time(),
            self._gc_seconds,
            self._runqueue(),
            self._gc_other_seconds,
        )

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        step = self._step
        if step is None:
            return  # the step that added this instrument
        wall, cpu = time.perf_counter() - step[0], time.thread_time() - step[1]
        self._step = None
        self._histogram.add(wall)
        if wall > self._max_step:
            self._max_step = wall
        if wall <= self.threshold:
            return
        with self._lock:
            sampled = self._sampled
            seq = self._step_seq
        stall = LoopStall(
            task=task.name,
            wall_s=wall,
            cpu_s=cpu,
            runqueue_s=None if self._schedstat is None else self._runqueue() - step[3],
            gc_s=self._gc_seconds - step[2],
            resumed_at="" if self._resumed_at is None else code_text(*self._resumed_at),
            suspended_at=awaiting_at(task.coro),
            ended_at=time.time(),
            stack=sampled[1] if sampled is not None and sampled[0] == seq else (),
            gc_others_s=self._gc_other_seconds - step[4],
            busy_threads=self._busy_since(step[0]),
            others_at=sampled[2] if sampled is not None and sampled[0] == seq else {},
        )
        self._record(stall)

    def _busy_since(self, started: float) -> tuple[tuple[str, float], ...]:
        """Other threads' CPU since the watchdog's last note before ``started``."""
        seen = list(self._threads_seen or ())
        before = [threads for at, threads in seen if at <= started]
        if before:
            return busiest(before[-1])
        return busiest(seen[0][1]) if seen else ()

    def before_io_wait(self, timeout: float) -> None:
        self._io_wait = (
            time.perf_counter(),
            timeout,
            time.thread_time(),
            self._runqueue(),
            self._gc_other_seconds,
        )

    def after_io_wait(self, timeout: float) -> None:
        """A wait for I/O that overran its timeout: the loop could not run when it was due
        (no core, or the GIL held by another thread): a stall outside any task step."""
        wait = self._io_wait
        if wait is None:
            return
        self._io_wait = None
        overrun = time.perf_counter() - wait[0] - wait[1]
        if overrun <= self.threshold:
            return
        stall = LoopStall(
            task=IO_WAIT_TASK,
            wall_s=overrun,
            cpu_s=time.thread_time() - wait[2],
            gc_s=0.0,
            resumed_at="(I/O wait)",
            suspended_at="(I/O wait)",
            ended_at=time.time(),
            runqueue_s=None if self._schedstat is None else self._runqueue() - wait[3],
            gc_others_s=self._gc_other_seconds - wait[4],
            busy_threads=self._busy_since(wait[0] + wait[1]),
        )
        self._record(stall)

    def after_run(self) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _record(self, stall: LoopStall) -> None:
        self._records.append(stall)
        self._counts[stall.kind] += 1
        self._stalled += stall.wall_s
        self._max_stall = max(self._max_stall, stall.wall_s)
        if self.log:
            logger.warning("trio loop stalled %s", stall.describe())

    def _runqueue(self) -> float:
        """The loop thread's total run-queue wait in seconds (0.0 where unknown)."""
        if self._schedstat is None:
            return 0.0
        try:
            return int(os.pread(self._schedstat, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _start(self, ident: int) -> None:
        self._loop_ident = ident
        try:
            path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
            self._schedstat = os.open(path, os.O_RDONLY)
        except OSError:
            self._schedstat = None  # not Linux, or no schedstats: stalls say "starved"
        if self._sample_stacks and not self._closed.is_set():
            self._watchdog = threading.Thread(
                target=self._watch, name="swarmtrain-loop-stall-watchdog", daemon=True
            )
            self._watchdog.start()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # collections never overlap (each holds the GIL), so one start time serves all threads
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            took = time.perf_counter() - self._gc_started
            self._gc_started = None
            if threading.get_ident() == self._loop_ident:
                self._gc_seconds += took
            else:
                self._gc_other_seconds += took

    def _watch(self) -> None:
        """Every ``threshold / 2`` s: note the other threads' CPU clocks (so a stall can say
        who ran during it, even when a thread held the GIL so long that this thread could not
        run); take the loop thread's stack once per step that runs past the threshold."""
        assert self._loop_ident is not None
        interval = self.threshold / 2
        exclude: set[int | None] = {self._loop_ident, threading.get_ident()}
        while not self._closed.wait(interval):
            if self._threads_seen is not None:
                self._threads_seen.append((time.perf_counter(), threads_cpu(exclude)))
            step, seq = self._step, self._step_seq
            if step is None or time.perf_counter() - step[0] <= self.threshold:
                continue
            if self._sampled is not None and self._sampled[0] == seq:
                continue
            stack = thread_stack(self._loop_ident)
            others = other_threads_at(exclude)
            with self._lock:
                if self._step_seq == seq and self._step is step:
                    self._sampled = (seq, stack, others)


# ---------------------------------------------------------------------- switching it on


def threshold_from_env() -> float | None:
    """``SWARMTRAIN_LOOP_STALLS`` as seconds; None when unset, empty, ``0`` or not a number
    (the last with a warning)."""
    text = os.environ.get(LOOP_STALLS_ENV, "").strip()
    if not text:
        return None
    try:
        threshold = float(text)
    except ValueError:
        logger.warning("%s=%r is not a number of seconds: ignored", LOOP_STALLS_ENV, text)
        return None
    if not math.isfinite(threshold) or threshold < 0:
        logger.warning("%s=%r is not a positive number of seconds: ignored", LOOP_STALLS_ENV, text)
        return None
    return threshold or None


def watch_loop_stalls(threshold: float = DEFAULT_THRESHOLD, **kwargs: Any) -> LoopStallDetector:
    """Add a :class:`LoopStallDetector` to the running trio loop, or return the one already
    added by this function (its threshold unchanged). Call from a trio task. It stays for the
    rest of the run (``detect_loop_stalls`` removes its detector)."""
    try:
        return _detector_of_run.get()
    except LookupError:
        pass
    detector = LoopStallDetector(threshold, **kwargs)
    trio.lowlevel.add_instrument(detector)
    _detector_of_run.set(detector)
    return detector


def watch_from_env() -> LoopStallDetector | None:
    """``watch_loop_stalls`` with ``SWARMTRAIN_LOOP_STALLS``'s threshold when it is set (every
    swarmtrain host calls this when it starts); None when it is not."""
    threshold = threshold_from_env()
    if threshold is None:
        return None
    return watch_loop_stalls(threshold)


@contextmanager
def detect_loop_stalls(
    threshold: float = DEFAULT_THRESHOLD, **kwargs: Any
) -> Iterator[LoopStallDetector]:
    """A detector on the running trio loop for the ``with`` block only (then removed and
    closed; its records stay readable)."""
    detector = LoopStallDetector(threshold, **kwargs)
    trio.lowlevel.add_instrument(detector)
    try:
        yield detector
    finally:
        try:
            trio.lowlevel.remove_instrument(detector)
        except KeyError:
            pass
        detector.close()
