"""NAT traversal: circuit relay v2 and DCUtR hole punching between real hosts on loopback
(pure address/schedule helpers first, without a network).

"Behind NAT" is simulated: a ``client_mode`` peer listens on nothing, and the dialling peer is
only ever told the target's ``/p2p-circuit`` address, never its direct one.
"""

import gc
import logging

import multiaddr
import pytest
import trio
from google.protobuf.wrappers_pb2 import StringValue
from polling import wait_until

from swarmtrain.p2p import P2P, PeerUnreachableError
from swarmtrain.p2p._libp2p_fixes import open_tcp_stream_from
from swarmtrain.p2p.identity import generate_identity, peer_id_of
from swarmtrain.p2p.relay_routes import (
    RESERVATION_RENEW_MARGIN,
    circuit_addrs_via,
    group_routes,
    parse_circuit_addr,
    renewal_time,
    reservations_due,
    specify_relay_addrs,
)

REVERSE = "test::Relay.reverse"


async def reverse(request, context):
    return StringValue(value=request.value[::-1])


def circuits(p2p: P2P) -> list[str]:
    return [a for a in p2p.get_visible_maddrs() if "/p2p-circuit" in a]


# -------------------------------------------------------------- pure helpers


R = peer_id_of(generate_identity())
C = peer_id_of(generate_identity())


def test_parse_circuit_addr():
    route = parse_circuit_addr(f"/ip4/10.0.0.1/tcp/4001/p2p/{R}/p2p-circuit/p2p/{C}")
    assert route.relay == R and route.target == C
    assert [str(a) for a in route.relay_addrs] == ["/ip4/10.0.0.1/tcp/4001"]
    # the relay may be named without a transport address (we may already be connected to it)
    route = parse_circuit_addr(f"/p2p/{R}/p2p-circuit", target=C)
    assert route.relay == R and route.target == C and route.relay_addrs == ()
    for bad in (
        f"/ip4/10.0.0.1/tcp/4001/p2p/{R}",  # not a circuit
        f"/ip4/10.0.0.1/tcp/4001/p2p-circuit/p2p/{C}",  # no relay id
        f"/p2p/{R}/p2p-circuit",  # no target, none given
    ):
        with pytest.raises(ValueError):
            parse_circuit_addr(bad)
    with pytest.raises(ValueError, match="not to"):
        parse_circuit_addr(f"/p2p/{R}/p2p-circuit/p2p/{C}", target=R)


def test_group_routes_merges_addresses_per_relay():
    addrs = [
        multiaddr.Multiaddr(f"/ip4/10.0.0.1/tcp/1/p2p/{R}/p2p-circuit/p2p/{C}"),
        f"/ip4/10.0.0.2/tcp/2/p2p/{R}/p2p-circuit/p2p/{C}",
        f"/ip4/10.0.0.1/tcp/1/p2p/{R}/p2p-circuit/p2p/{C}",
        f"/ip4/10.0.0.3/tcp/3/p2p/{C}/p2p-circuit/p2p/{R}",  # leads elsewhere: ignored
    ]
    (route,) = group_routes(C, addrs)
    assert route.relay == R
    assert [str(a) for a in route.relay_addrs] == ["/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/2"]


def test_circuit_addrs_via():
    relay_addrs = [
        f"/ip4/10.0.0.1/tcp/1/p2p/{R}",
        "/ip4/10.0.0.2/tcp/2",
        f"/ip4/10.0.0.3/tcp/3/p2p/{C}",  # someone else's address
        f"/ip4/10.0.0.1/tcp/1/p2p/{R}/p2p-circuit/p2p/{C}",  # already a circuit
        f"/ip4/10.0.0.1/tcp/1/p2p/{R}",  # duplicate
    ]
    assert circuit_addrs_via(R, relay_addrs, C) == [
        f"/ip4/10.0.0.1/tcp/1/p2p/{R}/p2p-circuit/p2p/{C}",
        f"/ip4/10.0.0.2/tcp/2/p2p/{R}/p2p-circuit/p2p/{C}",
    ]


