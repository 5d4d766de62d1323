"""Overhead of the framework integrations against a plain loop with the same swarmtrain.Optimizer.

One peer (its epochs use the local gradients, no network round), a tiny BertForMaskedLM on fixed
masked examples; each repetition runs the same number of optimizer steps three ways, in turn:
a hand-written loop, HF Trainer through ``make_collaborative``, Lightning with
``SwarmStrategy``. Prints samples/s per way (medians over repetitions) and the ratio to the
plain loop of the same repetition::

    PYTHONPATH=. python benchmarks/benchmark_integrations.py --steps 150 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

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


def plain(dht: DHT, data: list[dict], steps: int, run: int) -> float:
    net = model()
    opt = swarm_optimizer(dht, net, f"plain{run}")
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    try:
        started = time.perf_counter()
        done = 0
        while done < steps:
            for batch in loader:
                net(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
                done += 1
                if done == steps:
                    break
        return steps * BATCH / (time.perf_counter() - started)
    finally:
        opt.shutdown()


def hf(dht: DHT, data: list[dict], steps: int, run: int, output_dir: str) -> float:
    net = model()
    opt = swarm_optimizer(dht, net, f"hf{run}")
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = transformers.Trainer(model=net, args=args, train_dataset=data)
    make_collaborative(trainer, opt, load_state_from_peers=False)
    try:
        started = time.perf_counter()
        trainer.train()
        return steps * BATCH / (time.perf_counter() - started)
    finally:
        opt.shutdown()


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, index):
        return self.net(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def pl(dht: DHT, data: list[dict], steps: int, run: int) -> float:
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
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    started = time.perf_counter()
    trainer.fit(Module(), loader)
    return steps * BATCH / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output_dir", default="/tmp/benchmark_integrations")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    data = examples(512)
    rates: dict[str, list[float]] = {"plain": [], "hf": [], "lightning": []}
    ratios: dict[str, list[float]] = {"hf": [], "lightning": []}
    dht = DHT(**HOST)
    try:
        for run in range(args.repeats):
            base = plain(dht, data, args.steps, run)
            hf_rate = hf(dht, data, args.steps, run, args.output_dir)
            pl_rate = pl(dht, data, args.steps, run)
            for name, rate in (("plain", base), ("hf", hf_rate), ("lightning", pl_rate)):
                rates[name].append(rate)
            ratios["hf"].append(hf_rate / base)
            ratios["lightning"].append(pl_rate / base)
            print(
                f"run {run}: plain {base:.0f}  hf {hf_rate:.0f}  lightning {pl_rate:.0f} samples/s"
            )
    finally:
        dht.shutdown()
    for name, values in rates.items():
        print(f"{name:9s} median {statistics.median(values):.0f} samples/s")
    for name, values in ratios.items():
        print(
            f"{name:9s} / plain: median {statistics.median(values):.3f} (runs: "
            + ", ".join(f"{v:.3f}" for v in values)
            + ")"
        )


if __name__ == "__main__":
    main()
