"""asyncio event-loop lag of a trainer using swarmtrain's Optimizer (issue 19 item 2).

Three peers (processes) train a small model in epochs of about ``--epoch-seconds``. Peer 0 is
an asyncio trainer; a ticker task on its loop sleeps ``--tick`` s and records how late it
wakes up. Two modes, each with fresh helper peers, in the same run:

- ``blocking`` (the baseline): ``opt.step()`` called on the asyncio loop, constructors too;
- ``aio``: ``await opt.aio.step()``, ``await DHT.aio_create(...)``,
  ``await Optimizer.aio_create(...)``.

Prints lag p50 / p99 / max while training (and max during startup) per mode, and the ratio of
the baseline's p99 / max to ``aio``'s. Usage::

    nice -n 5 python benchmarks/benchmark_asyncio_lag.py --epochs 8
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import torch

import swarmtrain

# at module level: swarmtrain's names are imported lazily, and the first use of ``swarmtrain.DHT``
# (libp2p) or ``swarmtrain.Optimizer`` takes 1-2 s, which would block the loop wherever it happens
from swarmtrain import DHT, Optimizer  # noqa: F401
from swarmtrain.utils import freeze_startup_objects

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FEATURES, BATCH, STEP_PAUSE = 64, 8, 0.02
TRACKER = {"gossip_period": 0.1, "min_refresh_period": 0.2}


def optimizer_options(run_id: str, target: int) -> dict:
    return {
        "run_id": run_id,
        "target_batch_size": target,
        "batch_size_per_step": BATCH,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.01),
        "matchmaking_time": 0.5,
        "averaging_timeout": 10.0,
        "tracker_opts": TRACKER,
    }


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )


def batch_loss(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(BATCH, FEATURES)
    return model(x).pow(2).mean()


def helper_peer(maddrs: list[str], run_id: str, target: int, stop, ready) -> None:
    """A blocking trainer in its own process, stepping until ``stop`` is set."""
    torch.set_num_threads(1)
    dht = swarmtrain.DHT(maddrs, **HOST)
    model = make_model()
    opt = swarmtrain.Optimizer(
        dht=dht, params=model.parameters(), **optimizer_options(run_id, target)
    )
    ready.set()
    try:
        while not stop.is_set():
            opt.zero_grad()
            batch_loss(model).backward()
            opt.step()
            time.sleep(STEP_PAUSE)
    finally:
        opt.shutdown(timeout=5)
        dht.shutdown(timeout=5)


class Ticker:
    def __init__(self, tick: float) -> None:
        self.tick, self.lags = tick, []

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.tick)
            self.lags.append(time.perf_counter() - start - self.tick)


def summary(lags: list[float]) -> dict:
    ordered = sorted(lags)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "n": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * p99,
        "max_ms": 1000 * ordered[-1],
    }


async def idle(args) -> dict:
    """The ticker alone for 5 s: the lag this machine's load gives any asyncio loop."""
    ticker = Ticker(args.tick)
    ticking = asyncio.create_task(ticker.run())
    await asyncio.sleep(5.0)
    ticking.cancel()
    return {
        "mode": "idle",
        "epochs": 0,
        "s_per_epoch": 0.0,
        "startup_max_ms": 0.0,
        **summary(ticker.lags),
    }


async def trainer(mode: str, args) -> dict:
    ctx = mp.get_context("spawn")
    run_id = f"lag_{mode}_{os.getpid()}"
    target = round(3 * BATCH / (STEP_PAUSE + 0.005) * args.epoch_seconds)
    ticker = Ticker(args.tick)
    ticking = asyncio.create_task(ticker.run())
    if args.debug_slow:  # log each callback that ran on the loop for > 50 ms (what blocked it)
        asyncio.get_running_loop().set_debug(True)
        asyncio.get_running_loop().slow_callback_duration = 0.05
    await asyncio.sleep(0.2)
    model = make_model()
    if mode == "aio":
        dht = await swarmtrain.DHT.aio_create(**HOST)
    else:
        dht = swarmtrain.DHT(**HOST)
    stop, helpers, ready = ctx.Event(), [], []
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
    if mode == "aio":
        opt = await swarmtrain.Optimizer.aio_create(dht=dht, params=model.parameters(), **options)
        await asyncio.to_thread(lambda: all(r.wait(120) for r in ready))
        await opt.aio.wait_for_peers(3, timeout=30)
    else:
        opt = swarmtrain.Optimizer(dht=dht, params=model.parameters(), **options)
        all(r.wait(120) for r in ready)
        opt.wait_for_peers(3, timeout=30)
    await asyncio.sleep(3 * args.tick)  # let a tick blocked by the last call record its lag
    startup = summary(ticker.lags)
    if args.freeze:
        print(f"froze {freeze_startup_objects()} objects", flush=True)
    ticker.lags.clear()
    first_epoch, started = opt.local_epoch, time.perf_counter()
    while opt.local_epoch < first_epoch + args.epochs:
        opt.zero_grad()
        batch_loss(model).backward()
        if mode == "aio":
            await opt.aio.step()
        else:
            opt.step()
        await asyncio.sleep(STEP_PAUSE)
    elapsed = time.perf_counter() - started
    training = summary(ticker.lags)
    stop.set()
    if mode == "aio":
        await opt.aio.shutdown(timeout=5)
        await asyncio.to_thread(dht.shutdown, 5)
    else:
        opt.shutdown(timeout=5)
        dht.shutdown(timeout=5)
    for helper in helpers:
        await asyncio.to_thread(helper.join, 30)
    ticking.cancel()
    return {
        "mode": mode,
        "epochs": opt.local_epoch - first_epoch,
        "s_per_epoch": elapsed / max(1, opt.local_epoch - first_epoch),
        "startup_max_ms": startup["max_ms"],
        **training,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--epoch-seconds", type=float, default=1.0)
    parser.add_argument("--tick", type=float, default=0.005)
    parser.add_argument("--modes", default="idle,blocking,aio")
    parser.add_argument("--debug-slow", action="store_true", help="asyncio debug: slow callbacks")
    parser.add_argument(
        "--freeze",
        action="store_true",
        help="swarmtrain.utils.freeze_startup_objects() before training (no full GC walks)",
    )
    args = parser.parse_args()
    if args.debug_slow:
        import logging

        logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}")
    results = {}
    for mode in args.modes.split(","):
        results[mode] = asyncio.run(idle(args) if mode == "idle" else trainer(mode, args))
        r = results[mode]
        print(
            f"{mode:9s} epochs={r['epochs']} {r['s_per_epoch']:.2f} s/epoch ticks={r['n']} "
            f"lag p50={r['p50_ms']:.1f} ms p99={r['p99_ms']:.1f} ms max={r['max_ms']:.1f} ms "
            f"(startup max {r['startup_max_ms']:.0f} ms)",
            flush=True,
        )
    if {"blocking", "aio"} <= results.keys():
        base, new = results["blocking"], results["aio"]
        print(
            f"blocking/aio: p99 {base['p99_ms'] / max(new['p99_ms'], 1e-3):.1f}x, "
            f"max {base['max_ms'] / max(new['max_ms'], 1e-3):.1f}x, "
            f"startup max {base['startup_max_ms'] / max(new['startup_max_ms'], 1e-3):.1f}x"
        )
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
