"""trio event-loop lag of a trainer using the trio Optimizer (``Optimizer.create``, issue 19.2).

Three peers (processes) train a small model in epochs of about ``--epoch-seconds``. Peer 0 is
a trio trainer (``async with DHT.create(...)``, ``async with Optimizer.create(...)``,
``await opt.step()``); a ticker task on its loop sleeps ``--tick`` s and records how late it
wakes up. Its loop also runs peer 0's host, DHT, averagers and tracker. The two helper peers
are blocking trainers (``benchmark_asyncio_lag.helper_peer``). ``idle`` is the ticker alone in
the same run (the lag the machine's load gives any loop): the baseline of the ratios.
``--process``: peer 0's gradient rounds run in a helper process (``ProcessGradientAverager``,
whose round starts and controls are pipe messages from the loop). ``--step-time`` also times
a lone peer's steps that only accumulate, blocking ``Optimizer`` (baseline) vs trio, in the
same run. Usage::

    PYTHONPATH=. nice -n 5 python benchmarks/benchmark_trio_lag.py --epochs 6 --step-time
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lag_attribution import suspended_at
from benchmark_asyncio_lag import (
    BATCH,
    HOST,
    STEP_PAUSE,
    batch_loss,
    helper_peer,
    make_model,
    optimizer_options,
    summary,
)

from swarmtrain import DHT, Optimizer
from swarmtrain.optim import ProcessGradientAverager
from swarmtrain.utils import freeze_startup_objects


class SlowSteps(trio.abc.Instrument):
    """Records task steps (the code between two awaits) that held the loop > ``limit`` s of
    wall time or > ``cpu_limit`` s of the loop thread's CPU time. CPU time does not grow with
    the machine's load (waiting for a core or the GIL is not counted), so it finds the code
    that keeps the loop busy on a busy box too."""

    def __init__(self, limit: float = 0.02, cpu_limit: float = 0.005) -> None:
        self.limit, self.cpu_limit, self.started, self.slow = limit, cpu_limit, {}, []
        self.gc_seconds, self._gc_start = 0.0, 0.0  # cyclic GC time of this thread
        self.collections: list[tuple[int, float]] = []  # (generation, seconds)
        self.t0 = time.perf_counter()
        self.intervals: list[tuple[float, float]] = []  # of the slow steps
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            took = time.perf_counter() - self._gc_start
            self.gc_seconds += took
            self.collections.append((info["generation"], took))

    def before_task_step(self, task) -> None:
        self.started[task] = (time.perf_counter(), time.thread_time(), self.gc_seconds)

    def after_task_step(self, task) -> None:
        now = (time.perf_counter(), time.thread_time(), self.gc_seconds)
        wall0, cpu0, gc0 = self.started.pop(task, now)
        took, cpu, in_gc = now[0] - wall0, now[1] - cpu0, now[2] - gc0
        if took > self.limit or cpu > self.cpu_limit:
            at = now[0] - self.t0
            self.slow.append((cpu, took, in_gc, at, task.name, suspended_at(task.coro)))
            self.intervals.append((wall0, now[0]))


class StackSampler:
    """Samples the loop thread's Python stack every ``interval`` s from a helper thread, so
    that the slow steps ``SlowSteps`` found can be attributed to the code they ran."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        self._target = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._target)
            stack = []
            while frame is not None and len(stack) < 40:
                path = "/".join(frame.f_code.co_filename.rsplit("/", 2)[-2:])
                stack.append(f"{path}:{frame.f_lineno} {frame.f_code.co_name}")
                frame = frame.f_back
            self.samples.append((time.perf_counter(), stack))

    def report(self, steps: list, top: int = 12) -> None:
        """The innermost frames of ours or py-libp2p's, most sampled during ``steps``
        (``(start, end)`` intervals)."""
        counts: dict[str, int] = {}
        for at, stack in self.samples:
            if not any(start <= at <= end for start, end in steps):
                continue
            # innermost frame that is not trio's, asyncio's or the stdlib's
            for entry in stack:
                if not entry.startswith(("trio/", "_core/", "python3.11/")):
                    counts[entry] = counts.get(entry, 0) + 1
                    break
        for entry, count in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
            print(f"    {count * 1000 * self.interval:6.0f} ms sampled in {entry}")


class Ticker:
    def __init__(self, tick: float) -> None:
        self.tick, self.lags = tick, []

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await trio.sleep(self.tick)
            self.lags.append(time.perf_counter() - start - self.tick)


async def idle(args) -> dict:
    ticker = Ticker(args.tick)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        await trio.sleep(5.0)
        nursery.cancel_scope.cancel()
    return {"mode": "idle", "epochs": 0, "s_per_epoch": 0.0, **summary(ticker.lags)}


