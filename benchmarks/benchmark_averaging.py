"""Butterfly all-reduce round time: swarmtrain vs raw TCP vs hivemind 1.1.12, one process per peer.

    python benchmarks/benchmark_averaging.py [--configs 4x16M,8x4M] [--rounds 6] [--repeats 2]
        [--impls swarmtrain,hivemind] [--hivemind-python /tmp/hm/bin/python]
    python benchmarks/benchmark_averaging.py --configs 4x16M --impls swarmtrain --profile /tmp/p

A configuration ``NxSIZE`` runs N peers, each averaging one float32 tensor of SIZE elements
(``M`` = 2**20, so ``16M`` is a 64 MiB tensor), with ``target_group_size = min_group_size = N``
and a short ``min_matchmaking_time``. Every peer is a process of its own, started by this script
(``--worker``); the parent only sends commands over stdin and reads JSON replies, so it needs
neither trio nor hivemind and runs in either venv.

- swarmtrain: each worker runs ``DHT.create`` + ``AsyncDecentralizedAverager.create`` (the trio
  forms behind the blocking ``DHT`` / ``DecentralizedAverager``) with relays and AutoNAT off.
- raw TCP: the same swarmtrain worker processes (same trio loop, between averaging rounds) move
  the bytes of a butterfly all-reduce over a full mesh of plain trio TCP sockets: each peer
  sends part j of its tensor to peer j and, once it holds every peer's part of its own slice,
  sends that slice back to every peer -- 2 (N-1)/N of the tensor out and as much in, per peer.
  No arithmetic: it is the floor for moving the bytes.
- hivemind: each worker (re-invoked with ``--hivemind-python``, ``--impl hivemind``) runs a
  ``hivemind.DHT`` (+ its Go daemon) and a ``hivemind.averaging.DecentralizedAverager`` (its own
  process), both with their defaults apart from the group and matchmaking settings.

Per round and peer two times: the whole ``step()`` (matchmaking included) and the all-reduce
part, from the group assembled to the deltas applied (swarmtrain: ``_run_allreduce``; hivemind:
``_aggregate_with_group``), and for swarmtrain the CPU seconds the peer's process (all threads)
spent in that all-reduce. A round's time is the slowest peer's; the figures are medians over
rounds, the first round of every block excluded as warm-up. Implementations run in alternating
blocks (``--repeats``), never at the same time. Every round checks that all peers hold the mean.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time

MARK = "@@bench "
PREFIX = "benchavg"


def parse_config(text: str) -> tuple[int, int]:
    peers, size = text.lower().split("x")
    scale = {"k": 1 << 10, "m": 1 << 20}.get(size[-1], 1)
    numel = int(float(size.rstrip("km")) * scale)
    return int(peers), numel


def load_text() -> str:
    try:
        load = os.getloadavg()
    except OSError:
        return "n/a"
    return "/".join(f"{x:.1f}" for x in load)


def expected_mean(num_peers: int, round_index: int) -> float:
    # Peer i starts a round with every value = i + round_index (exact in float32).
    return (num_peers - 1) / 2 + round_index


# --------------------------------------------------------------------------- swarmtrain worker


def swarmtrain_worker(args) -> None:
    import cProfile

    import torch
    import trio

    from swarmtrain.averaging import AsyncDecentralizedAverager
    from swarmtrain.dht import DHT

    index, num_peers, numel = args.index, args.num_peers, args.numel
    # CPU time, not wall time: under contention wall-clock profiles blame whatever was preempted
    profiler = cProfile.Profile(time.process_time) if args.profile and index == 0 else None
    timings: list[float] = []
    cpu: list[float] = []
    starts: list[float] = []  # wall-clock start of each all-reduce (to see how staggered)

    class TimedAverager(AsyncDecentralizedAverager):
        async def _run_allreduce(self, group, weight):
            started, cpu_started = time.perf_counter(), time.process_time()
            starts.append(time.time())
            if profiler is not None and profile_on[0]:
                profiler.enable()
            try:
                return await super()._run_allreduce(group, weight)
            finally:
                if profiler is not None and profile_on[0]:
                    profiler.disable()
                timings.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)  # all threads of the process

    profile_on = [False]
    tensor = torch.zeros(numel, dtype=torch.float32)

    async def main():
        out = trio.lowlevel.FdStream(os.dup(1))
        stdin = trio.lowlevel.FdStream(os.dup(0))

        async def reply(message):
            await out.send_all((MARK + json.dumps(message) + "\n").encode())

        async def commands():
            buffer = b""
            while data := await stdin.receive_some(65536):
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    yield json.loads(line)

        host_kwargs = dict(use_relay=False, relay_service=False, use_autonat=False)
        async with (
            DHT.create(args.initial_peers, **host_kwargs) as dht,
            TimedAverager.create(
                [tensor],
                dht,
                prefix=PREFIX,
                target_group_size=num_peers,
                min_group_size=num_peers,
                min_matchmaking_time=args.min_matchmaking_time,
                request_timeout=args.request_timeout,
                **({"part_size_bytes": args.part_size_bytes} if args.part_size_bytes else {}),
            ) as averager,
            trio.open_nursery() as nursery,
        ):
            listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
            port = listener.socket.getsockname()[1]
            mesh = RawMesh(index, num_peers, numel)
            await reply({"maddrs": dht.get_visible_maddrs(), "port": port})
            async for cmd in commands():
                op = cmd["op"]
                if op == "connect":
                    await mesh.connect(nursery, listener, cmd["ports"])
                    await reply({"ok": True})
                elif op == "tcp":
                    started = time.perf_counter()
                    await mesh.exchange()
                    await reply({"tcp_s": time.perf_counter() - started})
                elif op == "step":
                    tensor.fill_(index + cmd["round"])
                    profile_on[0] = cmd.get("profile", False)
                    timings.clear()
                    starts.clear()
                    cpu.clear()
                    started = time.perf_counter()
                    error = None
                    try:
                        await averager.step(timeout=args.step_timeout)
                    except Exception as e:  # a failed round is reported, not fatal
                        error = repr(e)
                    step_s = time.perf_counter() - started
                    want = expected_mean(num_peers, cmd["round"])
                    max_err = float((tensor - want).abs().max())
                    await reply(
                        {
                            "step_s": step_s,
                            "allreduce_s": timings[-1] if timings else None,
                            "allreduce_start": starts[-1] if starts else None,
                            "cpu_s": cpu[-1] if cpu else None,
                            "error": error,
                            "max_err": max_err,
                        }
                    )
                elif op == "exit":
                    if profiler is not None:
                        profiler.dump_stats(args.profile)
                    await reply({"ok": True})
                    break
            nursery.cancel_scope.cancel()

    trio.run(main)


class RawMesh:
    """Plain trio TCP sockets between the worker processes, one per pair, both directions."""

    CHUNK = 1 << 20

    def __init__(self, index: int, num_peers: int, numel: int):
        import numpy as np

        self.index, self.num_peers = index, num_peers
        self.data = np.arange(numel, dtype=np.float32).view(np.uint8)  # what "our tensor" sends
        nbytes = self.data.nbytes
        self.bounds = [nbytes * j // num_peers for j in range(num_peers + 1)]
        part = max(self.bounds[j + 1] - self.bounds[j] for j in range(num_peers))
        self.inbox = {j: bytearray(part) for j in range(num_peers) if j != index}
        self.streams: dict = {}

    async def connect(self, nursery, listener, ports: list[int]) -> None:
        import trio

        expected = self.index  # peers with a lower index dial us
        for j in range(self.index + 1, self.num_peers):
            stream = await trio.open_tcp_stream("127.0.0.1", ports[j])
            await stream.send_all(self.index.to_bytes(4, "big"))
            self.streams[j] = stream
        while expected:
            stream = await listener.accept()
            peer = int.from_bytes(await self._receive_exactly(stream, 4), "big")
            self.streams[peer] = stream
            expected -= 1

    @staticmethod
    async def _receive_exactly(stream, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await stream.receive_some(n - len(data))
            if not chunk:
                raise ConnectionError("peer closed")
            data += chunk
        return data

    async def _send(self, j: int, view) -> None:
        stream = self.streams[j]
        for offset in range(0, len(view), self.CHUNK):
            await stream.send_all(view[offset : offset + self.CHUNK])

    async def _receive(self, j: int, nbytes: int) -> None:
        sock = self.streams[j].socket
        view = memoryview(self.inbox[j])
        got = 0
        while got < nbytes:
            n = await sock.recv_into(view[got : min(nbytes, got + self.CHUNK)])
            if not n:
                raise ConnectionError("peer closed")
            got += n

    async def exchange(self) -> None:
        import trio

        me, b = self.index, self.bounds
        mine = b[me + 1] - b[me]
        others = [j for j in range(self.num_peers) if j != me]
        data = memoryview(self.data)
        async with trio.open_nursery() as nursery:  # reduce-scatter: part j goes to peer j
            for j in others:
                nursery.start_soon(self._send, j, data[b[j] : b[j + 1]])
                nursery.start_soon(self._receive, j, mine)
        async with trio.open_nursery() as nursery:  # all-gather: our slice back to everyone
            for j in others:
                nursery.start_soon(self._send, j, data[b[me] : b[me + 1]])
                nursery.start_soon(self._receive, j, b[j + 1] - b[j])


# --------------------------------------------------------------------------- hivemind worker


def hivemind_worker(args) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager

    timing_path = os.path.join(args.tmpdir, f"hm_allreduce_{args.index}.txt")

    class TimedAverager(DecentralizedAverager):
        async def _aggregate_with_group(self, *a, **kw):  # runs in the averager's process
            started = time.perf_counter()
            try:
                return await super()._aggregate_with_group(*a, **kw)
            finally:
                with open(timing_path, "a") as f:  # noqa: ASYNC230 (a tiny write)
                    f.write(f"{time.perf_counter() - started}\n")

    def reply(message):
        sys.stdout.write(MARK + json.dumps(message) + "\n")
        sys.stdout.flush()

    dht = hivemind.DHT(
        initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
    )
    tensor = torch.zeros(args.numel, dtype=torch.float32)
    averager = TimedAverager(
        [tensor],
        dht=dht,
        prefix=PREFIX,
        target_group_size=args.num_peers,
        min_group_size=args.num_peers,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=args.request_timeout,
        start=True,
    )
    reply({"maddrs": [str(m) for m in dht.get_visible_maddrs()], "port": None})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "step":
            with averager.get_tensors() as (t,):
                t.fill_(args.index + cmd["round"])
            open(timing_path, "w").close()
            started = time.perf_counter()
            error = None
            try:
                if averager.step(timeout=args.step_timeout) is None:
                    error = "step returned None"
            except Exception as e:
                error = repr(e)
            step_s = time.perf_counter() - started
            with open(timing_path) as f:
                lines = f.read().split()
            with averager.get_tensors() as (t,):
                max_err = float((t - expected_mean(args.num_peers, cmd["round"])).abs().max())
            reply(
                {
                    "step_s": step_s,
                    "allreduce_s": float(lines[-1]) if lines else None,
                    "error": error,
                    "max_err": max_err,
                }
            )
        elif cmd["op"] == "exit":
            reply({"ok": True})
            break
    averager.shutdown()
    dht.shutdown()


# --------------------------------------------------------------------------- parent


class Worker:
    def __init__(self, command: list[str], log_path: str):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log
        )
        self.buffer = b""

    def send(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith(MARK):
                        return json.loads(text[len(MARK) :])
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"no reply in {timeout} s; log: {self.log_path}")
                data = os.read(fd, 1 << 16)
                if not data:
                    raise RuntimeError(f"worker exited ({self.proc.wait()}); log: {self.log_path}")
                self.buffer += data

    def close(self) -> None:
        try:
            self.send(op="exit")
            self.receive(30)
            self.proc.stdin.close()
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_block(impl: str, num_peers: int, numel: int, args, tmpdir: str, block: int) -> dict:
    python = sys.executable if impl == "swarmtrain" else args.hivemind_python
    base = [python, os.path.abspath(__file__), "--worker", "--impl", impl]
    base += ["--num-peers", str(num_peers), "--numel", str(numel), "--tmpdir", tmpdir]
    base += ["--min-matchmaking-time", str(args.min_matchmaking_time)]
    base += ["--request-timeout", str(args.request_timeout)]
    base += ["--part-size-bytes", str(args.part_size_bytes)]
    base += ["--step-timeout", str(args.step_timeout)]
    if args.profile and impl == "swarmtrain":
        base += ["--profile", args.profile]
    workers: list[Worker] = []
    result = {"tcp": [], "step": [], "allreduce": [], "cpu": [], "failed": 0}
    result["load"] = [load_text()]
    started = time.perf_counter()
    try:

        def spawn(i, initial):
            log = os.path.join(tmpdir, f"{impl}_{block}_{i}.log")
            extra = ["--index", str(i)] + [x for m in initial for x in ("--initial-peer", m)]
            return Worker(base + extra, log)

        workers.append(spawn(0, []))
        first = workers[0].receive(args.start_timeout)
        workers += [spawn(i, first["maddrs"]) for i in range(1, num_peers)]
        hello = [first] + [w.receive(args.start_timeout) for w in workers[1:]]
        setup_s = time.perf_counter() - started
        if impl == "swarmtrain":
            ports = [h["port"] for h in hello]
            for w in workers:
                w.send(op="connect", ports=ports)
            for w in workers:
                w.receive(60)
        for r in range(args.rounds):
            warmup = r == 0
            if impl == "swarmtrain":
                for w in workers:
                    w.send(op="tcp")
                tcp = max(w.receive(120)["tcp_s"] for w in workers)
                if not warmup:
                    result["tcp"].append(tcp)
            profile = bool(args.profile) and not warmup and r == args.rounds - 1
            for w in workers:
                w.send(op="step", round=r, profile=profile)
            replies = [w.receive(args.step_timeout + 120) for w in workers]
            errors = [x["error"] for x in replies if x["error"]]
            bad = [x["max_err"] for x in replies if x["max_err"] > 1e-4]
            ok = not errors and not bad and all(x["allreduce_s"] for x in replies)
            step = max(x["step_s"] for x in replies)
            allreduce = max(x["allreduce_s"] or float("nan") for x in replies)
            begun = [x.get("allreduce_start") for x in replies]
            stagger = (
                f", starts within {1000 * (max(begun) - min(begun)):.0f} ms"
                if all(b is not None for b in begun)
                else ""
            )
            if args.verbose:
                print(
                    f"    {impl} round {r}: step {step:.3f} s, all-reduce {allreduce:.3f} s"
                    + (f", tcp {tcp:.3f} s" if impl == "swarmtrain" else "")
                    + stagger
                    + ("" if ok else f"  FAILED errors={errors[:2]} max_err={bad[:2]}"),
                    flush=True,
                )
            if not ok:
                result["failed"] += 1
            elif not warmup:
                result["step"].append(step)
                result["allreduce"].append(allreduce)
                if all(x.get("cpu_s") for x in replies):
                    result["cpu"].append(statistics.mean(x["cpu_s"] for x in replies))
    finally:
        for w in workers:
            w.close()
    result["load"].append(load_text())
    result["setup_s"] = setup_s
    return result


def median(values):
    return statistics.median(values) if values else float("nan")


def fmt(values) -> str:
    if not values:
        return "n/a"
    return f"{median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def parent(args) -> None:
    impls = [x for x in args.impls.split(",") if x]
    if "hivemind" in impls and not args.hivemind_python:
        try:
            import hivemind  # noqa: F401 (this venv has it: use it)

            args.hivemind_python = sys.executable
        except ImportError:
            pass
    if "hivemind" in impls and not args.hivemind_python:
        sys.exit("--impls hivemind needs --hivemind-python (a venv with hivemind 1.1.12)")
    tmpdir = tempfile.mkdtemp(prefix="bench_avg_")
    print(f"cores: {os.cpu_count()}, load average at start: {load_text()}, logs: {tmpdir}")
    summary = {}
    for config in args.configs.split(","):
        num_peers, numel = parse_config(config)
        mib = numel * 4 / 2**20
        moved = 2 * (num_peers - 1) / num_peers * mib
        print(
            f"\n== {config}: {num_peers} peers x {numel:,} fp32 ({mib:.0f} MiB each; a butterfly "
            f"moves {moved:.1f} MiB out and in per peer)",
            flush=True,
        )
        merged = {
            impl: {"tcp": [], "step": [], "allreduce": [], "cpu": [], "failed": 0} for impl in impls
        }
        for block in range(args.repeats):
            order = impls if block % 2 == 0 else impls[::-1]
            for impl in order:
                res = run_block(impl, num_peers, numel, args, tmpdir, block)
                for key in ("tcp", "step", "allreduce", "cpu"):
                    merged[impl][key] += res[key]
                merged[impl]["failed"] += res["failed"]
                print(
                    f"  block {block} {impl:10s} setup {res['setup_s']:.1f} s, load "
                    f"{res['load'][0]} -> {res['load'][1]}: all-reduce "
                    f"{median(res['allreduce']):.3f} s, step {median(res['step']):.3f} s"
                    + (f", raw TCP {median(res['tcp']):.3f} s" if res["tcp"] else "")
                    + (f", {res['failed']} failed rounds" if res["failed"] else ""),
                    flush=True,
                )
        print(f"-- {config} medians over all blocks (warm-up rounds excluded):")
        for impl in impls:
            m = merged[impl]
            print(f"  {impl:10s} all-reduce {fmt(m['allreduce'])}")
            print(f"  {impl:10s} whole step {fmt(m['step'])}")
            if m["cpu"]:
                print(f"  {impl:10s} CPU s per peer in all-reduce (all threads) {fmt(m['cpu'])}")
            if m["tcp"]:
                print(f"  {'raw TCP':10s} same bytes {fmt(m['tcp'])}")
            if m["failed"]:
                print(f"  {impl:10s} FAILED ROUNDS: {m['failed']}")
        st, hm = merged.get("swarmtrain"), merged.get("hivemind")
        if st and st["tcp"]:
            print(
                f"  ratio swarmtrain / raw TCP: all-reduce "
                f"{median(st['allreduce']) / median(st['tcp']):.2f}x (goal <= 3x)"
            )
        if st and hm:
            for key, name in (("allreduce", "all-reduce"), ("step", "whole step")):
                print(
                    f"  ratio swarmtrain / hivemind: {name} "
                    f"{median(st[key]) / median(hm[key]):.2f}x (goal <= 0.5x)"
                )
        summary[config] = merged
    print(f"\nload average at end: {load_text()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.profile:
        import pstats

        print(f"\n== cProfile of peer 0's all-reduce, last round ({args.profile})")
        stats = pstats.Stats(args.profile)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="4x16M,8x4M", help="NxSIZE[,...], M = 2**20")
    parser.add_argument("--impls", default="swarmtrain,hivemind")
    parser.add_argument("--hivemind-python", default=None)
    parser.add_argument("--rounds", type=int, default=6, help="per block, the first is warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="alternating blocks per impl")
    parser.add_argument("--min-matchmaking-time", type=float, default=2.0)
    parser.add_argument("--request-timeout", type=float, default=1.0)
    parser.add_argument(
        "--part-size-bytes", type=int, default=0, help="swarmtrain part size (0: its default)"
    )
    parser.add_argument("--step-timeout", type=float, default=120.0)
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--profile", default=None, help="swarmtrain: cProfile peer 0 into PATH")
    parser.add_argument("--json", default=None, help="write all round times to this file")
    parser.add_argument("--verbose", action="store_true")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="swarmtrain", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--num-peers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tmpdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--initial-peer", dest="initial_peers", action="append", default=[], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        if args.impl == "hivemind":
            hivemind_worker(args)
        else:
            swarmtrain_worker(args)
        return
    parent(args)


if __name__ == "__main__":
    main()
