"""The ALBERT run's monitor: an auxiliary peer without data that follows the run. It logs the
peers' loss and throughput (what ``run_trainer.py`` publishes under ``<run_id>_metrics``), and
every ``--save_every`` swarm epochs downloads the training state from the peers and saves it
as a checkpoint (``save_pretrained`` model + ``optimizer.pt``) into ``--checkpoint_dir``.

A monitor on a machine with a public address is also a good bootstrap peer: start it first, with
a fixed port and ``--identity_path`` so that its address stays the same across restarts::

    python examples/albert/run_training_monitor.py --host_maddrs /ip4/0.0.0.0/tcp/31337 \\
        --identity_path monitor.key --checkpoint_dir albert_checkpoints

It serves no state itself (its optimizer is in client mode), so newcomers load from trainers.

``--hub_repo_id user/albert-swarm`` also uploads each checkpoint to that Hugging Face Hub model
repository (off by default; needs ``huggingface_hub`` and a login: ``hf auth login`` or
``HF_TOKEN``). A failed upload is logged and the monitor goes on. State downloads, checkpoint
saves and uploads show progress bars on a terminal (``--progress_bars on|off`` to choose), else
one log line when each starts and ends.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from swarmtrain.dht import DHT, owned_keys_validator
from swarmtrain.p2p import PeerID
from swarmtrain.utils.progress import Progress, progress_bars_enabled


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
    add(
        "--hub_repo_id",
        default=None,
        help="also upload each checkpoint to this Hugging Face Hub model repo (needs\n"
        "huggingface_hub and a login); default: local checkpoints only",
    )
    return parser


class HubUploadUnavailable(RuntimeError):
    """``--hub_repo_id`` was given but ``huggingface_hub`` cannot be imported."""


def hub_api() -> Any:
    """A ``huggingface_hub.HfApi`` (the package is imported only when an upload is asked for)."""
    try:
        import huggingface_hub
    except ImportError as e:
        raise HubUploadUnavailable(
            f"--hub_repo_id needs the huggingface_hub package ({e}): "
            "pip install huggingface_hub, or leave --hub_repo_id out to keep checkpoints local"
        ) from None
    return huggingface_hub.HfApi()


def _folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def upload_checkpoint(api: Any, repo_id: str, path: str, epoch: int) -> bool:
    """Upload the checkpoint folder ``path`` to ``repo_id``; False (logged) if it failed."""
    with Progress(f"uploading {path} to {repo_id}", total=_folder_bytes(path), log=logger) as p:
        try:
            api.create_repo(repo_id, exist_ok=True)
            api.upload_folder(
                repo_id=repo_id, folder_path=path, commit_message=f"swarm epoch {epoch}"
            )
        except Exception as e:  # network, auth, quota: the next checkpoint tries again
            logger.error("could not upload %s to %s: %r", path, repo_id, e)
            p.close(ok=False)
            return False
        p.update_to(p.total or 0)
    return True


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


@contextlib.contextmanager
def _transformers_bars_as_ours() -> Iterator[None]:
    """transformers' own bars (``save_pretrained``'s "Writing model shards") under our rule."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not progress_bars_enabled():
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.enable_progress_bar()
    else:
        yield


def save_checkpoint(model: Any, opt: Any, directory: str, epoch: int) -> str:
    path = os.path.join(directory, f"epoch_{epoch}")
    os.makedirs(path, exist_ok=True)
    with (
        Progress(f"saving the swarm's state at epoch {epoch} to {path}", log=logger) as progress,
        _transformers_bars_as_ours(),
    ):
        model.save_pretrained(path)
        progress.update_to(_folder_bytes(path))
        torch.save(opt.state_dict(), os.path.join(path, "optimizer.pt"))
        progress.update_to(_folder_bytes(path))
    return path


def main(argv: list[str] | None = None, dht: DHT | None = None) -> list[str]:
    """Follow the run; returns the checkpoint paths (tests stop it with ``--max_checkpoints``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    trainer_script.apply_progress_bars(args.progress_bars)
    hub = None
    if args.hub_repo_id:
        try:
            hub = hub_api()  # before anything starts: a missing package is a usage error
        except HubUploadUnavailable as e:
            parser.error(str(e))
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
                    if hub is not None:
                        upload_checkpoint(hub, args.hub_repo_id, saved[-1], last_saved)
            time.sleep(args.refresh_period)
    finally:
        opt.shutdown()
        if own_dht:
            dht.shutdown()
    return saved


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
