"""Who delayed an asyncio loop's late ticks: per-thread CPU, run-queue waits, GC, trio steps.

Used by ``benchmark_asyncio_lag.py --attribute``. Nothing here samples from a thread of its
own (a sampler would be one more thread wanting the GIL). Instead, at every tick the ticker
reads, from the kernel:

- each Python thread's CPU clock (``time.pthread_getcpuclockid``), grouped by role: the asyncio
  loop (main thread), swarmtrain's background trio loop, the optimizer's ``swarmtrain-aio``
  worker, trio's worker threads, others;
- the main thread's and the background loop's run-queue waits (``/proc/.../schedstat``: time
  runnable but not on a core, i.e. the machine's load, not the GIL).

So a tick's interval (the previous wake-up to this one) splits into the main thread's own CPU,
its run-queue wait, and the rest: blocked, which beyond the requested sleep is the GIL (or a
lock). The other threads' CPU in the same interval says who held the GIL meanwhile.
``gc.callbacks`` records every collection (thread, generation, duration); a trio
``Instrument`` on the background loop records its task steps, so the loop's work during late
ticks is listed by task.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import defaultdict

import trio

ROLES = ("asyncio", "trio loop", "aio worker", "trio workers", "other")


def _role(thread: threading.Thread, loop_ident: int | None) -> str:
    if thread is threading.main_thread():
        return "asyncio"
    if thread.ident == loop_ident:
        return "trio loop"
    if thread.name.startswith("swarmtrain-aio"):
        return "aio worker"
    if thread.name.startswith("Trio thread"):
        return "trio workers"
    return "other"


class _Schedstat:
    """A thread's (CPU ns, run-queue wait ns) from ``/proc/self/task/<tid>/schedstat``."""

    def __init__(self, native_id: int) -> None:
        self._fd = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY)

    def read(self) -> tuple[float, float]:
        cpu, wait, _ = os.pread(self._fd, 128, 0).split()
        return int(cpu) / 1e9, int(wait) / 1e9

    def close(self) -> None:
        os.close(self._fd)


