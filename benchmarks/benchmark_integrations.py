"""Overhead of the framework integrations against a plain loop with the same swarmtrain.Optimizer.

One peer (its epochs use the local gradients, no network round), a tiny BertForMaskedLM on fixed
masked examples; each repetition runs the same number of optimizer steps three ways, in turn:
a hand-written loop, HF Trainer through ``make_collaborative``, Lightning with
``SwarmStrategy``. Prints samples/s per way (medians over repetitions) and the ratio to the
plain loop of the same repetition, for wall-clock time and for the CPU time of the training
thread (``time.thread_time``; torch runs one intra-op thread here, so the forward, backward and
the integration's own Python all count, and other processes on a busy machine count far less
than in wall time). What an integration adds per step is CPU in that thread::

    PYTHONPATH=. python benchmarks/benchmark_integrations.py --steps 150 --repeats 5
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
BATCH, SEQ, VOCAB = 8, 16, 128


def examples(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (count, SEQ), generator=generator)
    labels = torch.where(torch.rand(count, SEQ, generator=generator) < 0.15, ids, -100)
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
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


class Clock:
    """Wall-clock and training-thread CPU time between ``start`` and ``stop``."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def stop(self, samples: int) -> tuple[float, float]:
        """(samples/s of wall time, samples/s of training-thread CPU time)."""
        wall, cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu
        return samples / wall, samples / cpu


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
                done += 1
                if done == steps:
                    break
        return clock.stop(steps * BATCH)
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
    trainer = transformers.Trainer(
        model=net, args=args, train_dataset=data, optimizers=own or (None, None)
    )
    opt = None
    if dht is not None:
        opt = swarm_optimizer(dht, net, f"hf{run}")
        make_collaborative(trainer, opt, load_state_from_peers=False)
    try:
        clock = Clock()
        clock.start()
        trainer.train()
        return clock.stop(steps * BATCH)
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
    trainer = lightning.Trainer(
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
    clock = Clock()
    clock.start()
    trainer.fit(Module(), loader)
    return clock.stop(steps * BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output_dir", default="/tmp/benchmark_integrations")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the compute runs in the training thread (see the docstring)
    data = examples(512)
    ways = ("plain", "hf", "lightning")
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
            for way in ways:
                for kind, swarm in (("swarm", dht), ("torch", None)):
                    wall, cpu = runners[way](swarm, run)
                    rates["wall"][way][kind].append(wall)
                    rates["cpu"][way][kind].append(cpu)
                    line.append(f"{way}+{kind} {wall:.0f}/{cpu:.0f}")
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
            for kind in ("swarm", "torch"):
                values = rates[measure][way][kind]
                print(
                    f"{measure:4s} {way}+{kind}: median {statistics.median(values):.0f} samples/s"
                )
        for way in ("hf", "lightning"):
            # the ratio: the framework with our integration vs a plain loop, same optimizer
            show(
                f"{measure:4s} {way}+swarm / plain+swarm",
                ratios(measure, (way, "swarm"), ("plain", "swarm")),
            )
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
