"""A latency-probe peer for netlab: run inside a namespace, driven by JSON lines on stdin.

``python latency_peer.py '<json options>'`` starts a DHT (its ``P2P`` host, with the options'
``dht`` keywords; ``log``: logger names to print at DEBUG on stderr) and a ``PubSub``
subscribed to ``TOPIC``, registers an echo handler, prints ``{"ready": ..., "peer_id",
"maddrs"}`` and then answers one line per command (``{"error": ...}`` when a command fails).
Every duration is measured inside this process (``perf_counter`` around the awaited call), so
the harness's pipes are not part of it:

- ``{"op": "connect", "maddr"}``: dial a peer; the kinds of connection held to it;
- ``{"op": "wait_circuit", "timeout"}``: wait for a ``/p2p-circuit`` address, then the addresses;
- ``{"op": "rpc", "peer", "count", "size"}``: ``count`` sequential echo calls of ``size`` bytes;
  each round trip's seconds, and how many RPC streams this host opened and reused meanwhile;
- ``{"op": "redial", "peer", "count"}``: ``count`` times: close every connection to ``peer``,
  then one echo call (a new dial, direct or through the relay, and the call); the seconds of
  each, and the failures;
- ``{"op": "dht", "count", "prefix"}``: ``count`` sequential DHT stores of a fresh key, then a
  get of each; the seconds of each;
- ``{"op": "wait_mesh", "count", "timeout"}``: wait until ``count`` peers subscribe to ``TOPIC``;
- ``{"op": "publish", "count", "interval"}``: publish ``count`` messages, ``interval`` s apart,
  each carrying its send time (``time.monotonic``: one clock for every namespace of the box);
- ``{"op": "received"}``: the delays (arrival minus send time) of the messages received so far,
  by sequence number (and forgets them);
- ``{"op": "quit"}`` (or stdin closed): leave every ``async with`` and exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import sys
import time

import trio

ECHO = "netlab::Latency.echo"
TOPIC = "netlab/latency"
_STAMP = struct.Struct("!Id")  # sequence number, monotonic send time


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


async def main(options: dict) -> None:
    from google.protobuf.wrappers_pb2 import BytesValue

    from swarmtrain.dht import DHT, get_dht_time
    from swarmtrain.p2p.pubsub import PubSub

    if options.get("log"):  # logger names to print at DEBUG on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(created).3f %(name)s %(message)s"))
        for name in options["log"]:
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.DEBUG)

    async def echo(request, context):
        return request

    async with contextlib.AsyncExitStack() as stack:
        dht = await stack.enter_async_context(DHT.create(**options.get("dht", {})))
        p2p = dht.p2p
        p2p.add_protobuf_handler(ECHO, echo, BytesValue)
        pubsub = await stack.enter_async_context(PubSub.create(p2p))
        subscription = await stack.enter_async_context(await pubsub.subscribe(TOPIC))
        delays: dict[int, float] = {}

        async def collect() -> None:
            async for message in subscription:
                arrived = time.monotonic()
                if len(message.data) >= _STAMP.size:
                    seq, sent = _STAMP.unpack_from(message.data)
                    delays[seq] = arrived - sent

        nursery = await stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(collect)
        stack.callback(nursery.cancel_scope.cancel)
        say({"ready": True, "peer_id": str(p2p.peer_id), "maddrs": p2p.get_visible_maddrs()})
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                return
            command = json.loads(line)
            op = command["op"]
            try:
                if op == "quit":
                    return
                elif op == "connect":
                    try:
                        with trio.fail_after(command.get("timeout", 30)):
                            peer = await p2p.connect(command["maddr"])
                    except Exception as e:
                        target = command["maddr"].rsplit("/p2p/", 1)[-1]
                        raise RuntimeError(f"{e!r}; known: {p2p.known_addrs(target)}") from e
                    say({"paths": p2p.connection_paths().get(peer, [])})
                elif op == "wait_circuit":
                    with trio.fail_after(command.get("timeout", 60)):
                        while not any(  # noqa: ASYNC110 (no event for it)
                            "/p2p-circuit" in a for a in p2p.get_visible_maddrs()
                        ):
                            await trio.sleep(0.05)
                    say({"maddrs": p2p.get_visible_maddrs()})
                elif op == "rpc":
                    payload = BytesValue(value=b"x" * command.get("size", 32))
                    before = _stream_counts(p2p)
                    seconds = []
                    for _ in range(command["count"]):
                        started = time.perf_counter()
                        await p2p.call_protobuf_handler(
                            command["peer"], ECHO, payload, BytesValue, timeout=30
                        )
                        seconds.append(time.perf_counter() - started)
                    after = _stream_counts(p2p)
                    say({"seconds": seconds, **{k: after[k] - before[k] for k in after}})
                elif op == "redial":
                    seconds, failures = [], []
                    payload = BytesValue(value=b"x" * 32)
                    for _ in range(command["count"]):
                        await _disconnect(p2p, command["peer"])
                        started = time.perf_counter()
                        try:
                            await p2p.call_protobuf_handler(
                                command["peer"], ECHO, payload, BytesValue, timeout=10
                            )
                            seconds.append(time.perf_counter() - started)
                        except Exception as e:
                            failures.append(repr(e)[:200])
                    say({"seconds": seconds, "failures": failures})
                elif op == "dht":
                    prefix = command.get("prefix", "latency")
                    stores, gets = [], []
                    for i in range(command["count"]):
                        started = time.perf_counter()
                        ok = await dht.store(f"{prefix}/{i}", i, get_dht_time() + 300)
                        stores.append(time.perf_counter() - started)
                        if not ok:
                            raise RuntimeError(f"store {i} was accepted by no node")
                    for i in range(command["count"]):
                        started = time.perf_counter()
                        found = await dht.get(f"{prefix}/{i}", latest=True)
                        gets.append(time.perf_counter() - started)
                        if found is None or found.value != i:
                            raise RuntimeError(f"get {i} found {found}")
                    say({"store": stores, "get": gets})
                elif op == "wait_mesh":
                    with trio.fail_after(command.get("timeout", 60)):
                        await pubsub.wait_topic_peers(TOPIC, command["count"])
                    say({"topic_peers": len(pubsub.topic_peers(TOPIC))})
                elif op == "publish":
                    for seq in range(command["count"]):
                        await pubsub.publish(TOPIC, _STAMP.pack(seq, time.monotonic()))
                        await trio.sleep(command.get("interval", 0.05))
                    say({"published": command["count"]})
                elif op == "received":
                    say({"delays": dict(sorted(delays.items()))})
                    delays.clear()
                else:
                    say({"error": f"unknown op {op!r}"})
            except Exception as e:
                say({"error": f"{op}: {e!r}"})


async def _disconnect(p2p, peer: str) -> None:
    """Close every connection to ``peer`` and wait until we see none (at most 5 s)."""
    from swarmtrain.p2p.dialling import as_peer_id

    peer_id = as_peer_id(peer)
    for conn in list(p2p.host.get_network().connections.get(peer_id) or []):
        await conn.close()
    with trio.move_on_after(5.0):
        while p2p.is_connected(peer_id):  # noqa: ASYNC110 (no event for it)
            await trio.sleep(0.01)


def _stream_counts(p2p) -> dict[str, int]:
    stats = p2p.statistics()
    return {k: stats[k] for k in ("rpc_streams_opened", "rpc_streams_reused")}


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
