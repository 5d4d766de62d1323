"""DiLoCo over the network (issue 7): correctness, quality and compute utilization.

    python benchmarks/benchmark_diloco.py --part correctness|quality|utilization|all

1. ``correctness``: 4 networked peers (threads of this process, each with its own DHT node,
   libp2p host and ``DiLoCoOptimizer``, talking over loopback TCP) train the byte-level
   transformer of ``swarmtrain.optim.diloco_simulation`` on the Python standard library's
   text; :func:`reference` does the same run (same initial parameters, data shards, sampler
   seeds, H, fragments and delay) in a few dozen lines of plain torch, averaging in fp32 in
   one process. The final eval losses must agree within 0.5% (the peers send fp16
   pseudo-gradients). Plain DiLoCo and streaming (several fragments, delayed) are both run.
2. ``quality``: ``benchmarks/_diloco_quality.py`` (DiLoCo against a tuned synchronous
   baseline); with ``--part quality`` every other argument is its own (``--part quality
   --help`` lists them), ``--part all`` runs it with its defaults.
3. ``utilization``: 4 peers, one process each, each in its own network namespace whose veth
   link to a bridge is limited to ``--mbit`` Mbit/s in both directions by ``tc qdisc tbf``
   (needs root; the namespaces, named ``dlc<pid>_*``, are deleted afterwards). Each peer
   reports the fraction of its wall time spent computing (forward, backward, gradient
   clipping and the inner optimizer step), from the moment all peers start training to the
   moment its last outer update is applied. Plain (one fragment, blocking sync) against
   streaming (several fragments, each all-reduce overlapped with ``delay`` inner steps);
   medians over ``--repeats`` runs, alternating the modes. Defaults: 867K parameters
   (1.7 MB in fp16), H=20, 4 outer steps, streaming F=2 and tau=8: a full sync moves 2.6 MB
   per peer (0.2 s at 100 Mbit/s) plus matchmaking latency, against H steps of compute.

Both networked parts wait up to ``--matchmaking-time`` (30 s) for the slowest peer in every
round (a full group starts at once), so that a loaded machine does not split the peers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch import nn

from swarmtrain.dht import DHT
from swarmtrain.optim._textdata import BatchSampler, stdlib_text
from swarmtrain.optim.diloco import DiLoCoOptimizer
from swarmtrain.optim.diloco_core import Fragments
from swarmtrain.optim.diloco_simulation import (
    TinyTransformer,
    TinyTransformerConfig,
    _loss,
    evaluate,
)

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
INNER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
CLIP = 1.0


def build_model(args) -> nn.Module:
    """The run's initial model, the same in every process (seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        config = TinyTransformerConfig(
            context=args.context, d_model=args.d_model, n_layers=args.layers
        )
        return TinyTransformer(config)


def sampler_for(args, data, index: int) -> BatchSampler:
    shard = data.shards(args.peers)[index]
    return BatchSampler(shard, args.context, args.batch_size, seed=args.seed * 1000 + index)


# --------------------------------------------------------------------------- part 1


