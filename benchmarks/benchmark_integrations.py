"""Overhead of the framework integrations against a plain loop with the same swarmtrain.Optimizer.

One peer (its epochs use the local gradients, no network round), a model built from a config
in code (``--model tiny``: a 2-layer 64-wide BertForMaskedLM, a ~10 ms step; ``--model
albert-base``: AlbertForPreTraining at albert-base size, 12M parameters, MLM + sentence order,
a ~0.5 s step at batch 4 x 16 tokens on one core of the 2-core box) on fixed masked examples;
each repetition runs the same number of optimizer steps three ways (the order rotates from
one repetition to the next): a hand-written loop, HF Trainer through ``make_collaborative``,
Lightning with ``SwarmStrategy``. Prints samples/s per way (medians over repetitions) and
the ratio to the plain loop of the same repetition, for wall-clock time and for the CPU time
of the training thread (``time.thread_time``; torch runs one intra-op thread here, so the
forward, backward and the integration's own Python all count, and other processes on a busy
machine count far less than in wall time). What an integration adds per step is CPU in that thread::

    PYTHONPATH=. python benchmarks/benchmark_integrations.py --steps 150 --repeats 5
    PYTHONPATH=. python benchmarks/benchmark_integrations.py --model albert-base \
        --steps 36 --warmup 4 --repeats 7

``--no_controls`` leaves out the ``+torch`` ways (each framework with a plain torch AdamW).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import torch
import transformers

from swarmtrain.dht import DHT
from swarmtrain.integrations.huggingface import make_collaborative
from swarmtrain.integrations.lightning import SwarmStrategy
from swarmtrain.optim import Optimizer

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
#: model name -> (default batch size, sequence length, vocabulary size)
MODELS = {"tiny": (8, 16, 128), "albert-base": (4, 16, 30000)}
MODEL = "tiny"
BATCH, SEQ, VOCAB = MODELS[MODEL]


def examples(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (count, SEQ), generator=generator)
    labels = torch.where(torch.rand(count, SEQ, generator=generator) < 0.15, ids, -100)
    if MODEL == "tiny":
        return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]
    order = torch.randint(0, 2, (count,), generator=generator)  # sentence-order labels
    return [
        {"input_ids": i, "labels": y, "sentence_order_label": o}
        for i, y, o in zip(ids, labels, order, strict=True)
    ]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    if MODEL == "albert-base":  # albert-base-v2's sizes, built here (no download)
        albert = transformers.AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=128,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=512,
        )
        return transformers.AlbertForPreTraining(albert)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=SEQ,
    )
    return transformers.BertForMaskedLM(config)


def swarm_optimizer(dht: DHT, net: torch.nn.Module, run_id: str) -> Optimizer:
    return Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=8 * BATCH,
        batch_size_per_step=BATCH,
        params=net.parameters(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        delay_state_averaging=False,
        matchmaking_time=0.5,
    )


WARMUP = 0  #: optimizer steps before the clock starts (0: it times the whole run)


class Clock:
    """Wall-clock and training-thread CPU time of a run: from ``start`` to ``stop`` (setup and
    teardown included) or, with ``WARMUP`` steps, from the ``WARMUP``-th ``tick`` (one per
    optimizer step) to the last (the steady state: the swarm optimizer's creation inside
    Lightning's ``fit`` and the frameworks' first-step work left out)."""

    def __init__(self) -> None:
        self.ticks, self.begin, self.end = 0, (0.0, 0.0), (0.0, 0.0)

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def start(self) -> None:
        if WARMUP == 0:
            self.begin = self.now()

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == WARMUP:
            self.begin = self.now()
        self.end = self.now()

    def stop(self, steps: int) -> tuple[float, float]:
        """(samples/s of wall time, samples/s of training-thread CPU time)."""
        if self.ticks != steps:
            raise RuntimeError(f"{self.ticks} optimizer steps ticked, {steps} expected")
        end = self.now() if WARMUP == 0 else self.end
        wall, cpu = end[0] - self.begin[0], end[1] - self.begin[1]
        samples = (steps - WARMUP) * BATCH
        return samples / wall, samples / cpu


class HFTicks(transformers.TrainerCallback):
    def __init__(self, clock: Clock):
        self.clock = clock

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.tick()


class LightningTicks(lightning.Callback):
    def __init__(self, clock: Clock):
        self.clock = clock

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.clock.tick()


def plain(dht: DHT | None, data: list[dict], steps: int, run: int) -> tuple[float, float]:
    """A hand-written loop; ``dht`` None: a plain torch AdamW instead of the swarm optimizer."""
    net = model()
    if dht is None:
        opt: Any = torch.optim.AdamW(net.parameters(), lr=1e-3)
    else:
        opt = swarm_optimizer(dht, net, f"plain{run}")
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    try:
        clock = Clock()
        clock.start()
        done = 0
        while done < steps:
            for batch in loader:
                net(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
                clock.tick()
                done += 1
                if done == steps:
                    break
        return clock.stop(steps)
    finally:
        if dht is not None:
            opt.shutdown()


def hf(
    dht: DHT | None, data: list[dict], steps: int, run: int, output_dir: str
) -> tuple[float, float]:
    """HF Trainer (no gradient clipping, as the plain loop); ``dht`` None: a plain AdamW."""
    net = model()
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    # without the swarm: the same torch AdamW as the other ways (Trainer's default is a fused
    # AdamW, faster on CPU than torch.optim.AdamW's default: that compared optimizers, not us)
    own = None if dht is not None else (torch.optim.AdamW(net.parameters(), lr=1e-3), None)
    clock = Clock()
    trainer = transformers.Trainer(
        model=net,
        args=args,
        train_dataset=data,
        optimizers=own or (None, None),
        callbacks=[HFTicks(clock)],
    )
    opt = None
    if dht is not None:
        opt = swarm_optimizer(dht, net, f"hf{run}")
        make_collaborative(trainer, opt, load_state_from_peers=False)
    try:
        clock.start()
        trainer.train()
        return clock.stop(steps)
    finally:
        if opt is not None:
            opt.shutdown()


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, index):
        return self.net(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def pl(dht: DHT | None, data: list[dict], steps: int, run: int) -> tuple[float, float]:
    """Lightning with ``SwarmStrategy``; ``dht`` None: its default single-device strategy."""
    strategy: Any = "auto"
    if dht is not None:
        strategy = SwarmStrategy(
            dht=dht,
            run_id=f"pl{run}",
            target_batch_size=8 * BATCH,
            batch_size=BATCH,
            optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-3),
            load_state_from_peers=False,
            delay_state_averaging=False,
            matchmaking_time=0.5,
        )
    clock = Clock()
    trainer = lightning.Trainer(
        callbacks=[LightningTicks(clock)],
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    clock.start()
    trainer.fit(Module(), loader)
    return clock.stop(steps)


def main() -> None:
    global MODEL, BATCH, SEQ, VOCAB, WARMUP
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--batch", type=int, default=None, help="default: the model's")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--warmup", type=int, default=0, help="time from this optimizer step on (0: all)"
    )
    parser.add_argument("--no_controls", action="store_true", help="skip the +torch ways")
    parser.add_argument("--output_dir", default="/tmp/benchmark_integrations")
    args = parser.parse_args()
    MODEL = args.model
    BATCH, SEQ, VOCAB = MODELS[MODEL]
    BATCH = args.batch or BATCH
    WARMUP = args.warmup
    if not 0 <= WARMUP < args.steps:
        parser.error("--warmup must be below --steps")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the compute runs in the training thread (see the docstring)
    data = examples(512)
    ways = ("plain", "hf", "lightning")
    kinds = ("swarm",) if args.no_controls else ("swarm", "torch")
    runners: dict[str, Callable[[DHT | None, int], tuple[float, float]]] = {
        "plain": lambda dht, run: plain(dht, data, args.steps, run),
        "hf": lambda dht, run: hf(dht, data, args.steps, run, args.output_dir),
        "lightning": lambda dht, run: pl(dht, data, args.steps, run),
    }
    # rates[measure][way][with swarm optimizer?] = samples/s per repetition
    rates = {m: {w: {o: [] for o in ("swarm", "torch")} for w in ways} for m in ("wall", "cpu")}
    dht = DHT(**HOST)
    try:
        for run in range(args.repeats):
            line = []
            order = ways[run % len(ways) :] + ways[: run % len(ways)]  # no way always first
            for way in order:
                for kind in kinds:
                    wall, cpu = runners[way](dht if kind == "swarm" else None, run)
                    rates["wall"][way][kind].append(wall)
                    rates["cpu"][way][kind].append(cpu)
                    line.append(f"{way}+{kind} {wall:.3g}/{cpu:.3g}")
            print(f"run {run} (samples/s wall/thread CPU): " + "  ".join(line), flush=True)
    finally:
        dht.shutdown()

    def ratios(measure: str, a: tuple[str, str], b: tuple[str, str]) -> list[float]:
        by_way = rates[measure]
        return [x / y for x, y in zip(by_way[a[0]][a[1]], by_way[b[0]][b[1]], strict=True)]

    def show(label: str, values: list[float]) -> None:
        print(
            f"{label}: median {statistics.median(values):.3f} (runs: "
            + ", ".join(f"{v:.3f}" for v in values)
            + ")"
        )

    for measure in ("wall", "cpu"):
        for way in ways:
            for kind in kinds:
                values = rates[measure][way][kind]
                print(
                    f"{measure:4s} {way}+{kind}: median {statistics.median(values):.3g} samples/s"
                )
        for way in ("hf", "lightning"):
            # the ratio: the framework with our integration vs a plain loop, same optimizer
            show(
                f"{measure:4s} {way}+swarm / plain+swarm",
                ratios(measure, (way, "swarm"), ("plain", "swarm")),
            )
            if args.no_controls:
                continue
            # the framework's own cost, no swarmtrain involved
            show(
                f"{measure:4s} {way}+torch / plain+torch",
                ratios(measure, (way, "torch"), ("plain", "torch")),
            )
            # what our integration adds inside the framework: the swarm optimizer's cost in the
            # framework relative to its cost in the plain loop (1.0: nothing beyond the optimizer)
            within = ratios(measure, (way, "swarm"), (way, "torch"))
            outside = ratios(measure, ("plain", "swarm"), ("plain", "torch"))
            show(
                f"{measure:4s} {way} adapter: ({way}+swarm / {way}+torch) / (plain ditto)",
                [a / b for a, b in zip(within, outside, strict=True)],
            )


if __name__ == "__main__":
    main()
