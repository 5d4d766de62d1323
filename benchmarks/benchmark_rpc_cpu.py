"""CPU cost of small RPCs, dials and bulk transfers between two swarmtrain hosts in one process.

    python benchmarks/benchmark_rpc_cpu.py [--tasks 8] [--calls 50] [--size 300] [--rounds 5]
                                          [--dials 10] [--bulk_mib 64]

Both ends run in this process (one trio loop), so ``time.process_time`` counts the caller's
and the callee's CPU together. Measures, as medians over ``--rounds``:

- small RPCs on an open connection: ``--tasks`` concurrent tasks each make ``--calls``
  echo calls of ``--size`` bytes; CPU ms per call (both ends) and wall time per call;
- dial + first call: ``--dials`` fresh hosts (relays, AutoNAT and data lanes off) each
  make one echo call to the server, which dials it; CPU ms per dial + call (both ends);
- bulk: one stream-input call of ``--bulk_mib`` MiB in 1 MiB messages over libp2p (no data
  lane); MiB/s and CPU ms per MiB (both ends; less sensitive to other jobs than MiB/s).

The DHT is bound by exactly these costs (see docs/STATUS.md, issue #3).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AsyncExitStack

import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value

from swarmtrain.p2p import P2P

QUIET = {"use_relay": False, "relay_service": False, "use_autonat": False}
METHOD = "bench::Cpu.echo"
SINK = "bench::Cpu.sink"


async def _echo(request, context):
    return request


async def small_calls(client: P2P, server: P2P, tasks: int, calls: int, size: int):
    request = BytesValue(value=bytes(size))

    async def worker():
        for _ in range(calls):
            reply = await client.call_protobuf_handler(server.peer_id, METHOD, request, BytesValue)
            assert len(reply.value) == size

    cpu, wall = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(worker)
    n = tasks * calls
    return 1000 * (time.process_time() - cpu) / n, 1000 * (time.perf_counter() - wall) / n


async def dials(server: P2P, count: int) -> float:
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(P2P.create(use_data_lanes=False, **QUIET))
            for _ in range(count)
        ]
        for client in clients:
            client.add_addrs(server.peer_id, server.get_visible_maddrs())
        request = BytesValue(value=bytes(300))
        cpu = time.process_time()
        for client in clients:
            await client.call_protobuf_handler(server.peer_id, METHOD, request, BytesValue)
        await trio.sleep(0.5)  # background work a dial starts (identify) counts too
        return 1000 * (time.process_time() - cpu) / count


async def _sink(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


async def bulk(client: P2P, server: P2P, mib: int) -> tuple[float, float]:
    chunk = BytesValue(value=b"\x07" * (1 << 20))
    cpu, wall = time.process_time(), time.perf_counter()
    reply = await client.call_protobuf_handler(
        server.peer_id, SINK, [chunk] * mib, Int64Value, stream_input=True
    )
    assert reply.value == mib << 20
    return mib / (time.perf_counter() - wall), 1000 * (time.process_time() - cpu) / mib


async def main(args) -> None:
    rpc_cpu, rpc_wall, dial_cpu, bulk_rate, bulk_cpu = [], [], [], [], []
    async with (
        P2P.create(use_data_lanes=False, **QUIET) as server,
        P2P.create(server.get_visible_maddrs(), use_data_lanes=False, **QUIET) as client,
    ):
        server.add_protobuf_handler(METHOD, _echo, BytesValue)
        server.add_protobuf_handler(SINK, _sink, BytesValue, stream_input=True)
        await small_calls(client, server, args.tasks, 5, args.size)  # warm-up: pooled streams
        for _ in range(args.rounds):
            cpu, wall = await small_calls(client, server, args.tasks, args.calls, args.size)
            rpc_cpu.append(cpu)
            rpc_wall.append(wall)
            if args.dials:
                dial_cpu.append(await dials(server, args.dials))
            if args.bulk_mib:
                rate, cpu_per_mib = await bulk(client, server, args.bulk_mib)
                bulk_rate.append(rate)
                bulk_cpu.append(cpu_per_mib)
    print(
        f"small RPC ({args.tasks} tasks x {args.calls} calls x {args.size} B): "
        f"CPU {statistics.median(rpc_cpu):.3f} ms/call (both ends), "
        f"wall {statistics.median(rpc_wall):.3f} ms/call  runs {[round(x, 3) for x in rpc_cpu]}"
    )
    if dial_cpu:
        print(
            f"dial + first call ({args.dials} fresh hosts): CPU "
            f"{statistics.median(dial_cpu):.1f} ms (both ends)  runs "
            f"{[round(x, 1) for x in dial_cpu]}"
        )
    if bulk_rate:
        print(
            f"bulk ({args.bulk_mib} MiB, libp2p stream): {statistics.median(bulk_rate):.0f} MiB/s, "
            f"CPU {statistics.median(bulk_cpu):.2f} ms/MiB (both ends)  runs "
            f"{[round(x) for x in bulk_rate]}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--size", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dials", type=int, default=10)
    parser.add_argument("--bulk_mib", type=int, default=64)
    trio.run(main, parser.parse_args())
