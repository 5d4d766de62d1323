"""AutoNAT: the decision core without a network, then real hosts on loopback.

"Behind NAT" is simulated: the peer listens on one port but announces another, closed one, so
a dial-back to what it announces fails exactly as a dial to a NATed address would.
"""

import socket
import time

import multiaddr
import pytest
import trio
from google.protobuf.wrappers_pb2 import StringValue

from swarmtrain.p2p import P2P, Reachability
from swarmtrain.p2p.autonat import (
    AUTONAT_METHOD,
    MAX_DIAL_ADDRS,
    RECHECK_INTERVAL,
    RETRY_UNKNOWN_INTERVAL,
    DialBackLimiter,
    DialBackResult,
    ReachabilityCore,
    dial_back_candidates,
    result_of,
)
from swarmtrain.proto.autonat_pb2 import AutoNATDialRequest, AutoNATDialResponse, AutoNATStatus

REVERSE = "test::AutoNAT.reverse"
YES, NO, NONE = DialBackResult.REACHABLE, DialBackResult.UNREACHABLE, DialBackResult.NO_ANSWER


async def reverse(request, context):
    return StringValue(value=request.value[::-1])


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def circuits(p2p: P2P) -> list[str]:
    return [a for a in p2p.get_visible_maddrs() if "/p2p-circuit" in a]


# -------------------------------------------------------------- decision core


def test_verdict_needs_agreeing_confirmations():
    core = ReachabilityCore(confirmations=2)
    assert core.reachability is Reachability.UNKNOWN
    assert core.next_check_delay() == RETRY_UNKNOWN_INTERVAL
    assert core.record("a", NO, now=0.0) is Reachability.UNKNOWN  # one vote is not enough
    assert core.record("b", NONE, now=0.0) is Reachability.UNKNOWN  # no answer is no vote
    assert core.record("a", NO, now=1.0) is Reachability.UNKNOWN  # the same server again
    assert core.record("c", NO, now=2.0) is Reachability.PRIVATE
    assert core.next_check_delay() == RECHECK_INTERVAL
    assert core.votes() == (0, 2) and core.no_answers == 1


def test_verdict_hysteresis_and_expiry():
    core = ReachabilityCore(confirmations=2, vote_ttl=100.0)
    for server in "abc":
        core.record(server, YES, now=0.0)
    assert core.reachability is Reachability.PUBLIC
    # two dissenters do not outnumber three: still public
    core.record("d", NO, now=1.0)
    core.record("e", NO, now=1.0)
    assert core.reachability is Reachability.PUBLIC
    # a server changes its mind: its latest answer is its vote
    assert core.record("a", NO, now=2.0) is Reachability.PRIVATE
    assert core.votes() == (2, 3)
    # votes expire; with none left the verdict stays what it was
    assert core.update(now=500.0) is Reachability.PRIVATE and core.votes() == (0, 0)
    core.record("x", YES, now=501.0)
    assert core.record("y", YES, now=501.0) is Reachability.PUBLIC


def test_choose_servers_prefers_never_asked():
    core = ReachabilityCore()
    core.record("a", NONE, now=5.0)
    core.record("b", YES, now=1.0)
    assert core.choose_servers(["a", "b", "c", "c"], limit=2) == ["c", "b"]
    assert core.choose_servers(["a", "b"], limit=5) == ["b", "a"]
    with pytest.raises(ValueError):
        ReachabilityCore(confirmations=0)


def test_status_to_vote():
    assert result_of(AutoNATStatus.AUTONAT_OK) is YES
    assert result_of(AutoNATStatus.AUTONAT_DIAL_ERROR) is NO
    assert result_of(AutoNATStatus.AUTONAT_NO_MATCHING_ADDR) is NO
    for status in (AutoNATStatus.AUTONAT_REFUSED, AutoNATStatus.AUTONAT_BAD_REQUEST, 0, 99):
        assert result_of(status) is NONE


def test_limiter():
    limiter = DialBackLimiter(per_peer_interval=10.0, per_minute=3)
    assert limiter.admit("a", now=0.0) is None
    assert "per peer" in limiter.admit("a", now=5.0)
    assert limiter.admit("a", now=10.0) is None
    assert limiter.admit("b", now=11.0) is None
    assert "per minute" in limiter.admit("c", now=12.0)
    assert limiter.admit("c", now=60.5) is None  # the first one left the window


def test_dial_back_candidates_only_on_the_observed_ip():
    addrs = [
        multiaddr.Multiaddr("/ip4/10.0.0.5/tcp/4001").to_bytes(),
        "/ip4/192.168.1.2/tcp/4001",  # a private address behind the NAT: never dialled
        "/ip4/10.0.0.5/tcp/4002/ws/p2p/12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK",
        "/ip4/0.0.0.0/tcp/4003",  # a wildcard listener: tried on the observed IP
        "/ip6/::/tcp/4004",  # no observed IPv6 address
        "/ip4/10.0.0.5/udp/4001/quic-v1",  # not TCP
        "/ip4/10.0.0.5/tcp/1/p2p/12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK/p2p-circuit",
        b"\xff garbage",
        "/ip4/10.0.0.5/tcp/4001",  # duplicate
    ]
    assert [str(a) for a in dial_back_candidates(addrs, ["10.0.0.5"])] == [
        "/ip4/10.0.0.5/tcp/4001",
        "/ip4/10.0.0.5/tcp/4002/ws",
        "/ip4/10.0.0.5/tcp/4003",
    ]
    # seen from another IP, only the wildcard listener remains (on that IP)
    assert [str(a) for a in dial_back_candidates(addrs, ["::ffff:10.0.0.6"])] == [
        "/ip4/10.0.0.6/tcp/4003"
    ]
    assert dial_back_candidates(addrs, []) == []
    many = [f"/ip4/10.0.0.5/tcp/{port}" for port in range(1000, 1010)]
    assert len(dial_back_candidates(many, ["10.0.0.5"])) == MAX_DIAL_ADDRS


