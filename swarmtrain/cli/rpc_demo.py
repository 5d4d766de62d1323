"""``swarmtrain demo --rpc``: start a few local peers that find each other and talk over RPC."""

from __future__ import annotations

import time

import trio
from google.protobuf.wrappers_pb2 import Int64Value, StringValue

from swarmtrain.p2p import P2P


async def _hello(request: StringValue, context) -> StringValue:
    return StringValue(value=f"hello {request.value}, I see you as {str(context.remote_id)[-6:]}")


async def _countdown(request: Int64Value, context):
    for i in range(request.value, 0, -1):
        yield Int64Value(value=i)


async def run_demo(num_peers: int, out=print) -> dict:
    if num_peers < 2:
        raise ValueError("the demo needs at least 2 peers")
    summary = {"calls": 0, "streamed": 0}
    async with trio.open_nursery() as nursery:
        peers: list[P2P] = []
        ready = trio.Event()
        done = trio.Event()

        async def run_peer(initial_peers, task_status=trio.TASK_STATUS_IGNORED):
            async with P2P.create(initial_peers=initial_peers) as p2p:
                p2p.add_protobuf_handler("demo::Greeter.hello", _hello, StringValue)
                p2p.add_protobuf_handler(
                    "demo::Greeter.countdown", _countdown, Int64Value, stream_output=True
                )
                task_status.started(p2p)
                await done.wait()

        bootstrap = await nursery.start(run_peer, [])
        peers.append(bootstrap)
        out(f"peer 0 (bootstrap) listening on {bootstrap.get_visible_maddrs()[0]}")
        for i in range(1, num_peers):
            started = time.perf_counter()
            peer = await nursery.start(run_peer, bootstrap.get_visible_maddrs())
            peers.append(peer)
            out(
                f"peer {i} {str(peer.peer_id)[-6:]} joined via the bootstrap peer "
                f"in {1000 * (time.perf_counter() - started):.1f} ms"
            )
        ready.set()
        for i, caller in enumerate(peers):
            for j, callee in enumerate(peers):
                if i == j:
                    continue
                caller.add_addrs(callee.peer_id, callee.get_visible_maddrs())
                started = time.perf_counter()
                reply = await caller.call_protobuf_handler(
                    callee.peer_id,
                    "demo::Greeter.hello",
                    StringValue(value=f"peer {i}"),
                    StringValue,
                )
                summary["calls"] += 1
                out(
                    f"peer {i} -> peer {j}: {reply.value!r} "
                    f"({1000 * (time.perf_counter() - started):.1f} ms)"
                )
        async with peers[-1].iterate_protobuf_handler(
            peers[0].peer_id, "demo::Greeter.countdown", Int64Value(value=5), Int64Value
        ) as responses:
            values = [r.value async for r in responses]
        summary["streamed"] = len(values)
        out(f"peer {num_peers - 1} streamed a countdown from peer 0: {values}")
        done.set()
    out(f"done: {summary['calls']} unary calls and 1 streaming call between {num_peers} peers")
    return summary


def run(num_peers: int) -> int:
    trio.run(run_demo, num_peers)
    return 0
