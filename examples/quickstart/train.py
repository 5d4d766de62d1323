"""Quickstart: three peers on this machine train one classifier together with swarmtrain.

    python examples/quickstart/train.py [--peers 3] [--epochs 8]

Each peer is a thread with its own DHT node, its own shard of a generated 10-class dataset and
its own copy of a small MLP. ``swarmtrain.Optimizer`` accumulates gradients until the peers
together reach ``target_batch_size`` samples, averages them across peers, and steps; every peer
prints its loss and accuracy per epoch. On separate machines, start one peer, pass its
``get_visible_maddrs()`` as ``initial_peers`` to the others, and bind ``host_maddrs`` to a
public address (see the README).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import swarmtrain

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}  # one machine
FEATURES, CLASSES = 32, 10


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


def run_peer(index, dht, shard, eval_set, args, report, start_barrier):
    model = make_model()
    opt = swarmtrain.Optimizer(
        dht=dht,
        run_id="quickstart",
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
    )
    points, labels = shard
    generator = torch.Generator().manual_seed(index)
    opt.wait_for_peers(args.peers, timeout=30.0)  # no one starts alone
    start_barrier.wait()
    try:
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--target_batch_size", type=int, default=256)
    args = parser.parse_args(argv)

    points, labels = make_data(6000)
    eval_set = (points[5000:], labels[5000:])
    shards = [
        (points[i : 5000 : args.peers], labels[i : 5000 : args.peers]) for i in range(args.peers)
    ]
    dhts = [swarmtrain.DHT(**HOST)]
    for _ in range(args.peers - 1):
        dhts.append(swarmtrain.DHT(dhts[0].get_visible_maddrs(), **HOST))
    print(f"{args.peers} peers; join this swarm with initial_peers={dhts[0].get_visible_maddrs()}")

    results: dict[int, list[tuple[int, float, float]]] = {i: [] for i in range(args.peers)}
    lock = threading.Lock()

    def report(index, epoch, eval_loss, accuracy):
        with lock:
            results[index].append((epoch, eval_loss, accuracy))
            print(
                f"peer {index}: epoch {epoch}  eval loss {eval_loss:.3f}  accuracy {accuracy:.1%}"
            )

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