def test_wildcard_relay_addresses_become_the_ips_we_reach_the_relay_at():
    # a relay listening on 0.0.0.0 reports that in its reservation: dialling it would reach
    # the dialler's own machine (seen in tests/test_netlab_nat.py)
    addrs = [
        f"/ip4/0.0.0.0/tcp/4001/p2p/{R}",
        "/ip6/::/tcp/4001",
        "/ip4/10.0.0.1/tcp/4001",
        "/ip4/10.0.0.1/tcp/4001",  # duplicate
    ]
    assert specify_relay_addrs(addrs, {"10.0.0.1", "2001:db8::1"}) == [
        f"/ip4/10.0.0.1/tcp/4001/p2p/{R}",
        "/ip6/2001:db8::1/tcp/4001",
        "/ip4/10.0.0.1/tcp/4001",
    ]
    # reached only through a relayed connection (no IP): wildcard addresses are dropped
    assert specify_relay_addrs(addrs[:1], set()) == []
    # a wildcard relay's own addresses list this machine's IPs, loopback last: that one is
    # the dialler's own machine unless the dialler reaches the relay over loopback too
    expanded = ["/ip4/10.0.0.1/tcp/4001", "/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"]
    assert specify_relay_addrs(expanded, {"10.0.0.1"}) == expanded[:1]
    assert specify_relay_addrs(expanded, {"127.0.0.1"}) == expanded


def test_reservation_renewal_schedule():
    assert renewal_time(expires=1000.0 + 3600, granted_at=1000.0) == 4600 - RESERVATION_RENEW_MARGIN
    assert renewal_time(expires=1010.0, granted_at=1000.0) == 1005.0  # short ones at half-life
    assert reservations_due({R: 10.0, C: 20.0}, now=15.0) == [R]


@pytest.mark.trio
async def test_cancelled_hole_punch_dial_closes_its_socket():
    # DCUtR cancels its losing dials; py-libp2p 0.8.1 leaked the socket of a dial cancelled in
    # bind/connect (a ResourceWarning, an error under filterwarnings=error).
    # Our hosts' TCP transport (_libp2p_fixes.HolePunchTCP) dials with open_tcp_stream_from.
    with trio.CancelScope() as scope:
        scope.cancel()
        await open_tcp_stream_from("127.0.0.1", 9, ("127.0.0.1", 0))
    assert scope.cancelled_caught
    gc.collect()  # a leaked socket would warn here


# ------------------------------------------------------------- real hosts


@pytest.mark.trio
async def test_client_mode_peer_is_reachable_through_relay():
    async with P2P.create() as relay:
        assert relay.relay is not None and relay.relay.serve
        async with P2P.create(
            initial_peers=relay.get_visible_maddrs(), client_mode=True, use_hole_punching=False
        ) as nat_peer:
            nat_peer.add_protobuf_handler(REVERSE, reverse, StringValue)
            # listening on nothing, it is visible only through the relay
            visible = nat_peer.get_visible_maddrs()
            assert visible and visible == circuits(nat_peer)
            assert all(
                f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{nat_peer.peer_id}" in a for a in visible
            )
            assert nat_peer.relay.relays == [relay.peer_id]
            assert not nat_peer.relay.serve  # a client-mode peer serves no one

            async with P2P.create(use_hole_punching=False) as dialer:
                await dialer.connect(visible[0])
                reply = await dialer.call_protobuf_handler(
                    nat_peer.peer_id, REVERSE, StringValue(value="relayed"), StringValue
                )
                assert reply.value == "deyaler"
                assert dialer.relay.is_relayed(nat_peer.peer_id)
                assert not dialer.relay.is_direct(nat_peer.peer_id)
                assert dialer.relay.statistics().relayed_dials == 1
                # the relayed connection carries calls the other way round too
                dialer.add_protobuf_handler(REVERSE, reverse, StringValue)
                back = await nat_peer.call_protobuf_handler(
                    dialer.peer_id, REVERSE, StringValue(value="back"), StringValue
                )
                assert back.value == "kcab"


