"""asyncio event-loop lag of a trainer using swarmtrain's Optimizer (issue 19 item 2).

Three peers (processes) train a small model in epochs of about ``--epoch-seconds``. Peer 0 is
an asyncio trainer; a ticker task on its loop sleeps ``--tick`` s and records how late it
wakes up. Two modes, each with fresh helper peers, in the same run:

- ``blocking`` (the baseline): ``opt.step()`` called on the asyncio loop, constructors too;
- ``aio``: ``await opt.aio.step()``, ``await DHT.aio_create(...)``,
  ``await Optimizer.aio_create(...)``;
- ``control``: the same three peers all in other processes, the ticker's process only
  computing the trainer's batches: the lag the swarm's CPU load gives a loop on this machine
  without sharing a GIL with swarmtrain (on a 2-core box, three peers compete for the cores).

``--attribute`` splits the late ticks of ``aio`` / ``blocking`` into the loop thread's CPU,
its run-queue wait and the rest (the GIL), with the other threads' CPU, GC and the background
loop's task steps meanwhile (``_lag_attribution.py``).

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
import sys
import time

import torch

import swarmtrain

# at module level: swarmtrain's names are imported lazily, and the first use of ``swarmtrain.DHT``
# (libp2p) or ``swarmtrain.Optimizer`` takes 1-2 s, which would block the loop wherever it happens
from swarmtrain import DHT, Optimizer  # noqa: F401
from swarmtrain.utils import freeze_startup_objects

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lag_attribution import Attribution

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


def helper_peer(
    maddrs: list[str],
    run_id: str,
    target: int,
    stop,
    ready,
    maddrs_out=None,
    epoch_out=None,
    peers: int = 0,
) -> None:
    """A blocking trainer in its own process, stepping until ``stop`` is set; puts its DHT's
    addresses in ``maddrs_out`` and its epoch in ``epoch_out`` when given, and waits for
    ``peers`` peers before its first step."""
    torch.set_num_threads(1)
    dht = swarmtrain.DHT(maddrs, **HOST)
    if maddrs_out is not None:
        maddrs_out.put(dht.get_visible_maddrs())
    model = make_model()
    opt = swarmtrain.Optimizer(
        dht=dht, params=model.parameters(), **optimizer_options(run_id, target)
    )
    ready.set()
    if peers:
        opt.wait_for_peers(peers, timeout=60)
    try:
        while not stop.is_set():
            opt.zero_grad()
            batch_loss(model).backward()
            opt.step()
            if epoch_out is not None:
                epoch_out.value = opt.local_epoch
            time.sleep(STEP_PAUSE)
    finally:
        opt.shutdown(timeout=5)
        dht.shutdown(timeout=5)


class Ticker:
    def __init__(self, tick: float) -> None:
        self.tick, self.lags, self.attribution = tick, [], None

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.tick)
            self.lags.append(time.perf_counter() - start - self.tick)
            if self.attribution is not None:
                self.attribution.on_wake(self.lags[-1])


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


async def control(args) -> dict:
    """The same swarm with all three peers in other processes; this process runs only the
    ticker and the trainer's own forward/backward and a plain torch step: the lag that the
    swarm's CPU load on this machine gives an asyncio loop sharing no GIL with swarmtrain."""
    ctx = mp.get_context("spawn")
    run_id = f"lag_control_{os.getpid()}"
    target = round(3 * BATCH / (STEP_PAUSE + 0.005) * args.epoch_seconds)
    ticker = Ticker(args.tick)
    ticking = asyncio.create_task(ticker.run())
    stop, maddrs_out, epoch = ctx.Event(), ctx.Queue(), ctx.Value("i", -1)
    ready = [ctx.Event() for _ in range(3)]
    helpers = [
        ctx.Process(
            target=helper_peer,
            args=([], run_id, target, stop, ready[0], maddrs_out, epoch, 3),
            daemon=True,
        )
    ]
    helpers[0].start()
    maddrs = await asyncio.to_thread(maddrs_out.get, True, 120)
    for event in ready[1:]:
        helpers.append(
            ctx.Process(target=helper_peer, args=(maddrs, run_id, target, stop, event), daemon=True)
        )
        helpers[-1].start()
    await asyncio.to_thread(lambda: all(r.wait(120) for r in ready))
    model = make_model()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first_epoch, started = epoch.value, 0.0
    while not started or epoch.value < first_epoch + args.epochs:
        torch_opt.zero_grad()
        batch_loss(model).backward()
        torch_opt.step()
        await asyncio.sleep(STEP_PAUSE)
        if not started and epoch.value != first_epoch:  # the swarm's first epoch end
            ticker.lags.clear()
            first_epoch, started = epoch.value, time.perf_counter()
    elapsed = time.perf_counter() - started
    training = summary(ticker.lags)
    stop.set()
    for helper in helpers:
        await asyncio.to_thread(helper.join, 30)
    ticking.cancel()
    return {
        "mode": "control",
        "epochs": epoch.value - first_epoch,
        "s_per_epoch": elapsed / max(1, epoch.value - first_epoch),
        "startup_max_ms": 0.0,
        **training,
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
    if args.freeze:  # (its own pause counts as startup)
        print(f"froze {freeze_startup_objects()} objects", flush=True)
    await asyncio.sleep(3 * args.tick)  # let a tick blocked by the last call record its lag
    startup = summary(ticker.lags)
    if args.attribute:
        ticker.attribution = Attribution(opt._running()[0], args.tick, args.sample_stacks)
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
    if ticker.attribution is not None:
        print(f"{mode}: where the late ticks went\n{ticker.attribution.report()}", flush=True)
        ticker.attribution.close()
        ticker.attribution = None
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
    parser.add_argument("--modes", default="idle,blocking,aio", help="also: control")
    parser.add_argument("--debug-slow", action="store_true", help="asyncio debug: slow callbacks")
    parser.add_argument(
        "--attribute",
        action="store_true",
        help="attribute late ticks: per-thread CPU, run-queue waits, GC, background loop steps",
    )
    parser.add_argument(
        "--sample-stacks",
        action="store_true",
        help="with --attribute: sample the background loop's stack every 2 ms (perturbs lag)",
    )
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
        run = {"idle": idle, "control": control}.get(mode)
        results[mode] = asyncio.run(run(args) if run else trainer(mode, args))
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