class ThreadClocks:
    """CPU seconds per role and run-queue waits, read at once (a few microseconds)."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        self.loop_ident = loop_thread.ident
        self._clocks: dict[int, tuple[str, int]] = {}
        self._main_sched = _Schedstat(threading.main_thread().native_id or 0)
        self._loop_sched = _Schedstat(loop_thread.native_id or 0)
        self._seen = 0

    def _refresh(self) -> None:
        threads = threading.enumerate()
        if len(threads) == self._seen:
            return
        self._seen = len(threads)
        for thread in threads:
            if thread.ident is not None and thread.ident not in self._clocks:
                try:
                    clock = time.pthread_getcpuclockid(thread.ident)
                except OSError:
                    continue
                self._clocks[thread.ident] = (_role(thread, self.loop_ident), clock)

    def read(self) -> dict[str, float]:
        self._refresh()
        out = dict.fromkeys(ROLES, 0.0)
        for ident, (role, clock) in list(self._clocks.items()):
            try:
                out[role] += time.clock_gettime(clock)
            except OSError:  # the thread ended: its CPU leaves the sums (intervals below
                del self._clocks[ident]  # clamp at 0)
        out["asyncio runq"] = self._main_sched.read()[1]
        out["trio loop runq"] = self._loop_sched.read()[1]
        return out

    def close(self) -> None:
        self._main_sched.close()
        self._loop_sched.close()


class GCRecorder:
    """Every cyclic collection of the process: (thread role, generation, start, end)."""

    def __init__(self, loop_ident: int | None) -> None:
        self.loop_ident = loop_ident
        self.collections: list[tuple[str, int, float, float]] = []
        self._start: dict[int, float] = {}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._start[ident] = time.perf_counter()
            return
        start = self._start.pop(ident, None)
        if start is not None:
            role = _role(threading.current_thread(), self.loop_ident)
            self.collections.append((role, info["generation"], start, time.perf_counter()))

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def suspended_at(coro) -> str:
    """Where a task waits now: its innermost coroutine frame outside trio and contextlib."""
    where = "?"
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            path = frame.f_code.co_filename
            if "/trio/" not in path and not path.endswith("contextlib.py"):
                name = "/".join(path.rsplit("/", 2)[-2:])
                where = f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return where


class LoopSteps(trio.abc.Instrument):
    """The background trio loop's task steps over ``min_cpu`` s of CPU, and its busy stretches
    (from one blocking I/O wait to the next: the GIL is free only while the loop blocks)."""

    def __init__(self, min_cpu: float = 0.0005) -> None:
        self.min_cpu = min_cpu
        self.steps: list[tuple[float, float, float, str]] = []  # (start, end, cpu, task @ where)
        self.cpu_by_task: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # every step
        self.busy: list[tuple[float, float]] = []  # stretches without a blocking wait
        self._step_start: tuple[float, float] | None = None  # None: added mid-step
        self._busy_since: float | None = None

    def before_task_step(self, task) -> None:
        self._step_start = (time.perf_counter(), time.thread_time())

    def after_task_step(self, task) -> None:
        if self._step_start is None:
            return
        wall0, cpu0 = self._step_start
        cpu = time.thread_time() - cpu0
        row = self.cpu_by_task[task.name]
        row[0] += cpu
        row[1] += 1
        if cpu >= self.min_cpu:
            where = f"{task.name} @ {suspended_at(task.coro)}"
            self.steps.append((wall0, time.perf_counter(), cpu, where))

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0 and self._busy_since is not None:
            self.busy.append((self._busy_since, time.perf_counter()))
            self._busy_since = None

    def after_io_wait(self, timeout: float) -> None:
        if self._busy_since is None:
            self._busy_since = time.perf_counter()


class LoopSampler:
    """Samples the background loop thread's stack every ``interval`` s from a thread of its own
    (one more thread wanting the GIL: use it to see what the big task steps ran, not to time)."""

    def __init__(self, ident: int | None, interval: float = 0.002) -> None:
        self.ident, self.interval = ident, interval
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lag-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.ident)
            stack = []
            while frame is not None and len(stack) < 40:
                path = "/".join(frame.f_code.co_filename.rsplit("/", 2)[-2:])
                stack.append(f"{path}:{frame.f_lineno} {frame.f_code.co_name}")
                frame = frame.f_back
            self.samples.append((time.perf_counter(), tuple(stack)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, intervals: list[tuple[float, float]], top: int = 15) -> list[str]:
        """The innermost frames outside trio and the stdlib sampled inside ``intervals``,
        with the first swarmtrain frame above them."""
        counts: dict[str, int] = defaultdict(int)
        for at, stack in self.samples:
            if not any(start <= at <= end for start, end in intervals):
                continue
            inner = next((e for e in stack if not e.startswith(_SKIP)), "?")
            ours = next((e for e in stack if e.split("/")[0] in _OURS), "")
            counts[f"{inner}  <- {ours}" if ours and ours != inner else inner] += 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        if not ranked:
            return [f"    no sample inside them ({len(self.samples)} samples in all)"]
        return [f"    {n * 1000 * self.interval:6.0f} ms sampled in {where}" for where, n in ranked]


_SKIP = ("trio/", "_core/", "python3.11/", "concurrent/", "threading.py", "contextlib.py")
_OURS = {"p2p", "dht", "averaging", "optim", "compression", "utils", "monitor"}


class Attribution:
    """Per-tick records and the report over the late ones."""

    def __init__(self, runtime, tick: float, sample_stacks: bool = False) -> None:
        self.tick = tick
        self.runtime = runtime
        loop_thread = runtime.call_sync(threading.current_thread)
        self.clocks = ThreadClocks(loop_thread)
        self.gc = GCRecorder(loop_thread.ident)
        self.steps = LoopSteps()
        runtime.call_sync(trio.lowlevel.add_instrument, self.steps)
        self.sampler = LoopSampler(loop_thread.ident) if sample_stacks else None
        self.ticks: list[tuple[float, float, float, dict[str, float]]] = []
        self._last: tuple[float, dict[str, float]] | None = None

    def on_wake(self, lag: float) -> None:
        """Called by the ticker right after each wake-up."""
        now, clocks = time.perf_counter(), self.clocks.read()
        if self._last is not None:
            then, before = self._last
            delta = {k: max(0.0, clocks[k] - before[k]) for k in clocks}
            self.ticks.append((then, now, lag, delta))
        self._last = (now, clocks)

    def reset(self) -> None:
        self.ticks.clear()
        self.gc.collections.clear()
        self.steps.steps.clear()
        self.steps.busy.clear()
        self.steps.cpu_by_task.clear()
        if self.sampler is not None:
            self.sampler.samples.clear()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        try:
            self.runtime.call_sync(trio.lowlevel.remove_instrument, self.steps)
        except (RuntimeError, KeyError):
            pass
        self.gc.close()
        self.clocks.close()

    def report(self, late: float = 0.010) -> str:
        lines = []
        for label, rows in (
            ("all ticks", self.ticks),
            (f"ticks late > {1000 * late:.0f} ms", [t for t in self.ticks if t[2] > late]),
        ):
            if not rows:
                lines.append(f"  {label}: none")
                continue
            total = defaultdict(float)
            wall = lag = 0.0
            for start, end, tick_lag, delta in rows:
                wall += end - start
                lag += tick_lag
                for k, v in delta.items():
                    total[k] += v
            blocked = wall - total["asyncio"] - total["asyncio runq"] - len(rows) * self.tick
            lines.append(
                f"  {label}: {len(rows)} ticks, {1000 * wall:.0f} ms, lag {1000 * lag:.0f} ms; "
                f"per tick: lag {1000 * lag / len(rows):.1f} ms = asyncio CPU "
                f"{1000 * total['asyncio'] / len(rows):.1f} + its run-queue wait "
                f"{1000 * total['asyncio runq'] / len(rows):.1f} + blocked beyond the sleep "
                f"(GIL) {1000 * blocked / len(rows):.1f} ms (- the tick's own work)"
            )
            shares = ", ".join(
                f"{role} {100 * total[role] / wall:.0f}%" for role in ROLES if total[role] > 0
            )
            lines.append(
                f"    CPU as % of those intervals: {shares}; trio loop run-queue wait "
                f"{100 * total['trio loop runq'] / wall:.0f}%"
            )
        late_rows = [(s, e) for s, e, tick_lag, _ in self.ticks if tick_lag > late]
        lines.append(self._gc_report(late_rows))
        lines.extend(self._steps_report(late_rows))
        return "\n".join(lines)

    def _gc_report(self, late_rows: list[tuple[float, float]]) -> str:
        overlap = defaultdict(float)
        for role, gen, start, end in self.gc.collections:
            for s, e in late_rows:
                overlap[(role, gen)] += max(0.0, min(end, e) - max(start, s))
        counts = defaultdict(lambda: [0, 0.0, 0.0])
        for role, gen, start, end in self.gc.collections:
            c = counts[(role, gen)]
            c[0] += 1
            c[1] += end - start
            c[2] = max(c[2], end - start)
        parts = [
            f"{role} gen{gen}: {n} ({1000 * t:.0f} ms, max {1000 * m:.1f} ms, "
            f"{1000 * overlap[(role, gen)]:.0f} ms inside late ticks)"
            for (role, gen), (n, t, m) in sorted(counts.items())
        ]
        return "  gc: " + ("; ".join(parts) if parts else "no collections")

    def _steps_report(self, late_rows: list[tuple[float, float]], top: int = 12) -> list[str]:
        by_where: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
        for start, end, cpu, where in self.steps.steps:
            if any(start < e and end > s for s, e in late_rows):
                row = by_where[where]
                row[0] += cpu
                row[1] += 1
                row[2] = max(row[2], cpu)
        busy_in_late = sum(
            max(0.0, min(end, e) - max(start, s))
            for start, end in self.steps.busy
            for s, e in late_rows
        )
        late_wall = sum(e - s for s, e in late_rows) or 1e-9
        longest = sorted((end - start for start, end in self.steps.busy), reverse=True)[:5]
        lines = [
            f"  trio loop busy (no blocking wait) {100 * busy_in_late / late_wall:.0f}% of late "
            f"ticks' time; longest busy stretches {[round(1000 * b) for b in longest]} ms",
            "  trio loop task steps (>= 0.5 ms CPU) overlapping late ticks, by CPU:",
        ]
        for where, (cpu, n, biggest) in sorted(by_where.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(
                f"    {1000 * cpu:7.1f} ms in {n:4d} steps (max {1000 * biggest:5.1f}) {where}"
            )
        total = sum(cpu for cpu, _ in self.steps.cpu_by_task.values())
        big = [row for row in self.steps.steps if row[2] > 0.005]
        lines.append(f"  trio loop task steps over 5 ms CPU: {len(big)}, largest first:")
        for start, end, cpu, where in sorted(big, key=lambda r: -r[2])[:top]:
            in_gc = sum(
                max(0.0, min(end, e) - max(start, s))
                for role, _, s, e in self.gc.collections
                if role == "trio loop"
            )
            lines.append(
                f"    {1000 * cpu:6.1f} ms CPU ({1000 * (end - start):.0f} ms wall, gc "
                f"{1000 * in_gc:.0f} ms) {where}"
            )
        if self.sampler is not None and big:
            lines.append("  where the loop thread was during those steps (stack samples):")
            lines.extend(self.sampler.report([(s, e) for s, e, _, _ in big]))
        lines.append(f"  trio loop task steps, whole run: {1000 * total:.0f} ms CPU, by task:")
        ranked = sorted(self.steps.cpu_by_task.items(), key=lambda kv: -kv[1][0])
        for name, (cpu, n) in ranked[:top]:
            lines.append(f"    {1000 * cpu:7.1f} ms in {n:5d} steps {name}")
        return lines
