"""trio event-loop lag of a trainer using the trio Optimizer (``Optimizer.create``, issue 19.2).

Three peers (processes) train a small model in epochs of about ``--epoch-seconds``. Peer 0 is
a trio trainer (``async with DHT.create(...)``, ``async with Optimizer.create(...)``,
``await opt.step()``); a ticker task on its loop sleeps ``--tick`` s and records how late it
wakes up. Its loop also runs peer 0's host, DHT, averagers and tracker. The two helper peers
are blocking trainers (``benchmark_asyncio_lag.helper_peer``). ``idle`` is the ticker alone in
the same run (the lag the machine's load gives any loop): the baseline of the ratios. Usage::

    PYTHONPATH=. nice -n 5 python benchmarks/benchmark_trio_lag.py --epochs 6
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
            async with Optimizer.create(dht=dht, params=model.parameters(), **options) as opt:
                await trio.to_thread.run_sync(lambda: all(r.wait(120) for r in ready))
                await opt.wait_for_peers(3, timeout=30)
                ticker.lags.clear()
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
    return {"mode": "trio", "epochs": epochs, "s_per_epoch": elapsed / max(1, epochs), **training}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--epoch-seconds", type=float, default=1.0)
    parser.add_argument("--tick", type=float, default=0.005)
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
    base, new = results["idle"], results["trio"]
    print(
        f"trio/idle: p99 {new['p99_ms'] / max(base['p99_ms'], 1e-3):.1f}x, "
        f"max {new['max_ms'] / max(base['max_ms'], 1e-3):.1f}x"
    )
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
