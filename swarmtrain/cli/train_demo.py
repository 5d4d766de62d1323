"""``swarmtrain demo``: N local peers, one process each, train one classifier together.

The parent starts the peers (``swarmtrain.cli.demo_peer``) at once, hands peer 0's addresses to
the others, starts them together, shows their progress, and prints a summary. It does not
import torch or swarmtrain's networking itself. Ctrl+C stops the peers cleanly (each shuts down
its Optimizer and DHT); a peer still alive after a grace period is killed, so none is left
behind. The exit code is 0 only when every peer finished, the loss fell and the peers agree.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from swarmtrain.cli.progress_display import PeerView, ProgressDisplay

MAX_PEERS = 16
STARTUP_TIMEOUT = 180.0  # seconds for every peer to import torch and join (slow, busy machines)
STOP_GRACE = 20.0  # seconds the peers get to shut down before they are killed
AGREEMENT_TOLERANCE = 1e-3  # max |difference| of parameters between peers after the last epoch


@dataclass
class DemoOptions:
    peers: int = 3
    epochs: int | None = 10
    duration: float | None = None
    target_batch_size: int = 256
    batch_size: int = 16
    matchmaking_time: float = 1.0
    quiet: bool = False
    log_dir: str | None = None  #: keep the peers' logs here (else a temporary folder)

    def validate(self) -> None:
        if not 1 <= self.peers <= MAX_PEERS:
            raise ValueError(f"--peers must be between 1 and {MAX_PEERS}, got {self.peers}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"--duration must be positive, got {self.duration}")
        if self.batch_size < 1 or self.target_batch_size < self.batch_size:
            raise ValueError("need 1 <= --batch_size <= --target_batch_size")
        if self.matchmaking_time <= 0:
            raise ValueError("--matchmaking_time must be positive")


@dataclass
class _Peer:
    process: subprocess.Popen
    log_path: str
    view: PeerView = field(default_factory=PeerView)
    prepared: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    error: str | None = None
    exited: bool = False

    def send(self, command: str, **fields: Any) -> None:
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"cmd": command, **fields}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # it already exited; its exit is reported by the reader

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def _read_events(index: int, stream, events: queue.Queue) -> None:
    for line in stream:
        try:
            events.put((index, json.loads(line)))
        except json.JSONDecodeError:
            continue
    events.put((index, {"event": "exit"}))


class TrainingDemo:
    """One run of the demo; :meth:`run` returns the exit code."""

    def __init__(self, options: DemoOptions, out: TextIO, *, live: bool):
        options.validate()
        self.options = options
        self.display = ProgressDisplay(
            out,
            live=live,
            quiet=options.quiet,
            target=options.target_batch_size,
            epochs=options.epochs,
        )
        self.events: queue.Queue = queue.Queue()
        self.peers: list[_Peer] = []
        self.started_at = time.monotonic()
        self.training_since: float | None = None
        self.finish_sent = False
        self.failure: str | None = None

    # ------------------------------------------------------------------ processes

    def _command(self, index: int) -> list[str]:
        o = self.options
        command = [sys.executable, "-m", "swarmtrain.cli.demo_peer", "--index", str(index)]
        command += ["--peers", str(o.peers), "--target_batch_size", str(o.target_batch_size)]
        command += [
            "--batch_size",
            str(o.batch_size),
            "--matchmaking_time",
            str(o.matchmaking_time),
        ]
        command += ["--run_id", f"demo{os.getpid()}"]
        if o.epochs is not None:
            command += ["--epochs", str(o.epochs)]
        return command

    def _spawn(self, logdir: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        for i in range(self.options.peers):
            log_path = os.path.join(logdir, f"peer{i}.log")
            with open(log_path, "w") as log:
                process = subprocess.Popen(
                    self._command(i),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    bufsize=1,
                    env=env,
                    start_new_session=True,  # Ctrl+C reaches the parent only; it stops them
                )
            self.peers.append(_Peer(process, log_path))
            threading.Thread(
                target=_read_events, args=(i, process.stdout, self.events), daemon=True
            ).start()

    def _stop_all(self, grace: float) -> None:
        """Ask every peer to stop, wait up to ``grace`` seconds, then kill the rest."""
        for peer in self.peers:
            peer.send("stop")
        deadline = time.monotonic() + grace
        try:
            while not all(p.exited for p in self.peers) and time.monotonic() < deadline:
                self._pump(0.2)
        except KeyboardInterrupt:
            pass  # a second Ctrl+C: kill now
        self._kill_all()

    def _kill_all(self) -> None:
        for peer in self.peers:
            if peer.process.poll() is None:
                peer.process.kill()
        for peer in self.peers:
            peer.process.wait()
            if peer.process.stdin is not None:
                try:
                    peer.process.stdin.close()
                except OSError:
                    pass

    # ------------------------------------------------------------------ events

    def _pump(self, timeout: float) -> None:
        try:
            index, event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(index, event)
        while True:
            try:
                index, event = self.events.get_nowait()
            except queue.Empty:
                return
            self._handle(index, event)

    def _handle(self, index: int, event: dict[str, Any]) -> None:
        peer, kind = self.peers[index], event.get("event")
        view = peer.view
        if kind == "ready":
            view.status = "joined"
            if index == 0:
                for other in self.peers[1:]:
                    other.send("join", initial_peers=event["maddrs"])
                self.display.message(f"peer 0 is the bootstrap peer at {event['maddrs'][0]}")
        elif kind == "prepared":
            peer.prepared = event
            view.status, view.eval_loss, view.accuracy = "ready", event["eval_loss"], None
            if all(p.prepared for p in self.peers):
                startup = time.monotonic() - self.started_at
                self.display.message(
                    f"{len(self.peers)} peers up in {startup:.1f} s: training starts "
                    f"(target batch {self.options.target_batch_size} samples per epoch)"
                )
                self.training_since = time.monotonic()
                self.display.start_clock()
                for p in self.peers:
                    p.send("start")
        elif kind == "progress":
            view.status = "training"
            view.epoch = event["epoch"]
            view.train_loss = event["train_loss"]
            view.samples_per_second = event["samples_per_second"]
            view.samples = event["samples"]
            view.peers_seen, view.swarm_samples = event["peers"], event["swarm_samples"]
        elif kind == "epoch":
            view.epoch, view.eval_loss, view.accuracy = (
                event["epoch"],
                event["eval_loss"],
                event["accuracy"],
            )
            view.history.append((event["epoch"], event["eval_loss"], event["accuracy"]))
        elif kind == "done":
            peer.done = event
            view.status = "done"
            view.epoch, view.eval_loss, view.accuracy = (
                event["epoch"],
                event["eval_loss"],
                event["accuracy"],
            )
            view.samples_per_second, view.samples = 0.0, event["samples"]
            if all(p.done for p in self.peers):
                for p in self.peers:
                    p.send("exit")
        elif kind == "error":
            peer.error = event["message"]
            view.status = "failed"
        elif kind == "exit":
            peer.exited = True
            code = peer.process.wait()
            if peer.done is None and self.failure is None:
                reason = peer.error or f"exited with code {code} before finishing"
                self.failure = f"peer {index} {reason}"
                tail = peer.log_tail()
                if tail:
                    self.failure += "\n  its last log lines:\n    " + tail.replace("\n", "\n    ")

    def _check_duration(self) -> None:
        duration = self.options.duration
        if duration is None or self.training_since is None or self.finish_sent:
            return
        if time.monotonic() - self.training_since >= duration:
            final = max(p.view.epoch for p in self.peers) + 1
            if self.options.epochs is not None:
                final = min(final, self.options.epochs)
            for peer in self.peers:
                peer.send("finish", epoch=final)
            self.finish_sent = True
            self.display.message(f"{duration:g} s passed: finishing at epoch {final}")

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        o = self.options
        what = f"{o.epochs} epochs" if o.epochs and not o.duration else f"{o.duration:g} s"
        self.display.message(
            f"swarmtrain demo: {o.peers} peers (one process each) train a small MLP on "
            f"generated data for {what}",
            important=False,
        )
        with tempfile.TemporaryDirectory(prefix="swarmtrain-demo-") as logdir:
            if o.log_dir is not None:
                os.makedirs(o.log_dir, exist_ok=True)
                logdir = o.log_dir
            try:
                self._spawn(logdir)
                while not all(p.exited for p in self.peers):
                    self._pump(0.1)
                    self._check_duration()
                    self.display.update([p.view for p in self.peers])
                    if self.failure is not None:
                        break
                    if self.training_since is None:
                        if time.monotonic() - self.started_at > STARTUP_TIMEOUT:
                            self.failure = f"the peers did not start in {STARTUP_TIMEOUT:g} s"
                            break
                if self.failure is not None:
                    self._stop_all(STOP_GRACE)
                self.display.update([p.view for p in self.peers], force=True)
                self.display.close()
            except KeyboardInterrupt:
                self.display.close()
                self.display.message(
                    "\ninterrupted: stopping the peers (Ctrl+C again to kill them)",
                    important=True,
                )
                self._stop_all(STOP_GRACE)
                self.display.message("stopped; no peer is left running", important=True)
                return 130
            finally:
                self._kill_all()
        return self._summary()

    def _summary(self) -> int:
        say = self.display.message
        if self.failure is not None:
            say(f"swarmtrain demo FAILED: {self.failure}", important=True)
            return 1
        done = [p.done for p in self.peers if p.done is not None]
        initial = self.peers[0].prepared["eval_loss"] if self.peers[0].prepared else float("nan")
        final_loss = sum(d["eval_loss"] for d in done) / len(done)
        final_accuracy = sum(d["accuracy"] for d in done) / len(done)
        epochs = sorted({d["epoch"] for d in done})
        reference = done[0]["params"]
        difference = max(
            (abs(a - b) for d in done[1:] for a, b in zip(d["params"], reference, strict=True)),
            default=0.0,
        )
        training = time.monotonic() - (self.training_since or self.started_at)
        total = time.monotonic() - self.started_at
        averaged = sum(d["averaged"] for d in done)
        rounds = sum(d["averaged"] + d["alone"] for d in done)
        samples = sum(d["samples"] for d in done)
        say(
            f"done: {len(done)} peer{'s' if len(done) != 1 else ''} trained one model for "
            f"{epochs[-1]} epochs in {training:.1f} s ({total:.1f} s with start-up)",
            important=True,
        )
        say(
            f"  eval loss {initial:.3f} -> {final_loss:.3f}, accuracy {final_accuracy:.1%}; "
            f"{samples:,} samples, {samples / max(training, 1e-9):,.0f} samples/s",
            important=True,
        )
        agree = len(epochs) == 1 and difference <= AGREEMENT_TOLERANCE
        say(
            f"  peers {'agree' if agree else 'DISAGREE'}: all at epoch "
            f"{'/'.join(map(str, epochs))}, parameters differ by at most {difference:.1e}",
            important=True,
        )
        say(
            f"  gradients averaged with the swarm in {averaged} of {rounds} peer-epochs",
            important=True,
        )
        if not final_loss < initial:
            say("swarmtrain demo FAILED: the loss did not fall", important=True)
            return 1
        if not agree:
            say("swarmtrain demo FAILED: the peers ended with different models", important=True)
            return 1
        return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run the training demo; returns the process exit code (130 when interrupted)."""
    out = sys.stdout if out is None else out
    live = out.isatty() and os.environ.get("TERM") != "dumb"
    demo = TrainingDemo(options, out, live=live)
    if threading.current_thread() is not threading.main_thread():
        return demo.run()
    # SIGTERM stops the peers as cleanly as Ctrl+C; SIGINT works even where it was ignored
    # (a background job of a script).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return demo.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