def _streams_to(host: P2P, peer) -> int:
    conns = host.host.get_network().connections.get(peer) or []
    return sum(len(conn.get_streams()) for conn in conns if not conn.is_closed)


@pytest.mark.trio
@pytest.mark.parametrize("closed", [0, 1], ids=["older_closed", "newer_closed"])
async def test_closing_one_of_two_circuits_leaves_the_other(closed):
    # Two relayed connections between one pair (both dialled at once, or a redial). py-libp2p
    # 0.8.1's relay cleaned a finished circuit up by peer id, and its entry held the newest
    # circuit: closing the older connection closed the newer one's streams at the relay too
    # (the other connection died, its calls failed or were redialled).
    async with P2P.create() as relay:
        async with (
            P2P.create(
                initial_peers=relay.get_visible_maddrs(), client_mode=True, use_hole_punching=False
            ) as nat_peer,
            P2P.create(use_hole_punching=False) as dialer,
        ):
            nat_peer.add_protobuf_handler(REVERSE, reverse, StringValue)
            await dialer.connect(circuits(nat_peer)[0])
            await dialer.relay.dial_through_relay(nat_peer.peer_id, circuits(nat_peer))
            conns = list(dialer.host.get_network().connections[nat_peer.peer_id])
            assert dialer.connection_paths()[nat_peer.peer_id] == ["relayed", "relayed"]
            assert _streams_to(relay, dialer.peer_id) == 2  # one hop stream per circuit
            await conns[closed].close()
            with trio.fail_after(5.0):  # the relay ended that circuit
                await wait_until(lambda: _streams_to(relay, dialer.peer_id) < 2)
            with trio.fail_after(5.0):
                reply = await dialer.call_protobuf_handler(
                    nat_peer.peer_id, REVERSE, StringValue(value="kept"), StringValue, timeout=5.0
                )
            assert reply.value == "tpek"
            assert dialer.relay.statistics().relayed_dials == 2  # the other one carried it
            assert dialer.connection_paths()[nat_peer.peer_id] == ["relayed"]
            assert _streams_to(relay, dialer.peer_id) == 1
            spliced = relay.relay.circuit_relay
            assert (spliced.circuits_spliced, spliced.circuits_reset) == (1, 0)  # ended cleanly


@pytest.mark.trio
async def test_relayed_peer_stays_reachable_after_identify_replaced_its_addresses():
    # A peer behind a NAT listens on a private address. py-libp2p's identify replaces all the
    # addresses a dialler knows for it with its listen addresses: its circuit address was
    # gone, and once the relayed connection closed nobody could dial it again.
    unreachable = "/ip4/127.0.0.1/tcp/9"  # what a private listen address is to the dialler
    async with P2P.create() as relay:
        async with (
            P2P.create(
                initial_peers=relay.get_visible_maddrs(),
                announce_maddrs=[unreachable],
                use_auto_relay=True,
                use_hole_punching=False,
            ) as nat_peer,
            P2P.create(use_hole_punching=False) as dialer,
        ):
            nat_peer.add_protobuf_handler(REVERSE, reverse, StringValue)
            (circuit,) = circuits(nat_peer)
            await dialer.connect(circuit)

            def known() -> list[str]:
                return [
                    a.split(f"/p2p/{nat_peer.peer_id}")[0]
                    for a in dialer.known_addrs(nat_peer.peer_id)
                ]

            with trio.fail_after(5.0):  # the dialler identified the peer
                await wait_until(lambda: unreachable in known())
            assert circuit.split(f"/p2p/{nat_peer.peer_id}")[0] in known()
            for conn in list(dialer.host.get_network().connections[nat_peer.peer_id]):
                await conn.close()
            assert not dialer.is_connected(nat_peer.peer_id)
            reply = await dialer.call_protobuf_handler(
                nat_peer.peer_id, REVERSE, StringValue(value="again"), StringValue
            )
            assert reply.value == "niaga"
            assert dialer.relay.statistics().relayed_dials == 2


