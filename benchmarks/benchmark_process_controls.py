"""How long a trio loop is held by a helper-process averager's round start and controls.

    PYTHONPATH=. nice -n 5 python benchmarks/benchmark_process_controls.py [--rounds 40]

One ``ProcessAverager`` (a lone helper process, no other peers: its steps wait for a group).
From a trio loop, each round does what the trio ``Optimizer`` does with a
``ProcessGradientAverager``: start a step that waits for a trigger, set its weight, read its
stage, allow all-reduce, then cancel it. The time of those calls is time the loop is held (they
are plain calls: no other task runs meanwhile); a ticker task (``--tick`` s) records its lag.
Before this change each call waited for the helper's answer over the pipe (``step(wait=False)``
for the start); now none does (``ProcessAverager.start_step``; the stage is reported by the
helper). The script runs either version (it uses ``start_step`` when the averager has it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import trio

from swarmtrain.averaging.process_averager import ProcessAverager

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(helper: ProcessAverager, rounds: int, tick: float) -> dict:
    held, lags = [], []
    start = getattr(helper, "start_step", None)

    async def ticker() -> None:
        while True:
            began = time.perf_counter()
            await trio.sleep(tick)
            lags.append(time.perf_counter() - began - tick)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.5)
        for _ in range(rounds):
            began = time.perf_counter()
            kwargs = {"require_trigger": True, "timeout": 60.0, "expected_group_size": 2}
            control = start(**kwargs) if start else helper.step(wait=False, **kwargs)
            control.weight = 1.0
            _ = control.stage
            control.allow_allreduce()
            held.append(time.perf_counter() - began)
            control.cancel()
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return {
        "version": "no wait" if start else "waits for answers",
        "held_p50_ms": 1e3 * statistics.median(held),
        "held_p90_ms": 1e3 * percentile(held, 0.9),
        "held_max_ms": 1e3 * max(held),
        "lag_p99_ms": 1e3 * percentile(lags, 0.99),
        "lag_max_ms": 1e3 * max(lags),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--tick", type=float, default=0.005)
    args = parser.parse_args()
    torch.set_num_threads(1)
    helper = ProcessAverager([torch.zeros(1024)], prefix="controls", dht_kwargs=HOST)
    try:
        result = trio.run(drive, helper, args.rounds, args.tick)
    finally:
        helper.shutdown()
    print(
        f"{result['version']}: loop held per round start p50 {result['held_p50_ms']:.2f} ms, "
        f"p90 {result['held_p90_ms']:.2f} ms, max {result['held_max_ms']:.1f} ms; ticker lag "
        f"p99 {result['lag_p99_ms']:.1f} ms, max {result['lag_max_ms']:.1f} ms; "
        f"load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
