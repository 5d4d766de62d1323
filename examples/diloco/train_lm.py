"""Four local peers train a tiny byte-level transformer with DiLoCo over a real swarm.

Each peer is a thread with its own DHT node (on loopback), model copy, data shard and
``DiLoCoOptimizer``; they average fp16 pseudo-gradients every ``--inner_steps`` steps through
libp2p, exactly as peers on different machines would. The text is the Python standard library's
own source (no download). Run it from the repository root::

    python examples/diloco/train_lm.py                 # under a minute on 2 CPUs
    python examples/diloco/train_lm.py --peers 2 --inner_steps 20 --outer_steps 5
    python examples/diloco/train_lm.py --fragments 2 --delay 2   # streaming DiLoCo

Printed every H inner steps (by peer 0): the peers' mean training loss over the last H steps,
the eval loss of the shared parameters, the pseudo-gradient bytes peer 0 sent so far (counted
as its codec produced them, plus the averaged parts it returned as a reducer), and the compute
utilization so far: time in forward/backward over wall time, per peer (threads share the
cores and the GIL, so with 4 peers on 2 cores at most 50% each).
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.compression import Float16Compression
from swarmtrain.dht import DHT
from swarmtrain.optim.diloco import DiLoCoOptimizer
from swarmtrain.optim.diloco_simulation import (
    BatchSampler,
    TinyTransformer,
    TinyTransformerConfig,
    evaluate,
    stdlib_text,
)

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class Report:
    """What the peers share with the printing peer (guarded by a lock)."""

    def __init__(self, peers: int):
        self.lock = threading.Lock()
        self.round_losses: dict[int, list[float]] = {}
        self.compute = [0.0] * peers
        self.started = time.perf_counter()

    def add(self, outer: int, loss: float) -> None:
        with self.lock:
            self.round_losses.setdefault(outer, []).append(loss)

    def utilization(self) -> list[float]:
        wall = time.perf_counter() - self.started
        with self.lock:
            return [c / wall for c in self.compute]


def run_peer(
    index: int, dht: DHT, initial: nn.Module, args, data, report: Report, eval_windows
) -> None:
    model = copy.deepcopy(initial)  # every peer starts from the same parameters
    shard = data.shards(args.peers)[index]
    sampler = BatchSampler(shard, args.context, args.batch_size, seed=args.seed * 1000 + index)
    opt = DiLoCoOptimizer(
        model.parameters(),
        dht=dht,
        run_id="diloco_lm",
        inner_optimizer=lambda params: torch.optim.AdamW(
            params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
        ),
        inner_steps=args.inner_steps,
        num_fragments=args.fragments,  # > 1: streaming, one fragment every H / F steps
        delay=args.delay,  # each all-reduce overlaps with this many inner steps
        pseudo_grad_compression=Float16Compression(),
        batch_size_per_step=args.batch_size,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0,
        target_group_size=args.peers,  # a full group starts at once, without waiting
        min_group_size=2,
    )
    try:
        round_loss = 0.0
        for step in range(1, args.inner_steps * args.outer_steps + 1):
            started = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model, sampler.next())
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with report.lock:
                report.compute[index] += time.perf_counter() - started
            round_loss += loss.item()
            opt.step()  # starts / applies the fragments' rounds when the schedule says so
            if step % args.inner_steps:
                continue
            report.add(opt.local_epoch, round_loss / args.inner_steps)
            round_loss = 0.0
            if index == 0:
                print_round(opt, model, report, eval_windows)
        opt.wait_for_pending_rounds()  # with delay > 0, the last rounds are still in flight
    finally:
        opt.shutdown()


def print_round(opt: DiLoCoOptimizer, model: nn.Module, report: Report, eval_windows) -> None:
    stats = opt.statistics()
    shared = copy.deepcopy(model)  # the shared parameters (the model's may be mid-round)
    with torch.no_grad():
        for p, value in zip(shared.parameters(), opt.shared_parameters(), strict=True):
            p.copy_(value)
    eval_loss = evaluate(shared, eval_windows)
    time.sleep(0.05)  # let the other peers report their round loss
    with report.lock:
        losses = report.round_losses.get(opt.local_epoch, [])
        train = sum(losses) / max(1, len(losses))
    per_peer = report.utilization()
    utilization = 100 * sum(per_peer) / len(per_peer)
    print(
        f"H steps {opt.local_epoch:3d}  outer updates {stats.outer_step:3d}  train loss "
        f"{train:.3f}  eval loss {eval_loss:.3f}  group {stats.last_group_size}  sent "
        f"{stats.bytes_sent / 1e6:6.2f} MB  compute {utilization:4.1f}% per peer",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--inner_steps", "--inner-steps", type=int, default=10, help="H")
    parser.add_argument("--outer_steps", "--outer-steps", type=int, default=15)
    parser.add_argument("--batch_size", "--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d_model", "--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fragments", type=int, default=1, help="F (must divide H)")
    parser.add_argument("--delay", type=int, default=0, help="tau, in [0, H)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--matchmaking_time", "--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    if args.inner_steps % args.fragments or not 0 <= args.delay < args.inner_steps:
        parser.error("--fragments must divide --inner_steps, and 0 <= --delay < --inner_steps")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # one core per peer thread, no oversubscription

    data = stdlib_text(2_000_000)
    eval_windows = data.eval_windows(args.context, 64)
    torch.manual_seed(args.seed)  # here: torch's global generator is shared by all threads
    initial = TinyTransformer(
        TinyTransformerConfig(context=args.context, d_model=args.d_model, n_layers=args.layers)
    )
    numel = sum(p.numel() for p in initial.parameters())
    print(
        f"{args.peers} peers, {numel:,} parameters, H={args.inner_steps}, "
        f"F={args.fragments}, tau={args.delay}, {args.outer_steps} outer steps, "
        f"initial eval loss {evaluate(initial, eval_windows):.3f} "
        f"(uniform: {math.log(256):.3f})",
        flush=True,
    )

    dhts = [DHT(**HOST)]
    dhts += [DHT(dhts[0].get_visible_maddrs(), **HOST) for _ in range(args.peers - 1)]
    report = Report(args.peers)
    threads = [
        threading.Thread(target=run_peer, args=(i, dht, initial, args, data, report, eval_windows))
        for i, dht in enumerate(dhts)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
    wall = time.perf_counter() - report.started
    utilization = report.utilization()
    steps = args.inner_steps * args.outer_steps
    data_parallel = 2 * (args.peers - 1) / args.peers * 4 * numel * steps
    print(
        f"done in {wall:.1f} s; compute utilization {100 * min(utilization):.1f}-"
        f"{100 * max(utilization):.1f}% per peer, {sum(utilization):.2f} cores busy; "
        f"fp32 data parallelism would have sent {data_parallel / 1e6:.0f} MB per peer"
    )


if __name__ == "__main__":
    main()
