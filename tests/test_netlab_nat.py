"""Peers behind real NATs (network namespaces, iptables MASQUERADE; root only): the DHT,
averaging, hole punching and data lanes end to end.

One lab for the module (``netlab.NatSwarm``): public peers "relay" and "boot"; "a" and "b"
behind cone NATs (port-preserving: DCUtR's predicted address is right), "c" behind a
symmetric NAT (``--random-fully``: every connection gets a random port, so hole punching
cannot work). Every peer runs swarmtrain's defaults on ``0.0.0.0``; nobody is told which peer
is behind a NAT: AutoNAT finds out, and the NAT peers then reserve slots on the relay.
"""

from __future__ import annotations

import netlab
import pytest
from netlab.nat_swarm import NatSwarm
from polling import wait_for

FLOATS = 1 << 18  # 1 MiB of float32 per peer
PAYLOAD = FLOATS * 4


@pytest.fixture(scope="module")
def swarm():
    reason = netlab.iptables_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netlab.Lab() as lab:
        swarm = NatSwarm(lab, {"a": "cone", "b": "cone", "c": "symmetric"})
        swarm.ask_all({name: {"op": "wait_circuit", "timeout": 60} for name in "abc"}, 90)
        yield swarm


def test_autonat_finds_the_nat_peers_and_they_reserve_on_the_relay(swarm):
    public_ips = {swarm.hosts[name].ip for name in ("relay", "boot")}
    for name in "abc":
        info = swarm.ask(name, {"op": "wait_reachability", "timeout": 30})
        assert info["reachability"] == "private", info
        assert swarm.peer_id("relay") in info["relays"], info
        circuits = [a for a in info["maddrs"] if "/p2p-circuit" in a]
        # through the relays' public addresses, not the 0.0.0.0 they listen on
        assert circuits and {a.split("/")[2] for a in circuits} <= public_ips, circuits
    for name in ("relay", "boot"):
        info = swarm.ask(name, {"op": "wait_reachability", "timeout": 30})
        assert info["reachability"] == "public", info
        assert not any("/p2p-circuit" in a for a in info["maddrs"]), info


def test_dht_works_across_nats(swarm):
    assert swarm.ask("a", {"op": "store", "key": "netlab/a", "value": "from a"})["ok"]
    assert swarm.ask("c", {"op": "store", "key": "netlab/c", "value": "from c"})["ok"]
    for reader in "bc":
        assert swarm.ask(reader, {"op": "get", "key": "netlab/a"})["value"] == "from a"
    assert swarm.ask("b", {"op": "get", "key": "netlab/c"})["value"] == "from c"


def _average(swarm, names: str, prefix: str, rounds: int) -> dict[str, dict]:
    values = {name: float(2 * i + 1) for i, name in enumerate(names)}  # 1, 3: mean 2
    messages = {
        name: {
            "op": "average",
            "prefix": prefix,
            "rounds": rounds,
            "floats": FLOATS,
            "value": values[name],
            "group_size": len(names),
        }
        for name in names
    }
    results = swarm.ask_all(messages, 120)
    for result in results.values():
        assert [r["group"] for r in result["rounds"]] == [len(names)] * rounds, result
        assert [r["value"] for r in result["rounds"]] == [2.0] * rounds, result
    return results


def test_cone_nat_pair_averages_then_holepunches_to_a_direct_connection(swarm):
    _average(swarm, "ab", "cone", rounds=2)

    def punched_through() -> bool:
        # the direct connection is listed before DCUtR counts its punch: wait for both
        a, b = swarm.paths("a"), swarm.paths("b")
        punches = a["hole_punches_succeeded"] + b["hole_punches_succeeded"]
        return "direct" in a["paths"].get("b", []) and punches >= 1

    wait_for(
        punched_through, 30, "a direct connection from a to b, made by a hole punch", interval=0.2
    )
    # traffic now takes the direct path: the relays see a small part of the payload
    before = swarm.public_bytes()
    _average(swarm, "ab", "cone", rounds=1)
    assert swarm.public_bytes() - before < PAYLOAD / 4


def test_symmetric_nat_pair_averages_through_the_relay(swarm):
    before = swarm.public_bytes()
    _average(swarm, "ac", "sym", rounds=2)
    # both directions of both rounds crossed a relay (in and out of its interface)
    assert swarm.public_bytes() - before > 2 * 2 * 2 * PAYLOAD * 0.9
    assert swarm.paths("a")["paths"]["c"] == ["relayed"]
    assert swarm.paths("c")["paths"]["a"] == ["relayed"]


def test_bulk_calls_behind_nat_fall_back_to_libp2p(swarm):
    # NAT peers offer no lanes (AutoNAT said private); a public peer does
    for target, lanes in (("relay", 1), ("b", 0), ("c", 0)):
        call = {"op": "bulk_call", "peer": swarm.peer_id(target), "mib": 4, "bulk": True}
        result = swarm.ask("a", call)
        assert result["correct"], result
        assert result["lanes_opened"] == lanes and result["lane_fallbacks"] == 0, result


@pytest.mark.slow
def test_symmetric_nat_hole_punch_fails_and_is_counted(swarm):
    # runs after test_symmetric_nat_pair_averages_through_the_relay: the punch started by the
    # relayed dial between a and c gives up (py-libp2p: 3 rounds of 5 s dials and pauses)
    def failed() -> int:
        return sum(swarm.paths(name)["hole_punches_failed"] for name in "ac")

    if not swarm.paths("a")["paths"].get("c"):
        _average(swarm, "ac", "sym", rounds=1)
    assert wait_for(failed, 60, "a failed hole punch between a and c", interval=0.2) >= 1
    assert swarm.paths("a")["paths"]["c"] == ["relayed"]


@pytest.mark.slow
def test_a_lane_offered_from_behind_a_nat_costs_one_open_wait():
    # "d" does not know it is behind a NAT (AutoNAT off), so it offers data lanes; after a
    # hole punch, a's bulk call tries a lane to d's NAT box, which drops it: the call goes
    # over libp2p after lane.OPEN_WAIT, and the failure is remembered for the next calls
    reason = netlab.iptables_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netlab.Lab() as lab:
        swarm = NatSwarm(
            lab,
            {"a": "cone", "d": "cone"},
            options={"d": {"use_autonat": False, "use_auto_relay": True}},
        )
        swarm.ask_all({name: {"op": "wait_circuit", "timeout": 60} for name in "ad"}, 90)
        info = swarm.ask("d", {"op": "info"})
        assert info["reachability"] == "unknown"
        circuit = next(a for a in info["maddrs"] if "/p2p-circuit" in a)
        swarm.ask("a", {"op": "connect", "maddr": circuit})  # relayed, then hole-punched
        wait_for(
            lambda: "direct" in swarm.paths("a")["paths"].get("d", []),
            30,
            "a-d direct",
            interval=0.2,
        )
        call = {"op": "bulk_call", "peer": swarm.peer_id("d"), "mib": 4, "bulk": True}
        first = swarm.ask("a", call)
        assert first["correct"] and first["lanes_opened"] == 0
        assert first["seconds"] >= 0.5  # it waited lane.OPEN_WAIT for the lane
        assert (
            wait_for(lambda: swarm.paths("a")["lane_fallbacks"], 10, "the fallback", interval=0.2)
            == 1
        )
        second = swarm.ask("a", call)
        assert second["correct"] and second["lanes_opened"] == 0
        assert swarm.paths("a")["lane_fallbacks"] == 1  # not tried again
