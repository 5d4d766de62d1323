"""One peer of ``swarmtrain demo``: a process that trains a small classifier with
``swarmtrain.Optimizer`` and reports to the ``swarmtrain demo`` parent.

Run by the parent as ``python -m swarmtrain.cli.demo_peer --index I ...``. It speaks JSON
lines: commands on stdin (``join`` with the bootstrap addresses, ``start``, ``finish`` at an
epoch, ``exit`` once every peer is done, ``stop``), events on stdout (``ready``,
``prepared``, ``progress``, ``epoch``, ``done``, ``error``). Anything else the process
prints goes to stderr. When stdin closes (the parent died), the peer stops too, so no process
outlives the demo.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from swarmtrain.cli.options import add_option

FEATURES, CLASSES, HIDDEN = 32, 10, 64
TRAIN_SAMPLES, EVAL_SAMPLES = 6000, 1000
HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}  # one machine


def make_data(seed: int = 0):
    """A 10-class problem generated offline: noisy points around random class centres, with
    enough overlap that the loss falls over several epochs. Returns (train, eval) pairs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 0.9
    total = TRAIN_SAMPLES + EVAL_SAMPLES
    labels = torch.randint(0, CLASSES, (total,), generator=generator)
    points = centres[labels] + torch.randn(total, FEATURES, generator=generator)
    train = (points[:TRAIN_SAMPLES], labels[:TRAIN_SAMPLES])
    return train, (points[TRAIN_SAMPLES:], labels[TRAIN_SAMPLES:])


