"""Per-inner-step overhead of ``DiLoCoOptimizer.step()`` (issue 19: DiLoCo on trio).

A lone peer (its own DHT on loopback) with H so large that no round starts or ends during the
measurement: every ``step()`` is an inner step. Three ways, in the same run, each timed over
``--steps`` calls, ``--repeats`` times, alternating:

- ``torch``: the inner optimizer's own ``step()`` on another copy of the model (the baseline);
- ``blocking``: ``DiLoCoOptimizer.step()`` (the facade: the inner step in the caller's thread);
- ``trio``: ``await opt.step()`` on ``DiLoCoOptimizer.create`` (skipped on a tree without it).

Prints the median microseconds per call and the overhead over ``torch``. Usage::

    nice -n 5 python benchmarks/benchmark_diloco_step.py [--steps 2000 --repeats 7 --size 64]

Run with ``PYTHONPATH=<tree>`` to measure another checkout (e.g. main before the change).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import trio

from swarmtrain.dht import DHT
from swarmtrain.optim.diloco import DiLoCoOptimizer

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


def _model(size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(size, size)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    return model


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)


def _per_call_us(fn, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - started) / steps * 1e6


async def _trio_times(size: int, steps: int, repeats: int) -> list[float] | None:
    if not hasattr(DiLoCoOptimizer, "create"):
        return None
    model = _model(size)
    times = []
    async with DHT.create(**HOST) as dht:
        async with DiLoCoOptimizer.create(
            model.parameters(), dht=dht, run_id="bench", inner_steps=10**9, inner_optimizer=_sgd
        ) as opt:
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(steps):
                    await opt.step()
                times.append((time.perf_counter() - started) / steps * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--size", type=int, default=64, help="a Linear(size, size) model")
    args = parser.parse_args()

    model = _model(args.size)
    baseline = _sgd(copy.deepcopy(model).parameters())
    dht = DHT(**HOST)
    opt = DiLoCoOptimizer(
        model.parameters(), dht=dht, run_id="bench", inner_steps=10**9, inner_optimizer=_sgd
    )
    torch_us, blocking_us = [], []
    try:
        for _ in range(args.repeats):
            torch_us.append(_per_call_us(baseline.step, args.steps))
            blocking_us.append(_per_call_us(opt.step, args.steps))
    finally:
        opt.shutdown()
        dht.shutdown()
    trio_us = trio.run(_trio_times, args.size, args.steps, args.repeats)

    base = statistics.median(torch_us)
    print(f"load {os.getloadavg()[0]:.1f}; {args.steps} steps x {args.repeats}, medians:")
    print(f"  torch     {base:7.1f} us/step")
    rows = [("blocking", blocking_us), ("trio", trio_us)]
    for name, times in rows:
        if times is None:
            print(f"  {name:9s}     (not in this tree)")
            continue
        median = statistics.median(times)
        print(
            f"  {name:9s} {median:7.1f} us/step  overhead {median - base:6.1f} us "
            f"({median / base:.2f}x torch)"
        )


if __name__ == "__main__":
    main()
