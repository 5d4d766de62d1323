"""Throughput and latency of swarmtrain's RPC path against a raw trio TCP socket, same run.

    python benchmarks/benchmark_p2p.py [--mib 64] [--runs 5] [--private]
    python benchmarks/benchmark_p2p.py --dial-ab 40
    python benchmarks/benchmark_p2p.py --lane-stripes 4 --stripe-min-rtt 0   # striped lanes

Measures, each as the median of --runs runs:
- bytes/s of one stream-input RPC carrying --mib MiB in 1 MiB messages (TCP + Noise + Yamux),
  and of the same call with ``bulk=True`` (a direct data lane: TCP + ChaCha20-Poly1305 records),
  and of a raw trio TCP socket moving the same bytes, in one process and across two processes;
- dial latency (a fresh host connecting to a running one), the same plus its first tiny RPC,
  and tiny-RPC round-trip latency.
``--lane-stripes K`` / ``--stripe-min-rtt S``: every host's ``lane_stripes`` and
``lane_stripe_min_rtt`` (``--stripe-min-rtt 0`` stripes loopback lanes too: the A/B of what
striping costs on a short path).
``--private``: every host uses one swarm key (a private run, swarmtrain.p2p.private_network).
Prints ratios against raw TCP measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value, StringValue

from swarmtrain.p2p import P2P, generate_swarm_key

CHUNK = 1024 * 1024
HOST: dict = {}  # P2P.create keywords of every host (``swarm_key`` with --private)


async def _sink(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


async def _echo(request, context):
    return request


def serve_p2p():
    async def main():
        async with P2P.create(**HOST) as p2p:
            p2p.add_protobuf_handler("bench::P2P.sink", _sink, BytesValue, stream_input=True)
            p2p.add_protobuf_handler("bench::P2P.echo", _echo, StringValue)
            print(p2p.get_visible_maddrs()[0], flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes stdin

    trio.run(main)


def serve_tcp():
    async def main():
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        print(listener.socket.getsockname()[1], flush=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, _counting_handler, [listener])
            await trio.to_thread.run_sync(sys.stdin.read)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _counting_handler(stream):
    # Protocol: 8-byte length, then the payload; answer one byte when all arrived.
    header = b""
    while len(header) < 8:
        header += await stream.receive_some(8 - len(header))
    remaining = int.from_bytes(header, "big")
    while remaining > 0:
        data = await stream.receive_some(min(CHUNK, remaining))
        if not data:
            return
        remaining -= len(data)
    await stream.send_all(b"\x01")
    await stream.aclose()


async def tcp_transfer(port: int, nbytes: int) -> float:
    payload = b"\x07" * CHUNK
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    started = time.perf_counter()
    await stream.send_all(nbytes.to_bytes(8, "big"))
    for _ in range(nbytes // CHUNK):
        await stream.send_all(payload)
    assert await stream.receive_some(1) == b"\x01"
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return elapsed


async def rpc_transfer(client: P2P, server_id, nbytes: int, bulk: bool = False) -> float:
    payload = BytesValue(value=b"\x07" * CHUNK)
    started = time.perf_counter()
    reply = await client.call_protobuf_handler(
        server_id,
        "bench::P2P.sink",
        [payload] * (nbytes // CHUNK),
        Int64Value,
        stream_input=True,
        bulk=bulk,
    )
    elapsed = time.perf_counter() - started
    assert reply.value == nbytes
    return elapsed


def start_child(kind: str):
    key = ["--swarm-key-hex", HOST["swarm_key"].hex()] if "swarm_key" in HOST else []
    for option, name in (
        ("--lane-stripes", "lane_stripes"),
        ("--stripe-min-rtt", "lane_stripe_min_rtt"),
    ):
        if name in HOST:
            key += [option, str(HOST[name])]
    proc = subprocess.Popen(
        [sys.executable, __file__, f"--serve-{kind}", *key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


async def one_process(nbytes: int, runs: int) -> dict:
    out = {"tcp": [], "rpc": [], "lane": []}
    async with trio.open_nursery() as nursery:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, _counting_handler, [listener])
        async with (
            P2P.create(**HOST) as server,
            P2P.create(initial_peers=server.get_visible_maddrs(), **HOST) as client,
        ):
            server.add_protobuf_handler("bench::P2P.sink", _sink, BytesValue, stream_input=True)
            await rpc_transfer(client, server.peer_id, CHUNK)  # warm-up
            await rpc_transfer(client, server.peer_id, CHUNK, bulk=True)
            for _ in range(runs):
                out["tcp"].append(nbytes / await tcp_transfer(port, nbytes))
                out["rpc"].append(nbytes / await rpc_transfer(client, server.peer_id, nbytes))
                out["lane"].append(
                    nbytes / await rpc_transfer(client, server.peer_id, nbytes, bulk=True)
                )
        nursery.cancel_scope.cancel()
    return out


async def two_processes(nbytes: int, runs: int) -> dict:
    out = {"tcp": [], "rpc": [], "lane": [], "dial_ms": [], "first_call_ms": [], "rtt_ms": []}
    p2p_proc, maddr = start_child("p2p")
    tcp_proc, port = start_child("tcp")
    try:
        async with P2P.create(initial_peers=[maddr], **HOST) as client:
            server_id = maddr.rsplit("/p2p/", 1)[1]
            await rpc_transfer(client, server_id, CHUNK)
            await rpc_transfer(client, server_id, CHUNK, bulk=True)
            for _ in range(runs):
                out["tcp"].append(nbytes / await tcp_transfer(int(port), nbytes))
                out["rpc"].append(nbytes / await rpc_transfer(client, server_id, nbytes))
                out["lane"].append(nbytes / await rpc_transfer(client, server_id, nbytes, True))
            for _ in range(20):
                started = time.perf_counter()
                await client.call_protobuf_handler(
                    server_id, "bench::P2P.echo", StringValue(value="ping"), StringValue
                )
                out["rtt_ms"].append(1000 * (time.perf_counter() - started))
        for _ in range(max(runs, 5)):
            started = time.perf_counter()
            async with P2P.create(initial_peers=[maddr], **HOST) as client:
                out["dial_ms"].append(1000 * (time.perf_counter() - started))
                await client.call_protobuf_handler(
                    server_id, "bench::P2P.echo", StringValue(value="ping"), StringValue
                )
                out["first_call_ms"].append(1000 * (time.perf_counter() - started))
    finally:
        for proc in (p2p_proc, tcp_proc):
            proc.stdin.close()
            proc.wait(timeout=30)
    return out


async def dial_ab(runs: int) -> dict:
    """Dial + first tiny call of a fresh host, public vs private (one key), interleaved."""
    out = {"public": [], "private": []}
    key = generate_swarm_key()
    async with P2P.create() as public, P2P.create(swarm_key=key) as private:
        for server in (public, private):
            server.add_protobuf_handler("bench::P2P.echo", _echo, StringValue)
        for _ in range(runs):
            for label, server, kwargs in (
                ("public", public, {}),
                ("private", private, {"swarm_key": key}),
            ):
                started = time.perf_counter()
                async with P2P.create(initial_peers=server.get_visible_maddrs(), **kwargs) as c:
                    await c.call_protobuf_handler(
                        server.peer_id, "bench::P2P.echo", StringValue(value="ping"), StringValue
                    )
                    out[label].append(1000 * (time.perf_counter() - started))
        async with (
            P2P.create(initial_peers=public.get_visible_maddrs()) as to_public,
            P2P.create(initial_peers=private.get_visible_maddrs(), swarm_key=key) as to_private,
        ):
            for server in (public, private):
                server.add_protobuf_handler("bench::P2P.sink", _sink, BytesValue, stream_input=True)
            pairs = (("public", to_public, public), ("private", to_private, private))
            for label, client, server in pairs:
                out[f"{label} 16 MiB RPC, MiB/s"] = []
                await rpc_transfer(client, server.peer_id, CHUNK)  # warm-up
            for _ in range(max(4, runs // 4)):
                for label, client, server in pairs:
                    seconds = await rpc_transfer(client, server.peer_id, 16 * CHUNK)
                    out[f"{label} 16 MiB RPC, MiB/s"].append(16 / seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--serve-p2p", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-tcp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--private", action="store_true", help="all hosts share a swarm key")
    parser.add_argument("--swarm-key-hex", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--dial-ab",
        type=int,
        default=0,
        metavar="N",
        help="only: N interleaved dial+first call, then 16 MiB "
        "RPC transfers, public vs private host (in one process), then exit",
    )
    parser.add_argument("--lane-stripes", type=int, help="every host's lane_stripes")
    parser.add_argument("--stripe-min-rtt", type=float, help="every host's lane_stripe_min_rtt")
    args = parser.parse_args()
    if args.lane_stripes is not None:
        HOST["lane_stripes"] = args.lane_stripes
    if args.stripe_min_rtt is not None:
        HOST["lane_stripe_min_rtt"] = args.stripe_min_rtt
    if args.dial_ab:
        res = trio.run(dial_ab, args.dial_ab)
        for label, values in res.items():
            q = statistics.quantiles(values, n=4)
            what = label if "MiB/s" in label else f"{label} dial + first call, ms"
            print(
                f"{what:28s}: median {statistics.median(values):.1f} "
                f"(quartiles {q[0]:.1f} / {q[2]:.1f}, {len(values)} runs)"
            )
        return None
    if args.private or args.swarm_key_hex:
        key = bytes.fromhex(args.swarm_key_hex) if args.swarm_key_hex else generate_swarm_key()
        HOST["swarm_key"] = key
    if args.serve_p2p:
        return serve_p2p()
    if args.serve_tcp:
        return serve_tcp()
    nbytes = args.mib * CHUNK
    mib = 1024 * 1024
    private = "private run (swarm key)" if "swarm_key" in HOST else "public run (no swarm key)"
    lanes = {k: v for k, v in HOST.items() if k.startswith("lane_")}
    if lanes:
        print(f"lanes: {lanes}")
    print(f"{args.mib} MiB per transfer, median of {args.runs} runs, {private}")
    for label, fn in (("one process", one_process), ("two processes", two_processes)):
        res = trio.run(fn, nbytes, args.runs)
        tcp, rpc = statistics.median(res["tcp"]) / mib, statistics.median(res["rpc"]) / mib
        lane = statistics.median(res["lane"]) / mib
        print(
            f"{label:14s} raw TCP {tcp:8.0f} MiB/s | swarmtrain RPC {rpc:6.0f} MiB/s "
            f"| ratio {rpc / tcp:.3f}  (rpc runs: {[round(x / mib) for x in res['rpc']]})"
        )
        print(
            f"{'':14s} bulk=True (data lane) {lane:6.0f} MiB/s | ratio to raw TCP "
            f"{lane / tcp:.3f}, to the libp2p RPC {lane / rpc:.2f}x  "
            f"(lane runs: {[round(x / mib) for x in res['lane']]})"
        )
        if "dial_ms" in res:
            print(
                f"dial latency (fresh host -> running host, incl. host start) median "
                f"{statistics.median(res['dial_ms']):.1f} ms, with its first call "
                f"{statistics.median(res['first_call_ms']):.1f} ms; tiny RPC round trip median "
                f"{statistics.median(res['rtt_ms']):.2f} ms"
            )


if __name__ == "__main__":
    main()
