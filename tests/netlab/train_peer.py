"""A training peer for netlab: ``swarmtrain.Optimizer`` or ``DiLoCoOptimizer`` on the small
classifier of ``swarmtrain demo`` (offline data), driven by JSON lines on stdin.

``python train_peer.py '<json options>'``: options ``dht`` (``DHT`` keywords), ``mode``
(``"optimizer"`` or ``"diloco"``), ``index`` / ``peers`` (this peer's data shard), ``log``
(logger names shown at ``log_level``, DEBUG by default) and ``log_dir`` (write them to
``<log_dir>/peer<index>.log`` with wall-clock stamps instead of stderr). Prints
``{"ready": ..., "peer_id", "maddrs"}``, then answers:

- ``{"op": "wait_circuit", "timeout": s}``: wait for a ``/p2p-circuit`` address;
- ``{"op": "train", "seconds": s, "peers": n, "run_id": ...}`` (DiLoCo: also ``inner_steps``,
  ``outer_lr``, ``outer_momentum``): wait until the run has ``n`` peers (at most
  ``start_barrier`` seconds, 60 by default; 0: no wait), train for ``s`` seconds, then print
  ``{"trained": ..., "epoch": E}`` and keep training until a ``{"op": "finish", "epoch": E}``
  line arrives and our epoch (outer step for DiLoCo) reaches it; then print
  ``{"done": ...}``: epochs, rounds averaged / alone, the group size of each round
  (``group_sizes``: {size: rounds}) and partial all-reduces, eval loss before and after, the
  parameters;
- ``{"op": "paths"}`` (while training or after ``done``): ``{"paths": {peer id: kinds}}``,
  the kinds of each connected peer's open connections (``P2P.connection_paths``; ``done``
  carries them too);
- ``{"op": "quit"}`` (or stdin closed): shut down.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import sys
import threading
import time

from swarmtrain.cli.demo_peer import evaluate, make_data, make_model


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


def read_commands(commands: queue.Queue) -> None:
    for line in sys.stdin:
        commands.put(json.loads(line))
    commands.put({"op": "quit"})


class RoundLog(logging.Handler):
    """Counts the group size of every round this peer finished, and its partial all-reduces,
    from swarmtrain's own log records (``Optimizer``: one per epoch; DiLoCo: one per outer
    step; a round that failed logs no size: the peer stepped alone)."""

    SIZE_ARGUMENT = {
        "%s: averaged gradients with %d peers": 1,
        "DiLoCo outer step %d (fragment %d, inner step %d): group of %d, waited %.2f s": 3,
    }
    PARTIAL = "all-reduce in a group of %d was partial: banned senders %s, failed reducers %s%s"

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.sizes: dict[int, int] = {}
        self.partial = 0

    def emit(self, record: logging.LogRecord) -> None:
        index = self.SIZE_ARGUMENT.get(record.msg)
        if index is not None and isinstance(record.args, tuple):
            size = int(record.args[index])
            self.sizes[size] = self.sizes.get(size, 0) + 1
        elif record.msg == self.PARTIAL:
            self.partial += 1

    def install(self) -> None:
        for name in (
            "swarmtrain.optim._epoch_gradients",
            "swarmtrain.optim.diloco",
            "swarmtrain.averaging.async_averager",
        ):
            logger = logging.getLogger(name)
            logger.addHandler(self)
            if logger.getEffectiveLevel() > logging.DEBUG:
                logger.setLevel(logging.DEBUG)


ROUNDS = RoundLog()


def progress(opt, mode: str) -> dict:
    if mode == "diloco":
        stats = opt.statistics()
        return {
            "epoch": stats.outer_step,
            "averaged": stats.rounds_averaged,
            "alone": stats.rounds_alone,
            "last_group_size": stats.last_group_size,
            "bytes_sent": stats.bytes_sent,
            "caught_up": stats.states_caught_up,
            "group_sizes": dict(ROUNDS.sizes),
            "partial": ROUNDS.partial,
        }
    return {
        "epoch": opt.local_epoch,
        "averaged": opt.epochs_averaged,
        "alone": opt.epochs_alone,
        "group_sizes": dict(ROUNDS.sizes),
        "partial": ROUNDS.partial,
    }


def connection_paths(dht) -> dict[str, list[str]]:
    """Per connected peer id, the kinds of its open connections (``P2P.connection_paths``)."""

    async def read(async_dht, node) -> dict[str, list[str]]:
        return {str(peer): kinds for peer, kinds in async_dht.p2p.connection_paths().items()}

    return dht.run_coroutine(read)


def flat_parameters(model) -> list[float]:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def status(model, eval_set, opt, mode: str) -> dict:
    """``{"status": eval loss, "finite": all parameters finite, **progress}``."""
    import torch

    loss, accuracy = evaluate(model, eval_set)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"status": loss, "accuracy": accuracy, "finite": finite, **progress(opt, mode)}


def final_sync(opt, mode: str, model, message: dict) -> dict:
    """One synchronous state round after training: Optimizer peers average their training
    state with every peer that joins the round; DiLoCo peers load the state of ``donor``
    (``message["donor"]``, a peer id; the donor keeps its own)."""
    from swarmtrain.p2p import PeerID

    if mode == "diloco":
        donor = message["donor"]
        loaded = donor == str(opt.averager.peer_id) or opt.load_state_from_peers(
            timeout=message.get("timeout", 60), donors=[PeerID.from_base58(donor)]
        )
        return {"synced": bool(loaded), "params": flat_parameters(model)}
    group = opt.state_averager.step(
        averaging_round=True, averaging_opts={"timeout": message.get("timeout", 60)}
    )
    return {"synced": len(group or ()), "params": flat_parameters(model)}


def train(dht, options: dict, command: dict, commands: queue.Queue) -> None:
    import torch

    import swarmtrain
    from swarmtrain.optim.diloco import DiLoCoOptimizer

    torch.set_num_threads(1)
    mode, index, peers = options["mode"], options["index"], options["peers"]
    (points, labels), eval_set = make_data()
    shard = torch.arange(index, len(points), peers)
    points, labels = points[shard], labels[shard]
    model = make_model()
    batch = 16
    if mode == "diloco":
        outer = None  # DiLoCo's own (SGD, lr 0.7, Nesterov momentum 0.9) unless told
        if "outer_lr" in command or "outer_momentum" in command:
            momentum = command.get("outer_momentum", 0.9)
            outer = functools.partial(
                torch.optim.SGD,
                lr=command.get("outer_lr", 0.7),
                momentum=momentum,
                nesterov=momentum > 0,
            )
        opt = DiLoCoOptimizer(
            model.parameters(),
            dht=dht,
            run_id=command["run_id"],
            inner_optimizer=lambda params: torch.optim.Adam(params, lr=0.003),
            inner_steps=command.get("inner_steps", 50),
            outer_optimizer=outer,
            batch_size_per_step=batch,
            matchmaking_time=command.get("matchmaking_time", 5.0),
            averaging_timeout=command.get("averaging_timeout", 60.0),
            min_group_size=2,
        )
    else:
        opt = swarmtrain.Optimizer(
            dht=dht,
            run_id=command["run_id"],
            target_batch_size=command.get("target_batch_size", 512),
            batch_size_per_step=batch,
            optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
            params=model.parameters(),
            matchmaking_time=command.get("matchmaking_time", 5.0),
            averaging_timeout=command.get("averaging_timeout", 60.0),
            load_state_timeout=60.0,
        )
    if command.get("freeze_startup_objects"):  # cheaper full collections (README)
        swarmtrain.utils.freeze_startup_objects()
    try:
        loss_before, _ = evaluate(model, eval_set)
        if command.get("join"):  # a newcomer: take the swarm's state first
            say({"joined": opt.load_state_from_peers(), **progress(opt, mode)})
        elif command.get("start_barrier", 60) <= 0:
            pass  # no barrier: each peer trains as soon as it is ready
        elif mode != "diloco":
            opt.wait_for_peers(peers, timeout=command.get("start_barrier", 60))
        else:  # the same start barrier: a peer that starts rounds late only loads the state
            until = time.monotonic() + command.get("start_barrier", 60)
            while len(opt.presence.others()) < peers - 1 and time.monotonic() < until:
                time.sleep(0.2)
        if command.get("say_started"):
            say({"started": True, **progress(opt, mode)})
        generator = torch.Generator().manual_seed(1000 + index)
        started = time.monotonic()
        finish_at = None
        announced = False
        while finish_at is None or progress(opt, mode)["epoch"] < finish_at:
            rows = torch.randint(0, len(points), (batch,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(points[rows]), labels[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if not announced and time.monotonic() - started >= command["seconds"]:
                say({"trained": time.monotonic() - started, **progress(opt, mode)})
                announced = True
            while True:
                try:
                    message = commands.get_nowait()
                except queue.Empty:
                    break
                if message["op"] == "status":
                    say(status(model, eval_set, opt, mode))
                elif message["op"] == "paths":
                    say({"paths": connection_paths(dht)})
                elif message["op"] == "finish":
                    finish_at = message["epoch"]
                elif message["op"] == "quit":
                    return
        loss_after, accuracy = evaluate(model, eval_set)
        say(
            {
                "done": time.monotonic() - started,
                **progress(opt, mode),
                "eval_loss_before": loss_before,
                "eval_loss_after": loss_after,
                "accuracy": accuracy,
                "params": flat_parameters(model),
                "paths": connection_paths(dht),
            }
        )
        # stay until told to quit: peers that are behind may still average with us
        while (message := commands.get())["op"] != "quit":
            if message["op"] == "sync":
                say(final_sync(opt, mode, model, message))
            elif message["op"] == "status":
                say(status(model, eval_set, opt, mode))
            elif message["op"] == "paths":
                say({"paths": connection_paths(dht)})
    finally:
        opt.shutdown()


def main(options: dict) -> None:
    import swarmtrain

    if options.get("log"):  # logger names to show on stderr (or in ``log_dir``/peer<index>.log)
        if options.get("log_dir"):  # wall-clock stamps: comparable between peers
            path = os.path.join(options["log_dir"], f"peer{options.get('index', 0)}.log")
            handler = logging.FileHandler(path)
            handler.setFormatter(logging.Formatter("%(created).3f %(name)s %(message)s"))
        else:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(relativeCreated)8.0f %(name)s %(message)s"))
        for name in options["log"]:
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(options.get("log_level", "DEBUG"))

    ROUNDS.install()
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=read_commands, args=(commands,), daemon=True).start()
    dht = swarmtrain.DHT(**options.get("dht", {}))
    try:

        def info() -> dict:
            return {"peer_id": str(dht.peer_id), "maddrs": dht.get_visible_maddrs()}

        say({"ready": True, **info()})
        while True:
            command = commands.get()
            if command["op"] == "quit":
                return
            if command["op"] == "wait_circuit":
                deadline = time.monotonic() + command.get("timeout", 60)
                while not any("/p2p-circuit" in a for a in dht.get_visible_maddrs()):
                    if time.monotonic() > deadline:
                        say({"error": "no circuit address"})
                        break
                    time.sleep(0.05)
                else:
                    say(info())
            elif command["op"] == "train":
                train(dht, options, command, commands)
                return
            else:
                say({"error": f"unknown op {command['op']!r}"})
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