# ------------------------------------------------------------- real hosts


@pytest.mark.trio
async def test_unreachable_peer_is_private_and_reachable_through_relay():
    async with P2P.create() as relay, P2P.create() as helper:
        bootstrap = relay.get_visible_maddrs() + helper.get_visible_maddrs()
        started = time.perf_counter()
        async with P2P.create(
            initial_peers=bootstrap,
            announce_maddrs=[f"/ip4/127.0.0.1/tcp/{closed_port()}"],  # not where it listens
        ) as nat_peer:
            nat_peer.add_protobuf_handler(REVERSE, reverse, StringValue)
            with trio.fail_after(10.0):
                verdict = await nat_peer.autonat.wait_reachability_known()
                print(f"time to verdict: {time.perf_counter() - started:.3f} s (incl. startup)")
                assert verdict is Reachability.PRIVATE
                assert nat_peer.reachability is Reachability.PRIVATE
                while not circuits(nat_peer):  # noqa: ASYNC110 (reserved in the background)
                    await trio.sleep(0.02)
            print(f"time to circuit address: {time.perf_counter() - started:.3f} s")
            stats = nat_peer.autonat.statistics()
            assert stats.unreachable_votes >= 2 and stats.reachable_votes == 0
            assert set(nat_peer.relay.relays) <= {relay.peer_id, helper.peer_id}
            relay_stats = nat_peer.relay.statistics()
            assert relay_stats.reachability == "private" and relay_stats.reservations >= 1
            assert helper.autonat.statistics().dial_backs_served == 1

            via_relay = [a for a in circuits(nat_peer) if f"/p2p/{relay.peer_id}/" in a]
            async with P2P.create(use_hole_punching=False) as dialer:
                await dialer.connect(via_relay[0])  # the only address it knows
                reply = await dialer.call_protobuf_handler(
                    nat_peer.peer_id, REVERSE, StringValue(value="natted"), StringValue
                )
                assert reply.value == "dettan"
                assert dialer.relay.is_relayed(nat_peer.peer_id)
                assert not dialer.relay.is_direct(nat_peer.peer_id)

            # a later PUBLIC verdict lets the reservations go
            nat_peer.relay.set_auto_reservations(False)
            assert circuits(nat_peer) == [] and nat_peer.relay.relays == []


@pytest.mark.trio
async def test_listening_peer_is_public_and_reserves_nothing():
    async with P2P.create() as a, P2P.create() as b:
        started = time.perf_counter()
        async with P2P.create(
            initial_peers=a.get_visible_maddrs() + b.get_visible_maddrs()
        ) as peer:
            with trio.fail_after(10.0):
                assert await peer.autonat.wait_reachability_known() is Reachability.PUBLIC
            print(f"time to verdict: {time.perf_counter() - started:.3f} s (incl. startup)")
            await trio.sleep(0.2)  # give a (wrong) reservation the chance to appear
            assert circuits(peer) == [] and peer.relay.relays == []
            assert peer.relay.statistics().reachability == "public"
            assert peer.autonat.statistics().reachable_votes == 2
        # a and b each asked the other while there were only two peers: no verdict yet
        assert a.reachability is Reachability.UNKNOWN
        assert a.relay.statistics().reachability == "unknown"


@pytest.mark.trio
async def test_server_answers_each_kind_of_request():
    async with (
        P2P.create() as server,
        P2P.create(initial_peers=server.get_visible_maddrs(), use_autonat=False) as client,
    ):
        assert client.autonat is None and client.reachability is Reachability.UNKNOWN

        async def ask(*addrs: str) -> AutoNATDialResponse:
            request = AutoNATDialRequest(addrs=[multiaddr.Multiaddr(a).to_bytes() for a in addrs])
            return await client.call_protobuf_handler(
                server.peer_id, AUTONAT_METHOD, request, AutoNATDialResponse
            )

        listen = str(client.host.get_addrs()[0]).split("/p2p/")[0]
        assert (await ask()).status == AutoNATStatus.AUTONAT_BAD_REQUEST
        # an address on another IP is never dialled (no amplification)
        elsewhere = await ask("/ip4/192.0.2.1/tcp/4001")
        assert elsewhere.status == AutoNATStatus.AUTONAT_NO_MATCHING_ADDR
        ok = await ask(f"/ip4/127.0.0.1/tcp/{closed_port()}", listen)
        assert ok.status == AutoNATStatus.AUTONAT_OK
        assert str(multiaddr.Multiaddr(ok.addr)) == listen
        again = await ask(listen)  # a second dial-back within PER_PEER_INTERVAL
        assert again.status == AutoNATStatus.AUTONAT_REFUSED and "per peer" in again.text
        stats = server.autonat.statistics()
        assert (stats.dial_backs_served, stats.dial_backs_refused) == (1, 1)
        # the dial-back connection was closed, never added to the swarm
        assert len(server.host.get_network().connections[client.peer_id]) == 1


@pytest.mark.trio
async def test_client_mode_is_private_without_asking():
    async with (
        P2P.create() as relay,
        P2P.create(initial_peers=relay.get_visible_maddrs(), client_mode=True) as nat_peer,
    ):
        assert nat_peer.reachability is Reachability.PRIVATE
        assert nat_peer.autonat.statistics().rounds == 0
        assert relay.autonat.statistics().dial_backs_served == 0