def reference(args, data, fragments: int, delay: int) -> float:
    """Single-process DiLoCo in plain torch; the final eval loss of the shared parameters."""
    shared_model = build_model(args)
    workers = [copy.deepcopy(shared_model) for _ in range(args.peers)]
    inner = [torch.optim.AdamW(w.parameters(), **INNER) for w in workers]
    samplers = [sampler_for(args, data, i) for i in range(args.peers)]
    shared = [p.detach().clone() for p in shared_model.parameters()]
    outer = torch.optim.SGD(shared, **OUTER)
    groups = Fragments.for_parameters(shared, fragments).groups  # the peers' split
    stride, steps = args.inner_steps // fragments, args.inner_steps * args.outer_steps
    pending: dict[int, tuple[int, list[torch.Tensor]]] = {}  # fragment: (apply step, mean)

    def apply(f: int) -> None:
        _, mean = pending.pop(f)
        for p in shared:
            p.grad = None
        for i, g in zip(groups[f], mean, strict=True):
            shared[i].grad = g
        outer.step()
        for w in workers:
            params = list(w.parameters())
            with torch.no_grad():
                for i in groups[f]:
                    params[i].copy_(shared[i])

    for step in range(1, steps + 1):
        for model, opt, sampler in zip(workers, inner, samplers, strict=True):
            opt.zero_grad()
            _loss(model, sampler.next()).backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        if step % stride == 0:  # fragment f syncs after steps (f + 1) * stride + k * H
            f = (step // stride - 1) % fragments
            with torch.no_grad():
                per_worker = [
                    [shared[i] - list(w.parameters())[i] for i in groups[f]] for w in workers
                ]
                mean = [torch.stack(t).mean(dim=0) for t in zip(*per_worker, strict=True)]
            pending[f] = (step + delay, mean)
        for f in [f for f, (at, _) in pending.items() if at == step]:
            apply(f)
    for f in sorted(pending):  # still in flight at the end
        apply(f)
    with torch.no_grad():
        for p, s in zip(shared_model.parameters(), shared, strict=True):
            p.copy_(s)
    return evaluate(shared_model, data.eval_windows(args.context, args.eval_windows))


def networked(args, data, fragments: int, delay: int) -> dict:
    """4 peers in threads over real DHTs on loopback; per-peer eval losses and statistics."""
    initial = build_model(args)
    windows = data.eval_windows(args.context, args.eval_windows)
    dhts = [DHT(**HOST)]
    dhts += [DHT(dhts[0].get_visible_maddrs(), **HOST) for _ in range(args.peers - 1)]
    results: list[dict | None] = [None] * args.peers
    errors: list[BaseException] = []

    def peer(index: int) -> None:
        model = copy.deepcopy(initial)
        sampler = sampler_for(args, data, index)
        opt = DiLoCoOptimizer(
            model.parameters(),
            dht=dhts[index],
            run_id=f"correct{fragments}",
            inner_optimizer=lambda params: torch.optim.AdamW(params, **INNER),
            inner_steps=args.inner_steps,
            num_fragments=fragments,
            delay=delay,
            batch_size_per_step=args.batch_size,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=2 * args.matchmaking_time,
            target_group_size=args.peers,
            min_group_size=2,
        )
        try:
            for _ in range(args.inner_steps * args.outer_steps):
                opt.zero_grad()
                _loss(model, sampler.next()).backward()
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
            opt.wait_for_pending_rounds()
            final = copy.deepcopy(initial)
            with torch.no_grad():
                for p, s in zip(final.parameters(), opt.shared_parameters(), strict=True):
                    p.copy_(s)
            results[index] = {"eval": evaluate(final, windows), "stats": opt.statistics()}
        except BaseException as e:
            errors.append(e)
        finally:
            opt.shutdown()

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(args.peers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
    if errors:
        raise errors[0]
    return {"peers": results}


def part_correctness(args) -> bool:
    torch.set_num_threads(1)
    data = stdlib_text(args.max_bytes)
    numel = sum(p.numel() for p in build_model(args).parameters())
    print(
        f"\n### Correctness: {args.peers} networked peers vs a single-process reference\n\n"
        f"{numel:,} parameters, H={args.inner_steps}, {args.outer_steps} outer steps, "
        f"batch {args.batch_size}x{args.context}, fp16 pseudo-gradients on the network, fp32 "
        f"in the reference; peers are threads of one process, each with its own DHT/host.\n"
    )
    print(
        "| mode | reference eval loss | peers' eval loss (min-max) | max rel. diff | "
        "rounds averaged / alone | MB sent per peer (as sender + as reducer) | seconds | pass |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    stride = args.inner_steps // args.fragments
    for name, fragments, delay in (
        ("plain (F=1, tau=0)", 1, 0),
        (
            f"streaming (F={args.fragments}, tau={max(1, stride // 2)})",
            args.fragments,
            max(1, stride // 2),
        ),
    ):
        want = reference(args, data, fragments, delay)
        started = time.perf_counter()
        got = networked(args, data, fragments, delay)["peers"]
        seconds = time.perf_counter() - started
        losses = [r["eval"] for r in got]
        diff = max(abs(x / want - 1) for x in losses)
        stats = [r["stats"] for r in got]
        passed = diff <= 0.005 and all(s.rounds_alone == 0 for s in stats)
        ok &= passed
        print(
            f"| {name} | {want:.4f} | {min(losses):.4f}-{max(losses):.4f} | {diff:.3%} | "
            f"{min(s.rounds_averaged for s in stats)} / {max(s.rounds_alone for s in stats)} | "
            f"{statistics.mean(s.bytes_sent for s in stats) / 1e6:.2f} "
            f"({statistics.mean(s.bytes_sent_as_sender for s in stats) / 1e6:.2f} + "
            f"{statistics.mean(s.bytes_sent_as_reducer for s in stats) / 1e6:.2f}) | "
            f"{seconds:.0f} | {'yes' if passed else 'NO'} |",
            flush=True,
        )
    return ok


# --------------------------------------------------------------------------- part 3


def utilization_worker(args) -> None:
    """One peer in its namespace: wait for ``go``, train, print one JSON line."""
    torch.set_num_threads(1)
    data = stdlib_text(args.max_bytes)
    model = build_model(args)
    sampler = sampler_for(args, data, args.index)
    host = [f"/ip4/{args.address}/tcp/0"]
    if args.index == 0:
        dht = DHT(host_maddrs=host, **HOST)
        with open(os.path.join(args.tmpdir, "maddrs.tmp"), "w") as f:
            json.dump(dht.get_visible_maddrs(), f)
        os.replace(os.path.join(args.tmpdir, "maddrs.tmp"), os.path.join(args.tmpdir, "maddrs"))
    else:
        path = os.path.join(args.tmpdir, "maddrs")
        while not os.path.exists(path):
            time.sleep(0.05)
        with open(path) as f:
            dht = DHT(json.load(f), host_maddrs=host, **HOST)
    streaming = args.mode == "streaming"
    opt = DiLoCoOptimizer(
        model.parameters(),
        dht=dht,
        run_id="util",
        inner_optimizer=lambda params: torch.optim.AdamW(params, **INNER),
        inner_steps=args.inner_steps,
        num_fragments=args.fragments if streaming else 1,
        delay=args.delay if streaming else 0,
        batch_size_per_step=args.batch_size,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=2 * args.matchmaking_time,
        target_group_size=args.peers,
        min_group_size=2,
    )
    compute = 0.0
    inner_started = 0.0

    def pre(*_):
        nonlocal inner_started
        inner_started = time.perf_counter()

    def post(*_):
        nonlocal compute
        compute += time.perf_counter() - inner_started

    opt.inner_optimizer.register_step_pre_hook(pre)
    opt.inner_optimizer.register_step_post_hook(post)
    open(os.path.join(args.tmpdir, f"ready{args.index}"), "w").close()
    while not os.path.exists(os.path.join(args.tmpdir, "go")):
        time.sleep(0.01)
    try:
        started = time.perf_counter()
        for _ in range(args.inner_steps * args.outer_steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            _loss(model, sampler.next()).backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            compute += time.perf_counter() - t0
            opt.step()
        opt.wait_for_pending_rounds()
        wall = time.perf_counter() - started
        stats = opt.statistics()
    finally:
        opt.shutdown()
        dht.shutdown()
    print(
        json.dumps(
            {
                "compute": compute,
                "wall": wall,
                "waiting": stats.seconds_waiting,
                "bytes": stats.bytes_sent,
                "alone": stats.rounds_alone,
                "averaged": stats.rounds_averaged,
            }
        ),
        flush=True,
    )


class Namespaces:
    """A bridge namespace and one namespace per peer, veth links shaped by ``tc tbf``."""

    def __init__(self, peers: int, mbit: float):
        self.tag = f"dlc{os.getpid() % 100000}"
        self.bridge = f"{self.tag}_br"
        self.peers = [f"{self.tag}_p{i}" for i in range(peers)]
        self.addresses = [f"10.213.{os.getpid() % 200}.{i + 1}" for i in range(peers)]
        self.mbit = mbit

    def __enter__(self) -> Namespaces:
        try:
            self._run("ip", "netns", "add", self.bridge)
            self._in(self.bridge, "ip", "link", "add", "br0", "type", "bridge")
            self._in(self.bridge, "ip", "link", "set", "br0", "up")
            shape = ["root", "tbf", "rate", f"{self.mbit}mbit", "burst", "64kb", "latency", "50ms"]
            for i, (ns, address) in enumerate(zip(self.peers, self.addresses, strict=True)):
                inside, outside = f"{self.tag}v{i}", f"{self.tag}b{i}"
                self._run("ip", "netns", "add", ns)
                self._run(
                    "ip",
                    "link",
                    "add",
                    inside,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    outside,
                    "netns",
                    self.bridge,
                )
                self._in(ns, "ip", "link", "set", "lo", "up")
                self._in(ns, "ip", "addr", "add", f"{address}/24", "dev", inside)
                self._in(ns, "ip", "link", "set", inside, "up")
                self._in(ns, "tc", "qdisc", "add", "dev", inside, *shape)  # upload
                self._in(self.bridge, "ip", "link", "set", outside, "master", "br0")
                self._in(self.bridge, "ip", "link", "set", outside, "up")
                self._in(self.bridge, "tc", "qdisc", "add", "dev", outside, *shape)  # download
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for ns in [*self.peers, self.bridge]:  # deleting a namespace deletes its links
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    @staticmethod
    def _run(*command: str) -> None:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")

    def _in(self, ns: str, *command: str) -> None:
        self._run("ip", "netns", "exec", ns, *command)


def run_utilization(args, net: Namespaces, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmpdir:
        common = [
            sys.executable,
            os.path.abspath(__file__),
            "--utilization-worker",
            mode,
            "--tmpdir",
            tmpdir,
        ]
        for name in (
            "peers",
            "inner_steps",
            "outer_steps",
            "fragments",
            "delay",
            "batch_size",
            "context",
            "d_model",
            "layers",
            "matchmaking_time",
            "seed",
            "max_bytes",
        ):
            common += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        procs = []
        try:
            for i, (ns, address) in enumerate(zip(net.peers, net.addresses, strict=True)):
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns,
                            *common,
                            "--index",
                            str(i),
                            "--address",
                            address,
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            deadline = time.monotonic() + 120
            while not all(
                os.path.exists(os.path.join(tmpdir, f"ready{i}")) for i in range(args.peers)
            ):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("a utilization peer did not start")
                time.sleep(0.05)
            open(os.path.join(tmpdir, "go"), "w").close()
            outputs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a utilization peer failed: {[p.returncode for p in procs]}")
        return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def part_utilization(args) -> dict:
    numel = sum(p.numel() for p in build_model(args).parameters())
    print(
        f"\n### Utilization: {args.peers} peers (one process each) behind {args.mbit:g} Mbit/s "
        f"links (tc tbf in network namespaces)\n\n"
        f"{numel:,} parameters ({2 * numel / 1e6:.2f} MB in fp16), batch "
        f"{args.batch_size}x{args.context}, H={args.inner_steps}, {args.outer_steps} outer "
        f"steps; streaming: F={args.fragments}, tau={args.delay}; {args.repeats} runs per mode, "
        f"modes alternating.\n",
        flush=True,
    )
    per_mode: dict[str, list[dict]] = {"plain": [], "streaming": []}
    with Namespaces(args.peers, args.mbit) as net:
        for _ in range(args.repeats):
            for mode in per_mode:
                runs = run_utilization(args, net, mode)
                per_mode[mode].append(
                    {
                        "util": statistics.median(r["compute"] / r["wall"] for r in runs),
                        "wall": statistics.median(r["wall"] for r in runs),
                        "waiting": statistics.median(r["waiting"] for r in runs),
                        "bytes": statistics.median(r["bytes"] for r in runs),
                        "alone": max(r["alone"] for r in runs),
                    }
                )
                last = per_mode[mode][-1]
                print(
                    f"  {mode}: utilization {last['util']:.1%}, wall {last['wall']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        "| mode | compute utilization (median; runs) | wall s | waiting for sync s | "
        "MB sent per peer | rounds alone |"
    )
    print("|---|---|---|---|---|---|")
    for mode, runs in per_mode.items():
        utils = ", ".join(f"{r['util']:.1%}" for r in runs)
        print(
            f"| {mode} | {statistics.median(r['util'] for r in runs):.1%} ({utils}) | "
            f"{statistics.median(r['wall'] for r in runs):.1f} | "
            f"{statistics.median(r['waiting'] for r in runs):.2f} | "
            f"{statistics.median(r['bytes'] for r in runs) / 1e6:.2f} | "
            f"{max(r['alone'] for r in runs)} |"
        )
    return per_mode


# --------------------------------------------------------------------------- CLI


def part_quality(argv: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import _diloco_quality
    except ImportError as e:
        print(f"--part quality needs benchmarks/_diloco_quality.py, which is missing ({e})")
        return
    _diloco_quality.main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # SIGTERM: unwind, so that the namespaces and worker processes are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--part", choices=["correctness", "quality", "utilization", "all"])
    known, rest = first.parse_known_args(argv)
    if known.part == "quality":  # every other argument is the quality study's
        return part_quality(rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--part", choices=["correctness", "quality", "utilization", "all"], default="all"
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, help="H (default 20)")
    parser.add_argument("--outer-steps", type=int, help="default 6; utilization 4")
    parser.add_argument("--fragments", type=int, help="F for streaming (default 4; utilization 2)")
    parser.add_argument("--delay", type=int, help="tau for streaming utilization (default H/F-2)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, help="default 64; utilization 128")
    parser.add_argument("--layers", type=int, help="default 2; utilization 4")
    parser.add_argument(
        "--matchmaking-time",
        type=float,
        default=30.0,
        help="how long a round waits for the slowest peer (a full group starts at once)",
    )
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--utilization-worker", choices=["plain", "streaming"], dest="mode", help=argparse.SUPPRESS
    )
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--tmpdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode is not None:
        return utilization_worker(args)

    def with_defaults(**defaults) -> argparse.Namespace:
        filled = copy.copy(args)
        for key, value in defaults.items():
            if getattr(filled, key) is None:
                setattr(filled, key, value)
        if filled.inner_steps % filled.fragments:
            parser.error(f"--fragments ({filled.fragments}) must divide H ({filled.inner_steps})")
        return filled

    ok = True
    if args.part in ("correctness", "all"):
        ok &= part_correctness(
            with_defaults(inner_steps=20, outer_steps=6, d_model=64, layers=2, fragments=4)
        )
    if args.part == "all":
        part_quality([])
    if args.part in ("utilization", "all"):
        if os.geteuid() != 0:
            sys.exit("--part utilization needs root (network namespaces and tc)")
        util = with_defaults(inner_steps=20, outer_steps=4, d_model=128, layers=4, fragments=2)
        if util.delay is None:
            util.delay = max(1, util.inner_steps // util.fragments - 2)
        part_utilization(util)
    if not ok:
        sys.exit("correctness: the peers did not reproduce the reference within 0.5%")


if __name__ == "__main__":
    main()
