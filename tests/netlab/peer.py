"""A swarmtrain peer for netlab: run inside a namespace, driven by JSON lines on stdin.

``python peer.py '<json options>'`` starts a DHT (its ``P2P`` host) with the options'
``dht`` keywords (``initial_peers``, ``host_maddrs``, ``client_mode``, ``use_auto_relay``,
...), registers a digest handler for bulk-call measurements, prints ``{"ready": ...}`` and
then answers one line per command (``{"error": ...}`` when a command fails):

- ``{"op": "info"}``: peer id, visible addresses, AutoNAT's verdict, relay reservations;
- ``{"op": "wait_reachability", "timeout": s}``: wait for AutoNAT's verdict, then ``info``;
- ``{"op": "wait_circuit", "timeout": s}``: wait for a ``/p2p-circuit`` address, then ``info``;
- ``{"op": "store", "key", "value", "ttl"}`` / ``{"op": "get", "key"}``: DHT records;
- ``{"op": "connect", "maddr"}``: dial a peer;
- ``{"op": "average", "prefix", "rounds", "floats", "value", "group_size", "timeout"}``:
  a ``DecentralizedAverager`` over ``floats`` float32 values all equal to ``value`` averages
  ``rounds`` times (``averager``: its keywords; ``{"float16": true}`` for float16 parts;
  ``part_layout``: the part layout this peer offers in matchmaking, ``partition.PART_LAYOUTS``,
  pinned: not adapted to the link);
  per round: seconds, wall-clock stamps of the all-reduce's start and the step's end, group
  size, the first averaged value (``value_range``: the smallest and largest); ``"trace":
  true`` adds each round's all-reduce timeline
  (``AllReduceTrace`` events) and this host's interface byte counters sampled every
  ``SAMPLE_INTERVAL`` s during the step (``"link"``: ``[time, rx_bytes, tx_bytes]`` rows);
- ``{"op": "paths"}``: per connected peer, the kinds of connection held
  (``P2P.connection_paths``), relay and lane counters;
- ``{"op": "bulk_call", "peer", "mib", "bulk"}``: stream ``mib`` MiB to ``peer``'s digest
  handler; seconds taken, whether the digest matched;
- ``{"op": "quit"}`` (or stdin closed): leave every ``async with`` and exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time

import trio

DIGEST = "netlab::Digest.digest"
MIB = 1 << 20
SAMPLE_INTERVAL = 0.02  # seconds between interface counter samples of a traced round


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


async def main(options: dict) -> None:
    from google.protobuf.wrappers_pb2 import BytesValue, StringValue

    from swarmtrain.dht import DHT, get_dht_time

    if options.get("log"):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(relativeCreated)8.0f %(name)s %(message)s"))
        for name in options["log"]:
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.DEBUG)

    async def digest(requests, context):
        total, sha = 0, hashlib.sha256()
        async for request in requests:
            total += len(request.value)
            sha.update(request.value)
        return StringValue(value=f"{total} {sha.hexdigest()}")

    async with contextlib.AsyncExitStack() as stack:
        dht = await stack.enter_async_context(DHT.create(**options.get("dht", {})))
        p2p = dht.p2p
        p2p.add_protobuf_handler(DIGEST, digest, BytesValue, stream_input=True)
        averagers: dict[str, tuple] = {}  # prefix -> (tensors, averager)

        def info() -> dict:
            relay = p2p.relay
            return {
                "peer_id": str(p2p.peer_id),
                "maddrs": p2p.get_visible_maddrs(),
                "reachability": p2p.reachability.value,
                "relays": [str(r) for r in relay.relays] if relay else [],
            }

        say({"ready": True, **info()})
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                return
            command = json.loads(line)
            op = command["op"]
            try:
                if op == "quit":
                    return
                elif op == "info":
                    say(info())
                elif op == "wait_reachability":
                    with trio.fail_after(command.get("timeout", 60)):
                        await p2p.autonat.wait_reachability_known()
                    say(info())
                elif op == "wait_circuit":
                    with trio.fail_after(command.get("timeout", 60)):
                        while not any(  # noqa: ASYNC110 (no event for it)
                            "/p2p-circuit" in a for a in p2p.get_visible_maddrs()
                        ):
                            await trio.sleep(0.05)
                    say(info())
                elif op == "store":
                    expiration = get_dht_time() + command.get("ttl", 120)
                    ok = await dht.store(command["key"], command["value"], expiration)
                    say({"ok": bool(ok)})
                elif op == "get":
                    found = await dht.get(command["key"], latest=True)
                    say({"value": None if found is None else found.value})
                elif op == "connect":
                    with trio.fail_after(command.get("timeout", 30)):
                        peer = await p2p.connect(command["maddr"])
                    say({"connected": str(peer), "paths": _paths(p2p)})
                elif op == "average":
                    prefix = command["prefix"]
                    if prefix not in averagers:
                        import torch  # only averaging peers pay for importing it

                        from swarmtrain.averaging import DecentralizedAverager
                        from swarmtrain.compression import Float16Compression

                        extra = dict(command.get("averager", {}))
                        if extra.pop("float16", False):  # DiLoCo's pseudo-gradient codec
                            extra["compression"] = Float16Compression()

                        tensors = [torch.full((command["floats"],), float(command["value"]))]
                        averagers[prefix] = (
                            tensors,
                            await stack.enter_async_context(
                                DecentralizedAverager.create(
                                    tensors,
                                    dht,
                                    prefix=prefix,
                                    target_group_size=command["group_size"],
                                    min_group_size=command["group_size"],
                                    min_matchmaking_time=command.get("matchmaking_time", 2.0),
                                    request_timeout=command.get("request_timeout", 1.0),
                                    **extra,
                                )
                            ),
                        )
                    averaged, averager = averagers[prefix]
                    if command.get("part_layout") is not None:  # pinned: 0 is ~8 parts a slice
                        averager._matchmaking.part_layout = command["part_layout"]
                        averager.adapt_part_layout = False
                    trace = None
                    if command.get("trace"):
                        from swarmtrain.averaging.allreduce_trace import AllReduceTrace

                        trace = averager._allreduce.trace = AllReduceTrace()
                    rounds = []
                    for _ in range(command["rounds"]):
                        averaged[0].fill_(float(command["value"]))  # no step is running
                        started = time.perf_counter()
                        link: list[list[float]] = []
                        with trio.fail_after(command.get("timeout", 60)):
                            async with trio.open_nursery() as sampler:
                                if trace is not None:
                                    sampler.start_soon(_sample_link, link)
                                group, allreduce_began = await _timed_step(
                                    averager, command["group_size"]
                                )
                                sampler.cancel_scope.cancel()
                        traced = {}
                        if trace is not None:
                            events = [e.as_dict() for e in trace.take()]
                            traced = {"trace": events, "link": link}
                        rounds.append(
                            {
                                **traced,
                                "seconds": time.perf_counter() - started,
                                # wall-clock stamps (one machine: comparable across peers)
                                "allreduce_began": allreduce_began,
                                "ended": time.time(),
                                "group": len(group),
                                "value": float(averaged[0][0]),
                                # all equal to the mean unless a slice was left out
                                "value_range": [float(averaged[0].min()), float(averaged[0].max())],
                                "paths": _paths(p2p),
                                "lanes": _counters(p2p),
                                # what matchmaking offers next (the layout adapts to the link)
                                "part_layout": averager._matchmaking.part_layout,
                            }
                        )
                    say(
                        {
                            "rounds": rounds,
                            "part_bytes_sent": averager.part_bytes_sent,
                            "delta_bytes_sent": averager.delta_bytes_sent,
                        }
                    )
                elif op == "paths":
                    say({"paths": _paths(p2p), **_counters(p2p)})
                elif op == "bulk_call":
                    chunks = [os.urandom(MIB) for _ in range(command["mib"])]
                    before = _counters(p2p)
                    started = time.perf_counter()
                    reply = await p2p.call_protobuf_handler(
                        command["peer"],
                        DIGEST,
                        [BytesValue(value=chunk) for chunk in chunks],
                        StringValue,
                        stream_input=True,
                        bulk=command.get("bulk", True),
                        timeout=command.get("timeout", 60),
                    )
                    elapsed = time.perf_counter() - started
                    expected = f"{len(chunks) * MIB} {hashlib.sha256(b''.join(chunks)).hexdigest()}"
                    after = _counters(p2p)
                    say(
                        {
                            "seconds": elapsed,
                            "correct": reply.value == expected,
                            "paths": _paths(p2p),
                            "lanes_opened": after["lanes_opened"] - before["lanes_opened"],
                            "lane_fallbacks": after["lane_fallbacks"] - before["lane_fallbacks"],
                        }
                    )
                else:
                    say({"error": f"unknown op {op!r}"})
            except Exception as e:
                say({"error": f"{op}: {e!r}"})


async def _timed_step(averager, group_size: int) -> tuple[dict, float]:
    """``averager.step``, and the wall-clock time its all-reduce began (polled every 5 ms)."""
    control = averager.start_step(expected_group_size=group_size)
    began: list[float] = []

    async def watch() -> None:
        while not control.began_allreduce:  # noqa: ASYNC110 (no event for the stage)
            await trio.sleep(0.005)
        began.append(time.time())

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            group = await control.wait_result()
            nursery.cancel_scope.cancel()
    except BaseException:
        control.cancel()
        raise
    return group, began[0] if began else time.time()


def _interface() -> str | None:
    names = [n for n in os.listdir("/sys/class/net") if n != "lo"]
    return names[0] if len(names) == 1 else None


async def _sample_link(rows: list[list[float]]) -> None:
    """Append ``[wall time, rx_bytes, tx_bytes]`` of our one interface every
    ``SAMPLE_INTERVAL`` s (until cancelled; nothing if the namespace has several)."""
    name = _interface()
    if name is None:
        return
    base = f"/sys/class/net/{name}/statistics"
    while True:
        with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:  # noqa: ASYNC230
            rows.append([time.time(), int(rx.read()), int(tx.read())])
        await trio.sleep(SAMPLE_INTERVAL)


def _paths(p2p) -> dict[str, list[str]]:
    return {str(peer): kinds for peer, kinds in p2p.connection_paths().items()}


def _counters(p2p) -> dict:
    stats = p2p.statistics()
    relay = p2p.relay.statistics() if p2p.relay is not None else None
    return {
        "lanes_opened": stats["lanes_opened"],
        "lanes_accepted": stats["lanes_accepted"],
        "lane_fallbacks": stats["lane_fallbacks"],
        "striped_lanes_opened": stats.get("striped_lanes_opened", 0),
        "relayed_dials": relay.relayed_dials if relay else 0,
        "hole_punches_succeeded": relay.hole_punches_succeeded if relay else 0,
        "hole_punches_failed": relay.hole_punches_failed if relay else 0,
    }


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