def make_model():
    """The same initial weights on every peer (peers must start from one state)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


class Channel:
    """The JSON-lines link to the parent: events out, commands in (read by a thread)."""

    def __init__(self) -> None:
        # Events use a private copy of stdout; fd 1 then points at stderr so that stray prints
        # of libraries cannot corrupt the protocol.
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._lock = threading.Lock()
        self._commands: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self.stopping = threading.Event()
        threading.Thread(target=self._read, daemon=True, name="demo-commands").start()

    def send(self, event: str, **fields: Any) -> None:
        with self._lock:
            try:
                self._out.write(json.dumps({"event": event, **fields}) + "\n")
            except (BrokenPipeError, ValueError):
                self.stopping.set()

    def _read(self) -> None:
        for line in sys.stdin:
            try:
                command = json.loads(line)
            except json.JSONDecodeError:
                continue
            if command.get("cmd") == "stop":
                self.stopping.set()
            with self._cond:
                self._commands.append(command)
                self._cond.notify_all()
        self.stopping.set()  # stdin closed: the parent is gone
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, name: str) -> dict[str, Any] | None:
        """Block until the parent sends command ``name`` (None if told to stop first)."""
        with self._cond:
            while not self.stopping.is_set():
                for i, command in enumerate(self._commands):
                    if command.get("cmd") == name:
                        return self._commands.pop(i)
                self._cond.wait(0.5)
        return None

    def poll(self, name: str) -> dict[str, Any] | None:
        with self._cond:
            for i, command in enumerate(self._commands):
                if command.get("cmd") == name:
                    return self._commands.pop(i)
        return None


def evaluate(model, eval_set) -> tuple[float, float]:
    import torch

    with torch.no_grad():
        logits = model(eval_set[0])
        loss = torch.nn.functional.cross_entropy(logits, eval_set[1]).item()
        accuracy = (logits.argmax(1) == eval_set[1]).float().mean().item()
    return loss, accuracy


def train(args, channel: Channel) -> None:
    import torch

    import swarmtrain

    torch.set_num_threads(1)  # several peers share this machine's cores
    (points, labels), eval_set = make_data()
    shard = torch.arange(args.index, len(points), args.peers)
    points, labels = points[shard], labels[shard]
    model = make_model()

    initial_peers: list[str] = []
    if args.index > 0:
        join = channel.wait_for("join")
        if join is None:
            return
        initial_peers = join["initial_peers"]
    dht = swarmtrain.DHT(initial_peers, **HOST)
    try:
        channel.send("ready", maddrs=[str(a) for a in dht.get_visible_maddrs()])
        opt = swarmtrain.Optimizer(
            dht=dht,
            run_id=args.run_id,
            target_batch_size=args.target_batch_size,
            batch_size_per_step=args.batch_size,
            optimizer=lambda params: torch.optim.Adam(params, lr=args.lr),
            params=model.parameters(),
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            load_state_timeout=args.averaging_timeout,
        )
        try:
            _train_loop(args, channel, model, opt, points, labels, eval_set)
        finally:
            opt.shutdown()
    finally:
        dht.shutdown()


def _wait_for_peers(opt, peers: int, timeout=60.0) -> float:
    """Wait until our progress tracker sees every peer: a peer that started at full speed
    before it saw the others would finish its first epochs alone (milliseconds each for this
    small model) and leave the swarm out of step."""
    started = time.monotonic()
    opt.wait_for_peers(peers, timeout=timeout)
    return time.monotonic() - started


def _train_loop(args, channel, model, opt, points, labels, eval_set) -> None:
    import torch

    loss, accuracy = evaluate(model, eval_set)
    waited = _wait_for_peers(opt, args.peers)
    channel.send("prepared", epoch=0, eval_loss=loss, accuracy=accuracy, waited=waited)
    if channel.wait_for("start") is None:
        return
    generator = torch.Generator().manual_seed(1000 + args.index)
    target_epoch = args.epochs
    train_loss = None
    samples, window_start, window_samples = 0, time.monotonic(), 0
    last_report = 0.0
    while not channel.stopping.is_set():
        finish = channel.poll("finish")
        if finish is not None:
            target_epoch = finish["epoch"]
        if target_epoch is not None and opt.local_epoch >= target_epoch:
            break
        rows = torch.randint(0, len(points), (args.batch_size,), generator=generator)
        batch_loss = torch.nn.functional.cross_entropy(model(points[rows]), labels[rows])
        batch_loss.backward()
        epoch = opt.local_epoch
        opt.step()
        opt.zero_grad()
        value = batch_loss.item()
        train_loss = value if train_loss is None else 0.9 * train_loss + 0.1 * value
        samples += args.batch_size
        window_samples += args.batch_size
        now = time.monotonic()
        if opt.local_epoch != epoch:
            loss, accuracy = evaluate(model, eval_set)
            channel.send(
                "epoch",
                epoch=opt.local_epoch,
                eval_loss=loss,
                accuracy=accuracy,
                averaged=opt.epochs_averaged,
                alone=opt.epochs_alone,
            )
        if now - last_report >= 0.25:
            rate = window_samples / max(now - window_start, 1e-6)
            if now - window_start > 2.0:
                window_start, window_samples = now, 0
            progress = opt.tracker.global_progress if opt.tracker is not None else None
            channel.send(
                "progress",
                epoch=opt.local_epoch,
                train_loss=train_loss,
                samples=samples,
                samples_per_second=rate,
                peers=progress.num_peers if progress else 0,
                swarm_samples=progress.samples_accumulated if progress else 0,
            )
            last_report = now
    loss, accuracy = evaluate(model, eval_set)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    channel.send(
        "done",
        epoch=opt.local_epoch,
        eval_loss=loss,
        accuracy=accuracy,
        samples=samples,
        averaged=opt.epochs_averaged,
        alone=opt.epochs_alone,
        stopped=channel.stopping.is_set(),
        params=flat.tolist(),
    )
    # Stay in the swarm until every peer is done: a peer that lags behind may still need our
    # state (it loads it from peers), and leaving early would strand it.
    channel.wait_for("exit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    add_option(parser, "--run_id", default="swarmtrain_demo")
    parser.add_argument("--epochs", type=int, default=None)
    add_option(parser, "--target_batch_size", type=int, default=256)
    add_option(parser, "--batch_size", type=int, default=16)
    add_option(parser, "--matchmaking_time", type=float, default=1.0)
    add_option(parser, "--averaging_timeout", type=float, default=10.0)
    parser.add_argument("--lr", type=float, default=0.01)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The parent stops peers with a "stop" command; SIGTERM and SIGINT mean the same.
    channel = Channel()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: channel.stopping.set())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        train(args, channel)
    except Exception as e:
        traceback.print_exc()
        channel.send("error", message=f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
