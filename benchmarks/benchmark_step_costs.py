"""The swarm optimizer's fixed work per local step, against per-tensor loops from the same run.

Every ``swarmtrain.Optimizer.step`` checks that the batch's gradients are finite
(``first_non_finite``) and adds them to the accumulators (``GradientAverager.accumulate_grads_``);
each epoch also loads the accumulators into the averaged buffers and zeroes them. This times
those calls on the gradients of two models built from configs (random values, no backward):
``tiny``, the 2-layer 64-wide BERT of ``benchmark_integrations.py`` (0.1M values in 37 tensors:
per-call Python overhead dominates) and ``albert-base`` (12M values in 32 tensors: memory
traffic dominates). The baselines are the plain per-tensor loops these calls replace (a
Python call per tensor), run in the same process, interleaved; ratio = baseline time / our
time (above 1: ours is faster), in CPU time of the calling thread. One torch thread, as in
the training thread of ``benchmark_integrations.py``. Run it at the commit before a change
too: the ratios compare across commits, the microseconds only under the same load::

    PYTHONPATH=. python benchmarks/benchmark_step_costs.py --repeats 7
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from swarmtrain.averaging.finite import all_finite, first_non_finite
from swarmtrain.optim import GradientAverager


def tiny() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(config)


def albert_base() -> torch.nn.Module:
    config = transformers.AlbertConfig(
        vocab_size=30000,
        embedding_size=128,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
    )
    return transformers.AlbertForPreTraining(config)


def per_tensor_check(grads: list[torch.Tensor]) -> int | None:
    """The baseline finiteness check: one ``all_finite`` call per tensor."""
    for index, grad in enumerate(grads):
        if not all_finite(grad):
            return index
    return None


def per_tensor_accumulate(grads: list[torch.Tensor], accumulators: list[torch.Tensor]) -> None:
    """The baseline accumulation: one ``add_`` per tensor (as ``accumulate_grads_`` was)."""
    with torch.no_grad():
        for grad, accumulator in zip(grads, accumulators, strict=True):
            accumulator.add_(grad.to(accumulator.device, accumulator.dtype), alpha=1.0)


def per_tensor_load_and_reset(accumulators: list[torch.Tensor], averaged: list[torch.Tensor]):
    """The baseline epoch end: copy and scale each accumulator, then zero it."""
    with torch.no_grad():
        for accumulator, out in zip(accumulators, averaged, strict=True):
            out.copy_(accumulator).mul_(0.5)
        for accumulator in accumulators:
            accumulator.zero_()


def time_us(fn: Callable[[], object], calls: int) -> float:
    """Median microseconds of this thread's CPU time per call over ``calls`` calls (after one
    warm-up call): on a shared box, other processes move it far less than wall time."""
    fn()
    times = []
    for _ in range(calls):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def measure(name: str, net: torch.nn.Module, repeats: int, calls: int) -> None:
    params = list(net.parameters())
    for param in params:
        param.grad = torch.randn_like(param)
    grads = [p.grad for p in params]
    values = sum(p.numel() for p in params)
    averager = GradientAverager(params, dht=None, prefix="bench", start=False, client_mode=False)
    baseline_accumulators = [torch.zeros_like(g) for g in grads]
    baseline_averaged = [torch.zeros_like(g) for g in grads]
    calls = calls or (300 if values < 1_000_000 else 20)

    def ours_epoch_end() -> None:
        averager.load_accumulators_into_averager_()
        averager.reset_accumulated_grads_()

    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "finiteness check": (
            lambda: per_tensor_check(grads),
            lambda: first_non_finite(grads),
        ),
        "accumulate_grads_": (
            lambda: per_tensor_accumulate(grads, baseline_accumulators),
            lambda: averager.accumulate_grads_(8),
        ),
        "epoch end: load + reset accumulators": (
            lambda: per_tensor_load_and_reset(baseline_accumulators, baseline_averaged),
            ours_epoch_end,
        ),
    }
    print(f"{name}: {values / 1e6:.2f}M values in {len(params)} tensors, {calls} calls")
    for label, (baseline, ours) in pairs.items():
        base_us, our_us = [], []
        for _ in range(repeats):
            base_us.append(time_us(baseline, calls))
            our_us.append(time_us(ours, calls))
            averager.reset_accumulated_grads_()
        ratios = [b / o for b, o in zip(base_us, our_us, strict=True)]
        print(
            f"  {label:38s} baseline {statistics.median(base_us):9.1f} us  "
            f"ours {statistics.median(our_us):9.1f} us  "
            f"ratio {statistics.median(ratios):.2f} (runs {min(ratios):.2f}-{max(ratios):.2f})"
        )
    assert math.isfinite(float(sum(float(a.sum()) for a in baseline_accumulators)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=0, help="per repetition (default: by size)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name, build in (("tiny", tiny), ("albert-base", albert_base)):
        measure(name, build(), args.repeats, args.calls)


if __name__ == "__main__":
    main()