@pytest.mark.trio
@pytest.mark.parametrize("target_listens", [True, False], ids=["listening", "client_mode"])
async def test_relayed_connection_is_upgraded_by_hole_punching(target_listens):
    # With a listening target both sides dial each other (DCUtR simultaneous open); a
    # client_mode target sends no addresses, and DCUtR has it dial the initiator instead.
    async with P2P.create() as relay:
        target_kwargs = {"use_auto_relay": True} if target_listens else {"client_mode": True}
        async with (
            P2P.create(initial_peers=relay.get_visible_maddrs(), **target_kwargs) as target,
            P2P.create() as dialer,
        ):
            target.add_protobuf_handler(REVERSE, reverse, StringValue)
            assert bool(target.host.get_addrs()) == target_listens
            (circuit,) = circuits(target)
            await dialer.connect(circuit)  # the dialer never learns a direct address
            assert dialer.relay.is_relayed(target.peer_id)
            assert dialer.connection_paths()[target.peer_id][-1] == "relayed"
            reply = await dialer.call_protobuf_handler(
                target.peer_id, REVERSE, StringValue(value="punch"), StringValue
            )
            assert reply.value == "hcnup"
            with trio.fail_after(5.0):
                await wait_until(lambda: dialer.relay.is_direct(target.peer_id))
            assert "direct" in dialer.connection_paths()[target.peer_id]
            with trio.fail_after(6.0):
                await wait_until(lambda: dialer.relay.statistics().hole_punches_succeeded == 1)
            # new calls use the direct connection (libp2p prefers direct over relayed)
            reply = await dialer.call_protobuf_handler(
                target.peer_id, REVERSE, StringValue(value="direct"), StringValue
            )
            assert reply.value == "tcerid"


@pytest.mark.trio
async def test_client_mode_without_relays_still_works_as_client(caplog):
    async with P2P.create(relay_service=False) as plain:
        plain.add_protobuf_handler(REVERSE, reverse, StringValue)
        with caplog.at_level(logging.WARNING, logger="swarmtrain.p2p.relay"):
            async with P2P.create(
                initial_peers=plain.get_visible_maddrs(), client_mode=True
            ) as nat_peer:
                (warning,) = [r for r in caplog.records if r.name == "swarmtrain.p2p.relay"]
                assert warning.levelno == logging.WARNING
                assert "granted" in warning.getMessage()
                assert "does not serve relays" in warning.getMessage()  # and why
                assert nat_peer.get_visible_maddrs() == []
                assert nat_peer.relay.relays == []
                reply = await nat_peer.call_protobuf_handler(
                    plain.peer_id, REVERSE, StringValue(value="client"), StringValue
                )
                assert reply.value == "tneilc"

                # nobody can reach it: its would-be circuit through a non-relay is refused
                async with P2P.create() as dialer:
                    fake = f"{plain.get_visible_maddrs()[0]}/p2p-circuit/p2p/{nat_peer.peer_id}"
                    with pytest.raises(PeerUnreachableError, match="does not serve relays"):
                        await dialer.connect(fake)


@pytest.mark.trio
async def test_dial_through_relay_without_reservation_is_refused():
    async with P2P.create() as relay, P2P.create(client_mode=True) as unreserved:
        assert unreserved.get_visible_maddrs() == []
        async with P2P.create() as dialer:
            circuit = f"{relay.get_visible_maddrs()[0]}/p2p-circuit/p2p/{unreserved.peer_id}"
            with pytest.raises(PeerUnreachableError, match="NO_RESERVATION"):
                await dialer.connect(circuit)


@pytest.mark.trio
async def test_relaying_disabled():
    async with (
        P2P.create() as relay,
        P2P.create(initial_peers=relay.get_visible_maddrs(), client_mode=True) as nat_peer,
        P2P.create(use_relay=False, relay_service=False) as dialer,
    ):
        assert dialer.relay is None
        with pytest.raises(PeerUnreachableError, match="relaying is disabled"):
            await dialer.connect(circuits(nat_peer)[0])
