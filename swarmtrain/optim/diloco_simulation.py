"""A single-process reference of DiLoCo training, and the data-parallel baseline it replaces.

No network: ``W`` workers live in one process, each with its own model copy, inner optimizer
(AdamW by default) and data shard. Every ``H`` inner steps (or, with fragments, one fragment
every ``H / F`` steps; see :mod:`swarmtrain.optim.diloco_core`) their pseudo-gradients are
averaged — optionally through a compression codec, once on the way to the reducer and once on
the way back, as the averager's all-reduce would — and an :class:`OuterState` steps the shared
parameters, which every worker then takes. :func:`run_data_parallel` is synchronous data
parallelism on the same batches: the mean gradient of the ``W`` workers' batches, every step.

It is meant for checking the networked ``DiLoCoOptimizer`` against, and for measuring what
DiLoCo and compression cost in loss::

    python -m swarmtrain.optim.diloco_simulation --workers 4 --inner-steps 10 --outer-steps 30

The model is a tiny byte-level causal transformer; the text is the Python standard library's
own ``.py`` files (no download; ``stdlib_text``, ``TextData`` and ``BatchSampler`` are exported
here for scripts that train on it). Runs are deterministic for a given seed on a given machine.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.optim._textdata import BatchSampler, TextData, stdlib_text
from swarmtrain.optim.diloco_core import (
    ApplyOuter,
    Fragments,
    OuterOptimizerFactory,
    OuterState,
    StartSync,
    StreamingSchedule,
    default_outer_optimizer,
)

if TYPE_CHECKING:
    from swarmtrain.compression import CompressionBase

__all__ = [
    "BatchSampler",
    "InnerOptimizerFactory",
    "SimulationConfig",
    "SimulationResult",
    "TextData",
    "TinyTransformer",
    "TinyTransformerConfig",
    "default_inner_optimizer",
    "LrSchedule",
    "evaluate",
    "run_data_parallel",
    "run_diloco",
    "stdlib_text",
    "warmup_cosine",
]

InnerOptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
#: maps a 0-based inner step to a multiplier of the optimizer's initial learning rate(s)
LrSchedule = Callable[[int], float]

#: the workers' optimizer unless told otherwise
default_inner_optimizer: InnerOptimizerFactory = functools.partial(
    torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01
)


@dataclass(frozen=True)
class TinyTransformerConfig:
    """A byte-level causal transformer; the defaults have about 390K parameters."""

    context: int = 64
    d_model: int = 96
    n_layers: int = 3
    n_heads: int = 4
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Bytes in ``(batch, length)``, next-byte logits out ``(batch, length, vocab_size)``."""

    def __init__(self, config: TinyTransformerConfig | None = None):
        super().__init__()
        self.config = config = config or TinyTransformerConfig()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Parameter(torch.randn(config.context, config.d_model) * 0.02)
        self.blocks = nn.ModuleList(
            _Block(config.d_model, config.n_heads) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.config.context:
            raise ValueError(f"sequence of {tokens.shape[1]} > context {self.config.context}")
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` over ``windows``."""
    total = 0.0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        total += float(_loss(model, chunk)) * len(chunk)
    return total / len(windows)


@dataclass(frozen=True)
class SimulationConfig:
    """One run: ``outer_steps * inner_steps`` inner steps on each of ``num_workers`` workers.

    :param num_fragments: F, :param delay: tau, :param alpha: see :class:`StreamingSchedule`
      (the defaults are plain DiLoCo)
    :param clip_grad_norm: clip each worker's gradient (the baseline's mean gradient) to this
      norm before its inner step; ``None``: no clipping
    :param eval_windows: evaluation windows of ``context + 1`` bytes, evaluated every
      ``inner_steps`` steps on the shared parameters
    """

    num_workers: int = 4
    inner_steps: int = 10
    outer_steps: int = 20
    batch_size: int = 16
    context: int = 64
    num_fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    clip_grad_norm: float | None = 1.0
    eval_windows: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_workers", "outer_steps", "batch_size", "context", "eval_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive or None, got {self.clip_grad_norm}")
        self.schedule()  # validates inner_steps, num_fragments, delay and alpha

    def schedule(self) -> StreamingSchedule:
        return StreamingSchedule(self.inner_steps, self.num_fragments, self.delay, self.alpha)

    @property
    def total_steps(self) -> int:
        return self.inner_steps * self.outer_steps


@dataclass(frozen=True)
class SimulationResult:
    """What a run produced.

    :param eval_losses: ``(inner step, eval loss)`` of the shared parameters, every
      ``inner_steps`` steps
    :param params: the final shared parameters (fp32, CPU)
    :param bytes_per_worker: payload bytes each worker sent towards the reducers (pseudo-
      gradients, or the baseline's fp32 gradients), one direction
    :param seconds: wall-clock time of the run
    """

    eval_losses: tuple[tuple[int, float], ...]
    params: tuple[torch.Tensor, ...]
    bytes_per_worker: int
    seconds: float

    @property
    def final_eval_loss(self) -> float:
        return self.eval_losses[-1][1]


def warmup_cosine(total_steps: int, warmup_steps: int = 0, final: float = 0.1) -> LrSchedule:
    """A linear warm-up from ``1 / warmup_steps`` to 1, then a cosine decay to ``final``.

    Step ``t`` (0-based) gets ``(t + 1) / warmup_steps`` while ``t < warmup_steps``, then
    ``final + (1 - final) * (1 + cos(pi * p)) / 2`` with ``p`` going from 0 to 1 over the
    remaining steps. Steps past ``total_steps`` keep ``final``.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
    if (
        isinstance(warmup_steps, bool)
        or not isinstance(warmup_steps, int)
        or not 0 <= warmup_steps < total_steps
    ):
        raise ValueError(
            f"warmup_steps must be an integer in [0, total_steps={total_steps}), "
            f"got {warmup_steps!r}"
        )
    if not 0 <= final <= 1:
        raise ValueError(f"final must be a fraction of the peak lr in [0, 1], got {final!r}")

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = total_steps - warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - 1))
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


class _LrScheduler:
    """Sets each optimizer's lrs to ``initial lr * schedule(step)`` before every step."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], schedule: LrSchedule | None):
        self.optimizers, self.schedule = list(optimizers), schedule
        self.base = [[group["lr"] for group in opt.param_groups] for opt in self.optimizers]

    def set(self, step: int) -> None:
        if self.schedule is None:
            return
        factor = float(self.schedule(step))
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"lr_schedule({step}) returned {factor}; expected a finite value >= 0")
        for opt, base in zip(self.optimizers, self.base, strict=True):
            for group, lr in zip(opt.param_groups, base, strict=True):
                group["lr"] = lr * factor


def _build(
    config: SimulationConfig,
    model_factory: Callable[[], nn.Module],
    initial_params: Sequence[torch.Tensor] | None = None,
) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        torch.manual_seed(config.seed)
        model = model_factory()
    if initial_params is not None:
        params, initial = list(model.parameters()), list(initial_params)
        if len(initial) != len(params):
            raise ValueError(
                f"initial_params has {len(initial)} tensors, the model {len(params)} parameters"
            )
        with torch.no_grad():
            for i, (p, value) in enumerate(zip(params, initial, strict=True)):
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"initial_params[{i}] has shape {tuple(value.shape)}, "
                        f"the parameter {tuple(p.shape)}"
                    )
                p.copy_(value)
    return model


def _samplers(config: SimulationConfig, data: TextData) -> list[BatchSampler]:
    return [
        BatchSampler(shard, config.context, config.batch_size, seed=config.seed * 1_000_003 + w)
        for w, shard in enumerate(data.shards(config.num_workers))
    ]


def _inner_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, clip: float | None
) -> None:
    optimizer.zero_grad(set_to_none=True)
    _loss(model, batch).backward()
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def _average(
    per_worker: Sequence[list[torch.Tensor]], codec: CompressionBase | None
) -> tuple[list[torch.Tensor], int]:
    """Mean over workers of each tensor, through ``codec`` both ways; and bytes per worker."""
    averaged, sent = [], 0
    for tensors in zip(*per_worker, strict=True):
        if codec is None:
            sent += tensors[0].numel() * tensors[0].element_size()
            averaged.append(torch.stack(tensors).mean(dim=0))
            continue
        messages = [codec.compress(t) for t in tensors]
        sent += messages[0].nbytes
        mean = torch.stack([codec.extract(m) for m in messages]).mean(dim=0)
        averaged.append(codec.extract(codec.compress(mean)))
    return averaged, sent


def run_diloco(
    config: SimulationConfig,
    model_factory: Callable[[], nn.Module],
    data: TextData,
    *,
    inner_optimizer: InnerOptimizerFactory = default_inner_optimizer,
    outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
    codec: CompressionBase | None = None,
    initial_params: Sequence[torch.Tensor] | None = None,
    lr_schedule: LrSchedule | None = None,
) -> SimulationResult:
    """Train with (Streaming) DiLoCo; see the module docstring.

    :param model_factory: builds the model; called once under ``torch.manual_seed(seed)``
    :param codec: compresses the pseudo-gradients (``None``: exact fp32 mean)
    :param initial_params: start from these values (a warm-start checkpoint, e.g. the
      ``params`` of a :func:`run_data_parallel` result) instead of the fresh initialization
    :param lr_schedule: multiplies the inner optimizers' lr at each inner step (0-based), e.g.
      :func:`warmup_cosine`; ``None``: constant lr
    """
    started = time.perf_counter()
    shared_model = _build(config, model_factory, initial_params)
    workers = [copy.deepcopy(shared_model) for _ in range(config.num_workers)]
    worker_params = [list(m.parameters()) for m in workers]
    inner = [inner_optimizer(params) for params in worker_params]
    scheduler = _LrScheduler(inner, lr_schedule)
    outer = OuterState(shared_model.parameters(), outer_optimizer)
    fragments = Fragments.for_parameters(shared_model.parameters(), config.num_fragments)
    schedule = config.schedule()
    samplers = _samplers(config, data)
    windows = data.eval_windows(config.context, config.eval_windows)
    pending: dict[int, list[torch.Tensor]] = {}
    losses, sent = [], 0

    def apply(fragment: int, alpha: float) -> None:
        indices = fragments[fragment]
        outer.apply_outer_step(pending.pop(fragment), indices)
        for params in worker_params:
            outer.copy_to(fragments.select(params, fragment), indices, alpha=alpha)

    for step in range(1, config.total_steps + 1):
        scheduler.set(step - 1)
        for model, optimizer, sampler in zip(workers, inner, samplers, strict=True):
            _inner_step(model, optimizer, sampler.next(), config.clip_grad_norm)
        for action in schedule.actions(step):
            if isinstance(action, StartSync):
                indices = fragments[action.fragment]
                deltas = [
                    outer.pseudo_gradient(fragments.select(params, action.fragment), indices)
                    for params in worker_params
                ]
                pending[action.fragment], nbytes = _average(deltas, codec)
                sent += nbytes
            elif isinstance(action, ApplyOuter):
                apply(action.fragment, action.alpha)
        if step == config.total_steps:  # results still in flight are applied at the end
            for fragment in sorted(pending):
                apply(fragment, config.alpha)
        if step % config.inner_steps == 0:
            outer.copy_to(list(shared_model.parameters()))
            losses.append((step, evaluate(shared_model, windows)))
    return SimulationResult(
        tuple(losses),
        tuple(p.clone() for p in outer.params),
        sent,
        time.perf_counter() - started,
    )


def run_data_parallel(
    config: SimulationConfig,
    model_factory: Callable[[], nn.Module],
    data: TextData,
    *,
    optimizer: InnerOptimizerFactory = default_inner_optimizer,
    initial_params: Sequence[torch.Tensor] | None = None,
    lr_schedule: LrSchedule | None = None,
) -> SimulationResult:
    """Synchronous data parallelism on the batches DiLoCo's workers would see.

    Each of the ``outer_steps * inner_steps`` steps takes one batch per worker, averages the
    ``num_workers`` gradients (each computed on its own batch) and steps one optimizer.
    ``initial_params`` and ``lr_schedule`` are as in :func:`run_diloco`.
    """
    started = time.perf_counter()
    model = _build(config, model_factory, initial_params)
    params = list(model.parameters())
    opt = optimizer(params)
    scheduler = _LrScheduler([opt], lr_schedule)
    samplers = _samplers(config, data)
    windows = data.eval_windows(config.context, config.eval_windows)
    numel_bytes = sum(p.numel() * 4 for p in params)
    losses = []
    for step in range(1, config.total_steps + 1):
        scheduler.set(step - 1)
        opt.zero_grad(set_to_none=True)
        for sampler in samplers:
            _loss(model, sampler.next()).backward()
        for p in params:
            if p.grad is not None:
                p.grad.div_(config.num_workers)
        if config.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(params, config.clip_grad_norm)
        opt.step()
        if step % config.inner_steps == 0:
            losses.append((step, evaluate(model, windows)))
    return SimulationResult(
        tuple(losses),
        tuple(p.detach().to("cpu", torch.float32, copy=True) for p in params),
        numel_bytes * config.total_steps,
        time.perf_counter() - started,
    )


def _codecs(names: Sequence[str]) -> dict[str, CompressionBase | None]:
    from swarmtrain.compression import (
        Blockwise4BitQuantization,
        BlockwiseQuantization,
        Float16Compression,
    )

    known: dict[str, Callable[[], CompressionBase | None]] = {
        "fp32": lambda: None,
        "fp16": Float16Compression,
        "8bit": BlockwiseQuantization,
        "4bit": Blockwise4BitQuantization,
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown codec(s) {unknown}; choose from {sorted(known)}")
    return {name: known[name]() for name in names}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--outer-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=0.0)
    parser.add_argument("--d-model", type=int, default=96)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--codecs", default="fp32,fp16,8bit,4bit")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = SimulationConfig(
        num_workers=args.workers,
        inner_steps=args.inner_steps,
        outer_steps=args.outer_steps,
        batch_size=args.batch_size,
        context=args.context,
        num_fragments=args.fragments,
        delay=args.delay,
        alpha=args.alpha,
        seed=args.seed,
    )
    model_config = TinyTransformerConfig(
        context=args.context, d_model=args.d_model, n_layers=args.layers
    )
    data = stdlib_text(args.max_bytes)
    numel = sum(p.numel() for p in TinyTransformer(model_config).parameters())
    print(f"{numel:,} parameters, {len(data.train):,} train / {len(data.eval):,} eval bytes")
    print(f"{config}")
    print(f"{'run':<24} {'eval loss':>9} {'vs fp32':>8} {'MB/worker':>10} {'seconds':>8}")
    results: dict[str, SimulationResult] = {}

    def report(name: str, result: SimulationResult) -> None:
        reference = results.get("diloco fp32")
        relative = (
            f"{result.final_eval_loss / reference.final_eval_loss - 1:+.2%}" if reference else ""
        )
        print(
            f"{name:<24} {result.final_eval_loss:>9.4f} {relative:>8} "
            f"{result.bytes_per_worker / 1e6:>10.2f} {result.seconds:>8.1f}",
            flush=True,
        )

    def factory() -> nn.Module:
        return TinyTransformer(model_config)

    for name, codec in _codecs(args.codecs.split(",")).items():
        result = run_diloco(config, factory, data, codec=codec)
        results[f"diloco {name}"] = result
        report(f"diloco {name}", result)
    if not args.no_baseline:
        report("data-parallel (fp32)", run_data_parallel(config, factory, data))
    initial = evaluate(
        _build(config, factory), data.eval_windows(args.context, config.eval_windows)
    )
    print(f"initial eval loss {initial:.4f} (uniform bytes: {math.log(256):.4f})")


if __name__ == "__main__":
    main()
