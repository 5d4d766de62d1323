"""Quickstart: peers train one classifier together with swarmtrain.Optimizer.

All peers on this machine, as threads of one process:

    python examples/quickstart/train.py [--peers 3] [--epochs 8]

One peer per process (on one machine or several). Start the first peer; it prints the
addresses to join it with:

    python examples/quickstart/train.py --first_peer --host_maddrs /ip4/0.0.0.0/tcp/31337

then start each other peer with one of them (a late joiner loads the swarm's state first):

    python examples/quickstart/train.py --initial_peers /ip4/<IP>/tcp/31337/p2p/12D3KooW...

Each peer has its own DHT node, its own shard of a generated 10-class dataset (no download)
and its own copy of a small MLP. ``swarmtrain.Optimizer`` accumulates gradients until the
peers together reach ``--target_batch_size`` samples, averages them, and steps; each peer
prints its eval loss and accuracy per epoch. In the one-process-per-peer mode, peers wait up to
60 s for ``--peers`` peers before training.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

import swarmtrain

FEATURES, CLASSES = 32, 10
TRAIN_SAMPLES, EVAL_SAMPLES = 5000, 1000


def make_data(num_samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A 10-class problem: noisy points around random class centres (no download needed)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 2
    labels = torch.randint(0, CLASSES, (num_samples,), generator=generator)
    points = centres[labels] + torch.randn(num_samples, FEATURES, generator=generator)
    return points, labels


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights on every peer (or call load_state_from_peers)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)
    )


def host_options(args) -> dict:
    """DHT keywords: a one-machine swarm needs no relays nor NAT checks."""
    options = {"host_maddrs": args.host_maddrs, "announce_maddrs": args.announce_maddrs}
    if args.initial_peers is None and not args.first_peer:
        options.update(use_relay=False, relay_service=False, use_autonat=False)
    return options


def run_peer(index, dht, shard, eval_set, args, report, start_barrier=None, join=False):
    model = make_model()
    opt = swarmtrain.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        params=model.parameters(),
        matchmaking_time=1.0,
        averaging_timeout=15.0,
        # state rounds in the foreground, so the peers hold exactly the same weights after
        # every epoch (a background round, hivemind's default, snapshots each peer whenever
        # its worker gets to it: faster, but peers then agree only approximately)
        delay_state_averaging=False,
        verbose=args.verbose,
    )
    points, labels = shard
    generator = torch.Generator().manual_seed(index)
    try:
        seen = opt.wait_for_peers(args.peers, timeout=30.0 if start_barrier else 60.0)
        if join and opt.global_epoch > opt.local_epoch:
            opt.load_state_from_peers()  # a late joiner: the swarm's weights and epoch
            print(f"peer {index}: loaded the swarm's state at epoch {opt.local_epoch}")
        elif start_barrier is None:
            print(f"peer {index}: {seen} peer(s) in the swarm, training")
        if start_barrier is not None:
            start_barrier.wait()
        while opt.local_epoch < args.epochs:
            rows = torch.randint(0, len(points), (args.batch_size,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(points[rows]), labels[rows])
            loss.backward()
            epoch = opt.local_epoch
            opt.step()
            opt.zero_grad()
            if opt.local_epoch != epoch:
                with torch.no_grad():
                    logits = model(eval_set[0])
                    eval_loss = torch.nn.functional.cross_entropy(logits, eval_set[1]).item()
                    accuracy = (logits.argmax(1) == eval_set[1]).float().mean().item()
                report(index, opt.local_epoch, eval_loss, accuracy)
    finally:
        opt.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--peers",
        type=int,
        default=3,
        help="threads mode: peers to start; one peer per process: peers to wait for (default 3)",
    )
    parser.add_argument("--epochs", type=int, default=8, help="epochs to train (default 8)")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=16)
    parser.add_argument("--target_batch_size", "--target-batch-size", type=int, default=256)
    parser.add_argument("--run_id", "--run-id", default="quickstart")
    peer = parser.add_argument_group("one peer per process")
    peer.add_argument(
        "--first_peer",
        "--first-peer",
        action="store_true",
        help="run one peer that starts a swarm and prints the addresses to join it with",
    )
    peer.add_argument(
        "--initial_peers",
        "--initial-peers",
        nargs="+",
        default=None,
        help="run one peer that joins the swarm of these multiaddrs",
    )
    peer.add_argument(
        "--host_maddrs",
        "--host-maddrs",
        nargs="+",
        default=["/ip4/127.0.0.1/tcp/0"],
        help="where this peer listens (for other machines: /ip4/0.0.0.0/tcp/31337)",
    )
    peer.add_argument("--announce_maddrs", "--announce-maddrs", nargs="*", default=[])
    parser.add_argument("--verbose", action="store_true", help="log epochs, rounds and peers")
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.first_peer and args.initial_peers:
        parser.error("--first_peer starts a swarm: it takes no --initial_peers")
    if args.peers < 1:
        parser.error("--peers must be at least 1")
    points, labels = make_data(TRAIN_SAMPLES + EVAL_SAMPLES)
    eval_set = (points[TRAIN_SAMPLES:], labels[TRAIN_SAMPLES:])
    if args.first_peer or args.initial_peers is not None:
        train_set = (points[:TRAIN_SAMPLES], labels[:TRAIN_SAMPLES])
        return run_one_process_peer(args, train_set, eval_set)
    return run_threads(args, points, labels, eval_set)


def printing_report(results: dict, lock: threading.Lock):
    def report(index, epoch, eval_loss, accuracy):
        with lock:
            results.setdefault(index, []).append((epoch, eval_loss, accuracy))
            print(
                f"peer {index}: epoch {epoch}  eval loss {eval_loss:.3f}  accuracy {accuracy:.1%}",
                flush=True,
            )

    return report


def run_one_process_peer(args, train_set, eval_set) -> dict:
    """One peer in this process: the first of a swarm, or one joining ``--initial_peers``."""
    dht = swarmtrain.DHT(initial_peers=args.initial_peers or [], **host_options(args))
    try:
        print("join this swarm with:", flush=True)
        print(
            "  python examples/quickstart/train.py --initial_peers "
            + " ".join(dht.get_visible_maddrs()),
            flush=True,
        )
        index = os.getpid()  # names this peer; each process samples its own batches
        results: dict[int, list[tuple[int, float, float]]] = {}
        report = printing_report(results, threading.Lock())
        run_peer(index, dht, train_set, eval_set, args, report, join=bool(args.initial_peers))
        final = results.get(index, [(0, float("nan"), float("nan"))])[-1]
        print(f"done: epoch {final[0]}, accuracy {final[2]:.1%}", flush=True)
        return results
    finally:
        dht.shutdown()


def run_threads(args, points, labels, eval_set) -> dict:
    """``--peers`` peers, one thread each, in this process."""
    shards = [
        (points[i : TRAIN_SAMPLES : args.peers], labels[i : TRAIN_SAMPLES : args.peers])
        for i in range(args.peers)
    ]
    dhts = [swarmtrain.DHT(**host_options(args))]
    for _ in range(args.peers - 1):
        dhts.append(swarmtrain.DHT(dhts[0].get_visible_maddrs(), **host_options(args)))
    print(f"{args.peers} peers; join this swarm with initial_peers={dhts[0].get_visible_maddrs()}")

    results: dict[int, list[tuple[int, float, float]]] = {i: [] for i in range(args.peers)}
    report = printing_report(results, threading.Lock())
    barrier = threading.Barrier(args.peers)
    started = time.perf_counter()
    threads = [
        threading.Thread(
            target=run_peer, args=(i, dhts[i], shards[i], eval_set, args, report, barrier)
        )
        for i in range(args.peers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for dht in reversed(dhts):
        dht.shutdown()
    final = [results[i][-1] for i in range(args.peers) if results[i]]
    print(
        f"done in {time.perf_counter() - started:.1f} s: "
        + ", ".join(f"peer {i} accuracy {acc:.1%}" for i, (_, _, acc) in enumerate(final))
    )
    return results


if __name__ == "__main__":
    main()
