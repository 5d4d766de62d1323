"""One peer of collaborative ALBERT pre-training (MLM + sentence-order prediction) on a
Hugging Face ``Trainer`` made collaborative by ``swarmtrain.integrations.huggingface``.

The data and the tokenizer are made offline (``examples/albert/data.py``: the Python standard
library's sources). Gradients and states travel as fp16 (``Float16Compression``); the optimizer
step and the gradient round run in the background (delayed updates), so a peer does not wait for
the network between epochs. Run it from the repository root::

    python examples/albert/run_trainer.py --output_dir peer0            # first peer; prints
    python examples/albert/run_trainer.py --output_dir peer1 --initial_peers /ip4/.../p2p/...
    python examples/albert/run_trainer.py --model_size large ...        # albert-large (GPU)

``--lockstep`` turns the delays off (peers hold exactly the same weights after each epoch);
``--client_mode`` for a peer behind NAT; ``--identity_path`` keeps its peer id across restarts.
Each peer publishes its loss and speed under ``<run_id>_metrics`` in the DHT, where
``run_training_monitor.py`` reads them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers

from swarmtrain.compression import Float16Compression
from swarmtrain.dht import DHT, get_dht_time, owned_keys_validator
from swarmtrain.integrations.huggingface import make_collaborative
from swarmtrain.optim import Optimizer
from swarmtrain.utils.progress import progress_bars_enabled, set_progress_bars


def _load_sibling(name: str):
    """``examples/albert/<name>.py``, imported by path (the example is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"albert_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = _load_sibling("data")
logger = logging.getLogger("albert")
METRICS_TTL = 120.0  # seconds a peer's published metrics stay in the DHT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    add("--initial_peers", nargs="*", default=[], help="multiaddrs of any peers of the run")
    add("--run_id", default="albert")
    add("--output_dir", default="albert_peer", help="Trainer's checkpoints and logs")
    add("--model_size", choices=["tiny", "large"], default="tiny")
    add("--vocab_size", type=int, default=2000)
    add("--seq_len", type=int, default=64)
    add("--max_files", type=int, default=40, help="stdlib modules read for the corpus")
    add("--target_batch_size", type=int, default=4096, help="samples per swarm epoch")
    add("--per_device_train_batch_size", type=int, default=8)
    add("--gradient_accumulation_steps", type=int, default=1)
    add("--learning_rate", type=float, default=1e-3)
    add("--warmup_epochs", type=int, default=5)
    add("--total_epochs", type=int, default=10000, help="LR decays to 0 over these epochs")
    add("--max_steps", type=int, default=100_000, help="local Trainer steps, then stop")
    add("--max_epochs", type=int, default=0, help="stop at this swarm epoch (0: no limit)")
    add("--seed", type=int, default=0, help="data order and masks; the model's seed is fixed")
    add("--fp16", action="store_true", help="mixed precision (CUDA)")
    add("--lockstep", action="store_true", help="no delays: identical weights after epochs")
    add("--matchmaking_time", type=float, default=5.0)
    add("--averaging_timeout", type=float, default=60.0)
    add("--wait_for_peers", type=int, default=1, help="wait until this many peers are seen")
    add("--client_mode", action="store_true", help="this peer cannot be dialled (behind NAT)")
    add("--host_maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"])
    add("--announce_maddrs", nargs="*", default=None)
    add("--identity_path", default=None, help="private key file: the same peer id each run")
    add(
        "--progress_bars",
        choices=["auto", "on", "off"],
        default="auto",
        help="bars for preprocessing, state downloads, checkpoints and training (auto: only\n"
        "on a terminal; elsewhere one log line at the start and end of each)",
    )
    return parser