async def trainer(args) -> dict:
    ctx = mp.get_context("spawn")
    run_id = f"trio_lag_{os.getpid()}"
    target = round(3 * BATCH / (STEP_PAUSE + 0.005) * args.epoch_seconds)
    ticker = Ticker(args.tick)
    model = make_model()
    slow = SlowSteps()
    sampler = StackSampler()
    if args.slow_steps:
        trio.lowlevel.add_instrument(slow)
        sampler.start()
    stop, helpers, ready = ctx.Event(), [], []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        async with DHT.create(**HOST) as dht:
            for _ in range(2):
                ready.append(ctx.Event())
                helpers.append(
                    ctx.Process(
                        target=helper_peer,
                        args=(dht.get_visible_maddrs(), run_id, target, stop, ready[-1]),
                        daemon=True,
                    )
                )
                helpers[-1].start()
            options = optimizer_options(run_id, target)
            if args.process:  # peer 0's gradient rounds in a helper process
                options["grad_averager_factory"] = ProcessGradientAverager
            async with Optimizer.create(dht=dht, params=model.parameters(), **options) as opt:
                await trio.to_thread.run_sync(lambda: all(r.wait(120) for r in ready))
                await opt.wait_for_peers(3, timeout=30)
                if args.freeze:
                    print(f"froze {freeze_startup_objects()} objects", flush=True)
                    await trio.sleep(3 * args.tick)  # the tick the freeze delayed, recorded
                ticker.lags.clear()
                slow.slow.clear(), slow.collections.clear(), slow.intervals.clear()
                slow.t0 = time.perf_counter()
                first_epoch, started = opt.local_epoch, time.perf_counter()
                while opt.local_epoch < first_epoch + args.epochs:
                    opt.zero_grad()
                    batch_loss(model).backward()
                    await opt.step()
                    await trio.sleep(STEP_PAUSE)
                elapsed = time.perf_counter() - started
                training = summary(ticker.lags)
                epochs = opt.local_epoch - first_epoch
                stop.set()
        for helper in helpers:
            await trio.to_thread.run_sync(helper.join, 30)
        nursery.cancel_scope.cancel()
    for cpu, took, in_gc, at, name, where in sorted(slow.slow, reverse=True)[:15]:
        print(
            f"  slow step at {at:.1f} s: cpu {1000 * cpu:.1f} ms (gc {1000 * in_gc:.1f}) wall "
            f"{1000 * took:.0f} ms: {name} ({where})"
        )
    if args.slow_steps:
        sampler.stop()
        print("  where the loop thread was during slow steps (outside GC):")
        outside_gc = [
            iv for iv, row in zip(slow.intervals, slow.slow, strict=True) if row[2] < 1e-3
        ]
        sampler.report(outside_gc)
        by_gen = {g: [t for gen, t in slow.collections if gen == g] for g in (0, 1, 2)}
        for g, times in by_gen.items():
            if times:
                print(
                    f"  gc gen{g}: {len(times)} collections, max {1000 * max(times):.1f} ms, "
                    f"total {1000 * sum(times):.0f} ms"
                )
    return {"mode": "trio", "epochs": epochs, "s_per_epoch": elapsed / max(1, epochs), **training}


STEP_OPTIONS = {
    "run_id": "step_time",
    "target_batch_size": 10**9,  # no epoch ends: the cost of a step that accumulates
    "batch_size_per_step": BATCH,
    "optimizer": lambda params: torch.optim.SGD(params, lr=0.01),
}


def blocking_step_times(n: int) -> list[float]:
    dht = DHT(**HOST)
    model = make_model()
    opt = Optimizer(dht=dht, params=model.parameters(), **STEP_OPTIONS)
    times = []
    try:
        for _ in range(n):
            batch_loss(model).backward()
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
            opt.zero_grad()
    finally:
        opt.shutdown()
        dht.shutdown()
    return times


async def trio_step_times(n: int) -> list[float]:
    model = make_model()
    times = []
    async with DHT.create(**HOST) as dht:
        async with Optimizer.create(dht=dht, params=model.parameters(), **STEP_OPTIONS) as opt:
            for _ in range(n):
                batch_loss(model).backward()
                started = time.perf_counter()
                await opt.step()
                times.append(time.perf_counter() - started)
                opt.zero_grad()
    return times


def step_times(n: int = 400) -> None:
    """A lone peer's ``step`` that only accumulates: blocking (baseline) vs trio, same run."""
    results = {}
    for name, run in (
        ("blocking", lambda: blocking_step_times(n)),
        ("trio", lambda: trio.run(trio_step_times, n)),
    ):
        times = sorted(run()[50:])  # after warm-up
        results[name] = statistics.median(times)
        p90 = times[int(0.9 * len(times))]
        print(f"{name:8s} step median {1e3 * results[name]:.3f} ms, p90 {1e3 * p90:.3f} ms")
    print(f"trio/blocking step median: {results['trio'] / results['blocking']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--epoch-seconds", type=float, default=1.0)
    parser.add_argument("--tick", type=float, default=0.005)
    parser.add_argument("--step-time", action="store_true", help="also time accumulating steps")
    parser.add_argument(
        "--process",
        action="store_true",
        help="peer 0's gradient rounds in a helper process (ProcessGradientAverager)",
    )
    parser.add_argument(
        "--slow-steps",
        action="store_true",
        help="list task steps that held the loop > 20 ms (wall) or > 5 ms (CPU)",
    )
    parser.add_argument(
        "--freeze",
        action="store_true",
        help="swarmtrain.utils.freeze_startup_objects() before training (no full GC walks)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}")
    results = {}
    for mode, fn in (("idle", idle), ("trio", trainer)):
        results[mode] = r = trio.run(fn, args)
        print(
            f"{mode:5s} epochs={r['epochs']} {r['s_per_epoch']:.2f} s/epoch ticks={r['n']} "
            f"lag p50={r['p50_ms']:.1f} ms p99={r['p99_ms']:.1f} ms max={r['max_ms']:.1f} ms",
            flush=True,
        )
    if args.step_time:
        step_times()
    base, new = results["idle"], results["trio"]
    print(
        f"trio/idle: p99 {new['p99_ms'] / max(base['p99_ms'], 1e-3):.1f}x, "
        f"max {new['max_ms'] / max(base['max_ms'], 1e-3):.1f}x"
    )
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
