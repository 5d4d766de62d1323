"""DiLoCo quality against a tuned synchronous data-parallel baseline (issue 7, part 2).

Single process, CPU, no network: :mod:`swarmtrain.optim.diloco_simulation`. The protocol:

1. warm start: ``--warm-steps`` steps of synchronous data parallelism from scratch (constant
   lr ``--warm-lr`` after a short linear warm-up); its parameters are the checkpoint every arm
   starts from (fresh optimizer state);
2. synchronous baseline: ``--steps`` more steps on the mean gradient of ``--workers`` batches,
   for each lr in ``--baseline-lrs``; the best final eval loss is the *tuned* baseline;
3. DiLoCo: the same ``--steps`` inner steps on each worker (same total samples), for each ``H``
   in ``--H``, inner lr in ``--inner-lrs`` and outer ``lr:momentum`` (Nesterov) in ``--outer``;
   the best per ``H`` is reported against the tuned baseline;
4. pseudo-gradient codecs (``--codecs``) at the largest ``H`` with its best setting, against
   fp32.

Both arms share the inner lr schedule (``--schedule``: linear warm-up over ``--lr-warmup``
steps, then cosine to ``--final-lr-ratio`` of the peak, or constant). Bytes are what each worker
sends per direction: the baseline all-reduces fp32 gradients every step, DiLoCo its pseudo-
gradients every ``H`` steps, so the ratio is ``H`` (fp32) times the codec's ratio.

    python benchmarks/benchmark_diloco.py --part quality            # small, a few minutes
    python benchmarks/benchmark_diloco.py --part quality --preset full --jobs 2
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context

PRESETS: dict[str, dict[str, object]] = {
    # a few minutes on one loaded core
    "small": {
        "d_model": 64,
        "layers": 2,
        "context": 32,
        "warm_steps": 50,
        "steps": 200,
        "baseline_lrs": "4e-3,8e-3,1.6e-2",
        "inner_lrs": "8e-3",
        "outer": "0.7:0.9",
        "H": "10,50",
        "eval_windows": 128,
    },
    # the study in RESULTS.md (21 runs of ~70 s each on an idle core; --jobs 2 halves that)
    "full": {
        "d_model": 64,
        "layers": 2,
        "context": 64,
        "warm_steps": 200,
        "steps": 1000,
        "baseline_lrs": "1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2",
        "inner_lrs": "2e-3,4e-3,8e-3",
        "outer": "0.7:0.9,1.0:0.9",
        "H": "10,50",
        "eval_windows": 256,
    },
}


@dataclass(frozen=True)
class Run:
    """One training run after the warm start."""

    kind: str  # "sync" or "diloco"
    lr: float
    H: int = 1
    outer_lr: float = 0.0
    momentum: float = 0.0
    codec: str = "fp32"

    @property
    def label(self) -> str:
        if self.kind == "sync":
            return f"sync lr {self.lr:g}"
        return f"DiLoCo H{self.H} lr {self.lr:g} outer {self.outer_lr:g}/{self.momentum:g}" + (
            "" if self.codec == "fp32" else f" {self.codec}"
        )


@dataclass(frozen=True)
class Outcome:
    run: Run
    curve: tuple[tuple[int, float], ...]  # (step after the warm start, eval loss)
    bytes_per_worker: int
    seconds: float

    @property
    def final(self) -> float:
        return self.curve[-1][1]

    def at(self, step: int) -> float | None:
        return dict(self.curve).get(step)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated numbers, got {text!r}") from None


def _outer_pairs(text: str) -> list[tuple[float, float]]:
    pairs = []
    for item in text.split(","):
        lr, _, momentum = item.partition(":")
        try:
            pairs.append((float(lr), float(momentum or 0.9)))
        except ValueError:
            raise SystemExit(
                f"--outer takes lr:momentum pairs like 0.7:0.9, got {item!r}"
            ) from None
    return pairs


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmark_diloco.py --part quality", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker and step")
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int)
    parser.add_argument("--warm-steps", type=int, help="synchronous warm start (0: from scratch)")
    parser.add_argument("--warm-lr", type=float, default=4e-3)
    parser.add_argument("--steps", type=int, help="steps after the warm start, both arms")
    parser.add_argument("--baseline-lrs", help="comma-separated AdamW lrs to sweep")
    parser.add_argument("--inner-lrs", help="comma-separated DiLoCo inner AdamW lrs to sweep")
    parser.add_argument("--outer", help="comma-separated outer lr:momentum pairs (Nesterov)")
    parser.add_argument("--H", help="comma-separated inner steps per round")
    parser.add_argument("--codecs", default="fp16,8bit,4bit", help="'' to skip")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    parser.add_argument("--lr-warmup", type=int, default=None, help="default: steps // 20")
    parser.add_argument("--final-lr-ratio", type=float, default=0.1)
    parser.add_argument("--eval-windows", type=int)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--rows", type=int, default=10, help="rows of the curve table")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write every run's curve to this file (JSON)")
    args = parser.parse_args(list(argv))
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.baseline_lrs = _floats(args.baseline_lrs)
    args.inner_lrs = _floats(args.inner_lrs)
    args.outer = _outer_pairs(args.outer)
    args.H = sorted({int(h) for h in _floats(args.H)})
    args.codecs = [c for c in args.codecs.split(",") if c.strip()]
    if args.lr_warmup is None:
        args.lr_warmup = args.steps // 20
    lcm = math.lcm(*args.H)
    if args.steps % lcm or min(args.H) < 1:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of every H {args.H}")
    if args.jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    return args


# ----- one run (module-level so that worker processes can run it) -----


def _setup_torch() -> None:
    import torch

    torch.set_num_threads(1)


def _model_factory(args: argparse.Namespace):
    from swarmtrain.optim.diloco_simulation import TinyTransformer, TinyTransformerConfig

    config = TinyTransformerConfig(
        context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    return functools.partial(TinyTransformer, config)


@functools.cache
def _data(max_bytes: int):
    from swarmtrain.optim._textdata import stdlib_text

    return stdlib_text(max_bytes)


def _adamw(lr: float):
    import torch

    return functools.partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def _execute(run: Run, args: argparse.Namespace, initial: tuple) -> Outcome:
    import torch

    from swarmtrain.optim.diloco_simulation import (
        SimulationConfig,
        _codecs,
        run_data_parallel,
        run_diloco,
        warmup_cosine,
    )

    _setup_torch()
    every = min(args.H)  # evaluation stride of the baseline: every checkpoint of any H
    final = args.final_lr_ratio if args.schedule == "cosine" else 1.0
    schedule = warmup_cosine(args.steps, args.lr_warmup, final)
    data, factory = _data(args.max_bytes), _model_factory(args)
    base = SimulationConfig(
        num_workers=args.workers,
        batch_size=args.batch_size,
        context=args.context,
        eval_windows=args.eval_windows,
        seed=args.seed,
    )
    if run.kind == "sync":
        config = replace(base, inner_steps=every, outer_steps=args.steps // every)
        result = run_data_parallel(
            config,
            factory,
            data,
            optimizer=_adamw(run.lr),
            initial_params=initial,
            lr_schedule=schedule,
        )
    else:
        config = replace(base, inner_steps=run.H, outer_steps=args.steps // run.H)
        outer = functools.partial(
            torch.optim.SGD, lr=run.outer_lr, momentum=run.momentum, nesterov=run.momentum > 0
        )
        result = run_diloco(
            config,
            factory,
            data,
            inner_optimizer=_adamw(run.lr),
            outer_optimizer=outer,
            codec=_codecs([run.codec])[run.codec],
            initial_params=initial,
            lr_schedule=schedule,
        )
    return Outcome(run, result.eval_losses, result.bytes_per_worker, result.seconds)


def _warm_start(args: argparse.Namespace) -> tuple[tuple, float]:
    """The checkpoint both arms start from, and its eval loss."""
    from swarmtrain.optim.diloco_simulation import (
        SimulationConfig,
        _build,
        evaluate,
        run_data_parallel,
        warmup_cosine,
    )

    _setup_torch()
    data, factory = _data(args.max_bytes), _model_factory(args)
    windows = data.eval_windows(args.context, args.eval_windows)
    if args.warm_steps == 0:
        config = SimulationConfig(context=args.context, seed=args.seed)
        model = _build(config, factory)
        params = tuple(p.detach().clone() for p in model.parameters())
        return params, evaluate(model, windows)
    config = SimulationConfig(
        num_workers=args.workers,
        inner_steps=args.warm_steps,
        outer_steps=1,
        batch_size=args.batch_size,
        context=args.context,
        eval_windows=args.eval_windows,
        seed=args.seed + 1,  # other batches than the runs that follow
    )
    result = run_data_parallel(
        config,
        factory,
        data,
        optimizer=_adamw(args.warm_lr),
        lr_schedule=warmup_cosine(args.warm_steps, max(1, args.warm_steps // 10), 1.0),
    )
    return result.params, result.final_eval_loss


def _run_all(runs: list[Run], args, initial, pool) -> list[Outcome]:
    if pool is None:
        outcomes = []
        for run in runs:
            outcomes.append(_execute(run, args, initial))
            _progress(outcomes[-1])
        return outcomes
    futures = [pool.submit(_execute, run, args, initial) for run in runs]
    outcomes = []
    for future in futures:
        outcomes.append(future.result())
        _progress(outcomes[-1])
    return outcomes


def _progress(outcome: Outcome) -> None:
    print(
        f"  {outcome.run.label:<44} final {outcome.final:.4f}  ({outcome.seconds:.0f} s)",
        file=sys.stderr,
        flush=True,
    )


# ----- report -----


def _gap(loss: float, reference: float) -> str:
    return f"{loss / reference - 1:+.2%}"


def _report(args, warm_loss: float, sync: list[Outcome], diloco: list[Outcome], codecs) -> None:
    tuned = min(sync, key=lambda o: o.final)
    print("\n### Synchronous baseline lr sweep\n")
    print("| AdamW lr | final eval loss | vs tuned |")
    print("|---:|---:|---:|")
    for o in sync:
        print(f"| {o.run.lr:g} | {o.final:.4f} | {_gap(o.final, tuned.final)} |")
    print("\n### DiLoCo sweep (vs the tuned baseline; bytes: baseline / DiLoCo, per worker)\n")
    print("| H | inner lr | outer lr | momentum | final eval loss | vs tuned | fewer bytes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for o in diloco:
        r = o.run
        print(
            f"| {r.H} | {r.lr:g} | {r.outer_lr:g} | {r.momentum:g} | {o.final:.4f} "
            f"| {_gap(o.final, tuned.final)} | {tuned.bytes_per_worker / o.bytes_per_worker:.0f}x |"
        )
    best = {h: min((o for o in diloco if o.run.H == h), key=lambda o: o.final) for h in args.H}
    stride = max(1, args.steps // args.rows)
    stride = math.lcm(stride, *args.H) if stride % math.lcm(*args.H) else stride
    steps = list(range(stride, args.steps + 1, stride))
    if steps[-1] != args.steps:
        steps.append(args.steps)
    print(
        f"\n### Eval loss curves (step after the warm start; step 0 = warm start, "
        f"{warm_loss:.4f})\n"
    )
    header = [f"sync (lr {tuned.run.lr:g})"] + [f"DiLoCo H{h}" for h in args.H]
    print("| step | " + " | ".join(header) + " | " + " | ".join(f"gap H{h}" for h in args.H) + " |")
    print("|---:|" + "---:|" * (2 * len(args.H) + 1))
    for step in steps:
        ref = tuned.at(step)
        cells = [f"{ref:.4f}"] + [f"{best[h].at(step):.4f}" for h in args.H]
        gaps = [_gap(best[h].at(step), ref) for h in args.H]
        print(f"| {step} | " + " | ".join(cells + gaps) + " |")
    if codecs:
        reference = best[max(args.H)]
        print(f"\n### Pseudo-gradient codecs ({reference.run.label})\n")
        print("| codec | final eval loss | vs fp32 | vs tuned sync | fewer bytes than sync |")
        print("|---|---:|---:|---:|---:|")
        for o in [reference, *codecs]:
            print(
                f"| {o.run.codec} | {o.final:.4f} | {o.final / reference.final:.5f}x "
                f"| {_gap(o.final, tuned.final)} "
                f"| {tuned.bytes_per_worker / o.bytes_per_worker:.0f}x |"
            )


def main(argv: list[str]) -> None:
    """Run the quality study; markdown tables on stdout, progress on stderr."""
    args = _parse(argv)
    started = time.perf_counter()
    factory = _model_factory(args)
    numel = sum(p.numel() for p in factory().parameters())
    data = _data(args.max_bytes)
    print(
        f"## DiLoCo quality: {numel:,}-parameter byte-level transformer (d{args.d_model}, "
        f"{args.layers} layers, context {args.context}), {args.workers} workers x batch "
        f"{args.batch_size}, {len(data.train):,} train bytes, {args.eval_windows} eval windows; "
        f"warm start {args.warm_steps} sync steps, then {args.steps} steps per arm, "
        f"{args.schedule} inner lr schedule (warm-up {args.lr_warmup})"
    )
    sys.stdout.flush()
    sync_runs = [Run("sync", lr) for lr in args.baseline_lrs]
    diloco_runs = [
        Run("diloco", lr, h, outer_lr, momentum)
        for h in args.H
        for lr in args.inner_lrs
        for outer_lr, momentum in args.outer
    ]
    pool = None
    if args.jobs > 1:
        pool = ProcessPoolExecutor(
            args.jobs, mp_context=get_context("spawn"), initializer=_setup_torch
        )
    try:
        initial, warm_loss = _warm_start(args)
        print(f"warm start: eval loss {warm_loss:.4f}", file=sys.stderr, flush=True)
        outcomes = _run_all(sync_runs + diloco_runs, args, initial, pool)
        sync, diloco = outcomes[: len(sync_runs)], outcomes[len(sync_runs) :]
        codec_outcomes = []
        if args.codecs:
            best = min((o for o in diloco if o.run.H == max(args.H)), key=lambda o: o.final)
            codec_runs = [replace(best.run, codec=c) for c in args.codecs if c != "fp32"]
            codec_outcomes = _run_all(codec_runs, args, initial, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    _report(args, warm_loss, sync, diloco, codec_outcomes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "argv": list(argv),
                    "warm_start_eval_loss": warm_loss,
                    "runs": [
                        {**asdict(o.run), "curve": o.curve, "bytes_per_worker": o.bytes_per_worker}
                        for o in sync + diloco + codec_outcomes
                    ],
                },
                f,
                indent=1,
            )
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