def albert_config(size: str, vocab_size: int, seq_len: int) -> transformers.AlbertConfig:
    if size == "large":  # albert-large-v2's shape
        return transformers.AlbertConfig(
            vocab_size=vocab_size,
            embedding_size=128,
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            max_position_embeddings=max(512, seq_len),
        )
    return transformers.AlbertConfig(
        vocab_size=vocab_size,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def lr_schedule(warmup: int, total: int):
    """Linear warmup, then linear decay, per swarm epoch."""

    def factor(epoch: int) -> float:
        if epoch < warmup:
            return (epoch + 1) / warmup
        return max(0.0, (total - epoch) / max(1, total - warmup))

    return factor


class PublishMetrics(transformers.TrainerCallback):
    """After each swarm epoch: this peer's mean loss and speed into the DHT, for the monitor."""

    def __init__(self, dht: DHT, opt: Optimizer, run_id: str):
        self.dht, self.opt, self.key = dht, opt, f"{run_id}_metrics"
        # metrics keys are owned: the record under our peer id is signed with our identity key
        dht.add_validators([owned_keys_validator()])
        self.losses: list[float] = []
        self.epoch = opt.local_epoch
        self.history: list[tuple[int, float]] = []  #: (epoch, mean loss of this peer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
        epoch = self.opt.local_epoch
        if epoch != self.epoch and self.losses:
            loss = sum(self.losses) / len(self.losses)
            self.history.append((self.epoch, loss))
            value = {
                "epoch": self.epoch,
                "loss": loss,
                "samples_per_second": self.opt.tracker.performance_ema.samples_per_second,
                "steps": len(self.losses),
            }
            subkey = self.dht.peer_id.to_bytes()
            self.dht.store(self.key, value, get_dht_time() + METRICS_TTL, subkey=subkey)
            self.losses, self.epoch = [], epoch


class StopAtEpoch(transformers.TrainerCallback):
    def __init__(self, opt: Optimizer, epoch: int):
        self.opt, self.epoch = opt, epoch

    def on_step_end(self, args, state, control, **kwargs):
        if self.epoch and self.opt.local_epoch >= self.epoch:
            control.should_training_stop = True


def make_optimizer(args, model: torch.nn.Module, dht: DHT) -> Optimizer:
    delays = {} if args.lockstep else {"delay_optimizer_step": True, "delay_grad_averaging": True}
    return Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.learning_rate),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_schedule(args.warmup_epochs, args.total_epochs)
        ),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        grad_compression=Float16Compression(),
        state_averaging_compression=Float16Compression(),
        delay_state_averaging=not args.lockstep,
        client_mode=args.client_mode,
        tracker_opts={"min_refresh_period": 0.5},
        **delays,
    )


def apply_progress_bars(choice: str) -> None:
    """``--progress_bars``: on/off for the whole process; auto leaves the setting alone."""
    if choice != "auto":
        set_progress_bars(choice == "on")


def main(
    argv: list[str] | None = None,
    dht: DHT | None = None,
    on_trained: Callable[[Optimizer], None] | None = None,
) -> dict[str, Any]:
    """Train one peer; returns what the tests check (the loss per epoch, the model, ...).
    ``dht``: run on this DHT (tests start several peers in one process) instead of a new one;
    ``on_trained``: called with the swarm optimizer after training, before it shuts down (the
    tests synchronise the peers' final states there)."""
    args = build_parser().parse_args(argv)
    apply_progress_bars(args.progress_bars)
    own_dht = dht is None
    if own_dht:
        dht = DHT(
            args.initial_peers,
            client_mode=args.client_mode,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            identity_path=args.identity_path,
        )
        addresses = " ".join(str(a) for a in dht.get_visible_maddrs())
        print(f"join this run with: --initial_peers {addresses}", flush=True)
    documents = data.stdlib_documents(args.max_files)
    tokenizer = data.train_tokenizer(documents, args.vocab_size)  # the same on every peer
    examples = data.pretraining_examples(documents, tokenizer, args.seq_len, seed=args.seed)
    torch.manual_seed(0)  # every peer starts from the same weights (or loads the swarm's)
    config = albert_config(args.model_size, tokenizer.get_vocab_size(), args.seq_len)
    model = transformers.AlbertForPreTraining(config)
    opt = make_optimizer(args, model, dht)
    try:
        training_args = transformers.TrainingArguments(
            output_dir=args.output_dir,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_steps=args.max_steps,
            logging_steps=1,
            save_strategy="steps",
            save_steps=500,
            save_total_limit=2,
            report_to=[],
            fp16=args.fp16,
            seed=args.seed,
            remove_unused_columns=False,
            disable_tqdm=not progress_bars_enabled(),
            dataloader_num_workers=0,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = transformers.Trainer(model=model, args=training_args, train_dataset=examples)
        make_collaborative(trainer, opt)
        publish = PublishMetrics(dht, opt, args.run_id)
        trainer.add_callback(publish)
        trainer.add_callback(StopAtEpoch(opt, args.max_epochs))
        if args.wait_for_peers > 1:
            opt.wait_for_peers(args.wait_for_peers)
        started = time.monotonic()
        trainer.train()
        elapsed = time.monotonic() - started
        if on_trained is not None:
            on_trained(opt)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        logger.info("done: epoch %d, %d steps in %.0f s", opt.local_epoch, len(losses), elapsed)
        return {
            "model": model,
            "epoch": opt.local_epoch,
            "epoch_losses": publish.history,
            "losses": losses,
            "epochs_alone": opt.epochs_alone,
            "seconds": elapsed,
            "samples": len(losses) * opt.batch_size_per_step,
            "finite": all(math.isfinite(x) for x in losses),
        }
    finally:
        opt.shutdown()
        if own_dht:
            dht.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
