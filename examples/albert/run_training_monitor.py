"""The ALBERT run's monitor: an auxiliary peer without data that follows the run. It logs the
peers' loss and throughput (what ``run_trainer.py`` publishes under ``<run_id>_metrics``), and
every ``--save_every`` swarm epochs downloads the training state from the peers and saves it
as a checkpoint (``save_pretrained`` model + ``optimizer.pt``) into ``--checkpoint_dir``.

A monitor on a machine with a public address is also a good bootstrap peer: start it first, with
a fixed port and ``--identity_path`` so that its address stays the same across restarts::

    python examples/albert/run_training_monitor.py --host_maddrs /ip4/0.0.0.0/tcp/31337 \\
        --identity_path monitor.key --checkpoint_dir albert_checkpoints

It serves no state itself (its optimizer is in client mode), so newcomers load from trainers.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
from typing import Any

import torch
import transformers

from swarmtrain.dht import DHT, owned_keys_validator
from swarmtrain.p2p import PeerID


def _load_sibling(name: str):
    """``examples/albert/<name>.py``, imported by path (the example is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"albert_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trainer_script = _load_sibling("run_trainer")
logger = logging.getLogger("albert.monitor")


def build_parser() -> argparse.ArgumentParser:
    parser = trainer_script.build_parser()  # the run's settings must match the trainers'
    parser.description = __doc__.split("\n\n")[0]
    add = parser.add_argument
    add("--checkpoint_dir", default="albert_checkpoints")
    add("--save_every", type=int, default=10, help="swarm epochs between checkpoints")
    add("--refresh_period", type=float, default=10.0, help="seconds between metric reads")
    add("--max_checkpoints", type=int, default=0, help="stop after this many (0: never)")
    add("--max_seconds", type=float, default=0, help="stop after this long (0: never)")
    return parser


def read_metrics(dht: DHT, run_id: str) -> dict[str, dict[str, Any]]:
    """The latest metrics each trainer published: ``{peer id: {epoch, loss, ...}}``."""
    found = dht.get(f"{run_id}_metrics", latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    metrics = {}
    for subkey, item in found.value.items():
        value = item.value
        if not isinstance(subkey, bytes):
            continue  # metrics records are owned: their subkey is the publisher's peer id
        if isinstance(value, dict) and isinstance(value.get("loss"), (int, float)):
            metrics[PeerID(subkey).to_base58()] = value
    return metrics


def summarize(metrics: dict[str, dict[str, Any]]) -> dict[str, float]:
    if not metrics:
        return {}
    values = list(metrics.values())
    return {
        "epoch": max(v.get("epoch", 0) for v in values),
        "peers": len(values),
        "loss": sum(v["loss"] for v in values) / len(values),
        "samples_per_second": sum(float(v.get("samples_per_second", 0.0)) for v in values),
    }


def save_checkpoint(model: Any, opt: Any, directory: str, epoch: int) -> str:
    path = os.path.join(directory, f"epoch_{epoch}")
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    torch.save(opt.state_dict(), os.path.join(path, "optimizer.pt"))
    logger.info("saved the swarm's state at epoch %d to %s", epoch, path)
    return path


def main(argv: list[str] | None = None, dht: DHT | None = None) -> list[str]:
    """Follow the run; returns the checkpoint paths (tests stop it with ``--max_checkpoints``)."""
    args = build_parser().parse_args(argv)
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
        print(f"trainers join with: --initial_peers {addresses}", flush=True)
    dht.add_validators([owned_keys_validator()])  # reads drop metrics their peer did not sign
    tokenizer = trainer_script.data.train_tokenizer(
        trainer_script.data.stdlib_documents(args.max_files), args.vocab_size
    )
    torch.manual_seed(0)
    config = trainer_script.albert_config(args.model_size, tokenizer.get_vocab_size(), args.seq_len)
    model = transformers.AlbertForPreTraining(config)
    args.client_mode = True  # download states, serve none (they would be stale)
    opt = trainer_script.make_optimizer(args, model, dht)
    saved: list[str] = []
    last_saved = 0
    deadline = time.monotonic() + args.max_seconds if args.max_seconds else None
    try:
        while not args.max_checkpoints or len(saved) < args.max_checkpoints:
            if deadline is not None and time.monotonic() > deadline:
                break
            summary = summarize(read_metrics(dht, args.run_id))
            swarm = opt.tracker.global_progress
            if summary:
                logger.info(
                    "epoch %d: loss %.4f, %d peers reporting (%d in the swarm), %.1f samples/s",
                    summary["epoch"],
                    summary["loss"],
                    summary["peers"],
                    swarm.num_peers,
                    summary["samples_per_second"],
                )
            if swarm.epoch >= last_saved + args.save_every:
                if opt.load_state_from_peers():
                    last_saved = opt.local_epoch
                    saved.append(save_checkpoint(model, opt, args.checkpoint_dir, last_saved))
            time.sleep(args.refresh_period)
    finally:
        opt.shutdown()
        if own_dht:
            dht.shutdown()
    return saved


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
