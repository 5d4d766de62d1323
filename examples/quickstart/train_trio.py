"""Quickstart for a trio trainer: peers train one classifier with ``Optimizer.create``.

All peers are tasks of one trio run in this process (no background thread)::

    python examples/quickstart/train_trio.py [--peers 3] [--epochs 8]

The same data, model and settings as ``train.py``; each peer is ``async with DHT.create(...)``,
``async with Optimizer.create(...)`` and a loop that ``await``s ``opt.step()``, so the peers'
networking and their training share the trio loop: the optimizer's tensor work runs in worker
threads (``trio.to_thread``) and never holds the loop.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import trio

from swarmtrain import DHT, Optimizer

FEATURES, CLASSES = 32, 10
TRAIN_SAMPLES, EVAL_SAMPLES = 5000, 1000
LOCAL_HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


def make_data(num_samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A 10-class problem: noisy points around random class centres (no download needed)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 2
    labels = torch.randint(0, CLASSES, (num_samples,), generator=generator)
    points = centres[labels] + torch.randn(num_samples, FEATURES, generator=generator)
    return points, labels


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights on every peer (or load_state_from_peers)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)
    )


async def run_peer(index, dht, shard, eval_set, args, results) -> None:
    model = make_model()
    async with Optimizer.create(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        params=model.parameters(),
        matchmaking_time=1.0,
        averaging_timeout=15.0,
        delay_state_averaging=False,  # the peers hold exactly the same weights after each epoch
    ) as opt:
        await opt.wait_for_peers(args.peers, timeout=30.0)
        points, labels = shard
        generator = torch.Generator().manual_seed(index)
        while opt.local_epoch < args.epochs:
            rows = torch.randint(0, len(points), (args.batch_size,), generator=generator)
            torch.nn.functional.cross_entropy(model(points[rows]), labels[rows]).backward()
            epoch = opt.local_epoch
            await opt.step()
            opt.zero_grad()
            if opt.local_epoch != epoch:
                with torch.no_grad():
                    logits = model(eval_set[0])
                    loss = torch.nn.functional.cross_entropy(logits, eval_set[1]).item()
                    accuracy = (logits.argmax(1) == eval_set[1]).float().mean().item()
                results[index].append((opt.local_epoch, loss, accuracy))
                print(
                    f"peer {index}: epoch {opt.local_epoch}  eval loss {loss:.3f}  "
                    f"accuracy {accuracy:.1%}",
                    flush=True,
                )


async def train(args) -> dict:
    points, labels = make_data(TRAIN_SAMPLES + EVAL_SAMPLES)
    eval_set = (points[TRAIN_SAMPLES:], labels[TRAIN_SAMPLES:])
    shards = [
        (points[i : TRAIN_SAMPLES : args.peers], labels[i : TRAIN_SAMPLES : args.peers])
        for i in range(args.peers)
    ]
    results: dict[int, list[tuple[int, float, float]]] = {i: [] for i in range(args.peers)}
    async with contextlib.AsyncExitStack() as stack:
        dhts = [await stack.enter_async_context(DHT.create(**LOCAL_HOST))]
        for _ in range(args.peers - 1):
            first = dhts[0].get_visible_maddrs()
            dhts.append(await stack.enter_async_context(DHT.create(first, **LOCAL_HOST)))
        async with trio.open_nursery() as nursery:
            for i in range(args.peers):
                nursery.start_soon(run_peer, i, dhts[i], shards[i], eval_set, args, results)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch_size", "--batch-size", type=int, default=16)
    parser.add_argument("--target_batch_size", "--target-batch-size", type=int, default=256)
    parser.add_argument("--run_id", "--run-id", default="quickstart_trio")
    args = parser.parse_args(argv)
    if args.peers < 1:
        parser.error("--peers must be at least 1")
    started = time.perf_counter()
    results = trio.run(train, args)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
