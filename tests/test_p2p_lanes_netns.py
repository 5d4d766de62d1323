"""Direct data lanes between hosts in separate network namespaces (root only).

Two public hosts of a ``netlab.Lab``: A runs two callee hosts, "open" and "firewalled"
(its lane port gets an iptables DROP rule), and B runs the caller. Every host
listens on ``/ip4/0.0.0.0/tcp/0``, so lanes listen on 0.0.0.0 and the caller dials the address
its libp2p connection comes from. Each namespace runs this file as a script (``peer_main``),
driven with JSON lines over stdin/stdout (``netlab.PeerProcess``); starting the two processes
once for the module keeps it fast (importing libp2p takes seconds).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netlab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=netlab.unavailable_reason() or "",
)

MIB = 1 << 20
START_TIMEOUT = 60.0  # two processes importing libp2p on a busy machine
CALL_TIMEOUT = 30.0
OPEN, FIREWALLED = 0, 1  # A's hosts


# ------------------------------------------------------------------ the peer (child process)


def peer_main(hosts: int) -> None:
    import trio

    trio.run(_peer, hosts)


async def _peer(hosts: int) -> None:
    """Run ``hosts`` P2P hosts and answer commands (one JSON line in, one out) until quit."""
    import contextlib
    import hashlib
    import json

    import trio
    from google.protobuf.wrappers_pb2 import BytesValue, StringValue

    from swarmtrain.p2p import P2P, lane_caller
    from swarmtrain.p2p import lane as lane_module
    from swarmtrain.p2p.autonat import observed_ips
    from swarmtrain.p2p.host import as_peer_id
    from swarmtrain.p2p.lane import LaneStream

    def say(message: dict) -> None:
        print(json.dumps(message), flush=True)

    def digest_handler(seen: list[str]):
        async def digest(requests, context):
            seen.append(str(context.remote_id))
            total, sha = 0, hashlib.sha256()
            async for request in requests:
                total += len(request.value)
                sha.update(request.value)
            return StringValue(value=f"{total} {sha.hexdigest()}")

        return digest

    def counters(p2p, seen: list[str]) -> dict:
        stats = p2p.statistics()
        keys = ("lanes_opened", "lanes_accepted", "lane_fallbacks")
        return {key: stats[key] for key in keys} | {"tickets": len(p2p.lanes.tickets), "seen": seen}

    default_open_wait = getattr(lane_caller, "OPEN_WAIT", None)
    async with contextlib.AsyncExitStack() as stack:
        p2ps, seens, infos = [], [], []
        for _ in range(hosts):
            p2p = await stack.enter_async_context(P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"]))
            seen: list[str] = []
            p2p.add_protobuf_handler(
                "t::N.digest", digest_handler(seen), BytesValue, stream_input=True
            )
            tcp = next(a for a in p2p.get_visible_maddrs() if "/tcp/" in a and "/ws" not in a)
            infos.append(
                {
                    "peer_id": str(p2p.peer_id),
                    "port": int(tcp.split("/tcp/")[1].split("/")[0]),
                    "lane_address": list(p2p.lanes._listener.getsockname()),
                }
            )
            p2ps.append(p2p)
            seens.append(seen)
        for info in infos:
            info["connect_timeout"] = lane_module.CONNECT_TIMEOUT
            info["open_wait"] = default_open_wait
        say({"hosts": infos})
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            p2p, seen = p2ps[command.get("host", 0)], seens[command.get("host", 0)]
            try:
                if command["op"] == "quit":
                    return
                if command["op"] == "connect":
                    address, peer_id = command["maddr"].split("/p2p/")
                    p2p.add_addrs(peer_id, [address])
                    with trio.fail_after(20):
                        await p2p.ensure_connected(peer_id)
                    say({"observed_ips": sorted(observed_ips(p2p, as_peer_id(peer_id)))})
                elif command["op"] == "call":
                    chunks = [os.urandom(MIB) for _ in range(command["mib"])]
                    # how long a call waits for a lane that is still opening (when the lane
                    # code has such a wait; the default otherwise)
                    lane_caller.OPEN_WAIT = command.get("open_wait", default_open_wait)
                    started = trio.current_time()
                    reply = await p2p.call_protobuf_handler(
                        command["peer"],
                        "t::N.digest",
                        [BytesValue(value=chunk) for chunk in chunks],
                        StringValue,
                        stream_input=True,
                        bulk=True,
                        timeout=CALL_TIMEOUT - 5,
                    )
                    elapsed = trio.current_time() - started
                    sha = hashlib.sha256(b"".join(chunks)).hexdigest()
                    expected = f"{command['mib'] * MIB} {sha}"
                    idle = p2p._bulk_pool._idle.get(as_peer_id(command["peer"]), [])
                    lane_bytes = sum(
                        s.stream.bytes_on_wire for s, _ in idle if isinstance(s.stream, LaneStream)
                    )
                    say(
                        {
                            "correct": reply.value == expected,
                            "elapsed": elapsed,
                            "lane_bytes": lane_bytes,  # sent and received by idle lanes
                        }
                    )
                elif command["op"] == "stats":
                    say(counters(p2p, seen))
                else:
                    say({"error": f"unknown op {command['op']!r}"})
            except Exception as e:
                say({"error": repr(e)})


# ------------------------------------------------------------------ the tests (parent)


class Swarm:
    def __init__(self, lab, a, b, a_hosts: list[dict], b_info: dict):
        self.lab, self.a, self.b = lab, a, b
        self.a_hosts, self.b_info = a_hosts, b_info

    def connect_b_to(self, host: int) -> dict:
        info = self.a_hosts[host]
        maddr = f"/ip4/{self.lab.hosts['a'].ip}/tcp/{info['port']}/p2p/{info['peer_id']}"
        return self.b.ask({"op": "connect", "maddr": maddr}, CALL_TIMEOUT)

    def bulk_call(self, host: int, mib: int, **options) -> dict:
        peer = self.a_hosts[host]["peer_id"]
        return self.b.ask({"op": "call", "peer": peer, "mib": mib, **options}, CALL_TIMEOUT)

    def a_stats(self, host: int) -> dict:
        return self.a.ask({"op": "stats", "host": host}, CALL_TIMEOUT)

    def b_stats(self) -> dict:
        return self.b.ask({"op": "stats"}, CALL_TIMEOUT)


@pytest.fixture(scope="module")
def swarm():
    script = os.path.abspath(__file__)
    with netlab.Lab() as lab:  # stops both peers (at the same time) when it closes
        a = lab.spawn(lab.add_public_host("a"), script, "--peer", "2")
        b = lab.spawn(lab.add_public_host("b"), script, "--peer", "1")
        a_hosts = a.recv(START_TIMEOUT)["hosts"]
        (b_info,) = b.recv(START_TIMEOUT)["hosts"]
        yield Swarm(lab, a, b, a_hosts, b_info)


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("lanes_opened", "lanes_accepted", "lane_fallbacks")}


def test_bulk_call_between_namespaces_takes_a_lane(swarm):
    assert swarm.a_hosts[OPEN]["lane_address"][0] == "0.0.0.0"
    assert swarm.connect_b_to(OPEN)["observed_ips"] == [swarm.lab.hosts["a"].ip]
    b_before = swarm.b_stats()

    # open_wait: on a busy machine, the call waits for its lane instead of taking libp2p
    result = swarm.bulk_call(OPEN, mib=6, open_wait=CALL_TIMEOUT / 2)
    assert result["correct"], result
    assert result["lane_bytes"] > 6 * MIB, result  # the payload went over the (now idle) lane
    assert _delta(swarm.b_stats(), b_before) == {
        "lanes_opened": 1,
        "lanes_accepted": 0,
        "lane_fallbacks": 0,
    }
    callee = swarm.a_stats(OPEN)
    assert callee["lanes_accepted"] == 1 and callee["lane_fallbacks"] == 0, callee
    assert callee["seen"] == [swarm.b_info["peer_id"]]  # the lane's call is attributed to B
    assert callee["tickets"] == 0  # the one ticket was redeemed


def _ensure_iptables() -> None:
    reason = netlab.iptables_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_firewalled_lane_falls_back_to_libp2p_once(swarm):
    _ensure_iptables()
    connect_timeout = swarm.b_info["connect_timeout"]  # the parent does not import libp2p
    lane_port = swarm.a_hosts[FIREWALLED]["lane_address"][1]
    rule = ["INPUT", "-p", "tcp", "--dport", str(lane_port), "-j", "DROP"]
    swarm.lab.hosts["a"].exec("iptables", "-A", *rule)
    try:
        swarm.connect_b_to(FIREWALLED)
        b_before = swarm.b_stats()

        started = time.monotonic()
        first = swarm.bulk_call(FIREWALLED, mib=4)
        assert first["correct"], first
        assert first["lane_bytes"] == 0, first
        if swarm.b_info["open_wait"] is not None:  # calls wait this long for a new lane
            assert first["elapsed"] < connect_timeout, first  # the DROP did not stall the call
        # The fallback is counted when the lane's connect times out: at the end of the call,
        # or (where calls wait only briefly for a new lane) a little later.
        delta = _delta(swarm.b_stats(), b_before)
        while delta["lane_fallbacks"] == 0 and time.monotonic() < started + connect_timeout + 10:
            time.sleep(0.1)
            delta = _delta(swarm.b_stats(), b_before)
        assert delta == {"lanes_opened": 0, "lanes_accepted": 0, "lane_fallbacks": 1}
        assert time.monotonic() - started >= connect_timeout * 0.95  # dropped, not refused

        second = swarm.bulk_call(FIREWALLED, mib=4)
        assert second["correct"], second
        assert second["elapsed"] < connect_timeout, second
        assert _delta(swarm.b_stats(), b_before)["lane_fallbacks"] == 1
        callee = swarm.a_stats(FIREWALLED)
        # one ticket was issued (and never redeemed): B did not try the lane again
        assert callee["tickets"] == 1 and callee["lanes_accepted"] == 0, callee
        assert callee["seen"] == [swarm.b_info["peer_id"]] * 2
    finally:
        swarm.lab.hosts["a"].exec("iptables", "-D", *rule)


if __name__ == "__main__" and sys.argv[1:2] == ["--peer"]:
    peer_main(int(sys.argv[2]))
