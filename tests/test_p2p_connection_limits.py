"""Inbound libp2p connections per host and per source address (security audit 7, issue 17
item 1): a crowd of identities from one machine cannot take every connection slot."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from polling import wait_until

from swarmtrain.p2p import P2P, ResourceLimits
from swarmtrain.p2p.connection_limits import (
    AddressCounter,
    address_key,
    build_connection_config,
    connections_within_fd_limit,
)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def test_addresses_are_counted_per_ipv4_address_and_ipv6_slash_64():
    assert address_key("10.1.2.3") == "10.1.2.3"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::7")
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert address_key("not an address") is None

    counter = AddressCounter(limit=2)
    assert counter.acquire("10.0.0.1") and counter.acquire("10.0.0.1")
    assert not counter.allow("10.0.0.1") and not counter.acquire("10.0.0.1")
    assert counter.allow("10.0.0.2") and counter.acquire("10.0.0.2")
    assert counter.acquire(None) and counter.acquire("relayed")  # no address: not counted
    counter.release("10.0.0.1")
    assert counter.count("10.0.0.1") == 1 and counter.acquire("10.0.0.1")
    counter.release("10.0.0.9")  # never counted: no effect
    assert counter.refused == 2
    with pytest.raises(ValueError):
        AddressCounter(limit=0)


def test_the_inbound_cap_leaves_three_quarters_of_the_open_file_limit():
    assert connections_within_fd_limit(1024, None) == 1024
    assert connections_within_fd_limit(1024, 1024) == 256
    assert connections_within_fd_limit(1024, 1 << 20) == 1024
    assert connections_within_fd_limit(1024, 2) == 1
    with pytest.raises(ValueError, match="max_inbound_connections_per_ip"):
        ResourceLimits(max_inbound_connections_per_ip=0)


async def _flood(stack: AsyncExitStack, victim: P2P, count: int) -> int:
    """``count`` fresh identities dial ``victim``; how many got a connection."""
    connected = 0
    for _ in range(count):
        crowd = await stack.enter_async_context(P2P.create(use_autonat=False))
        try:
            with trio.fail_after(5):
                await crowd.connect(victim.get_visible_maddrs()[0])
            connected += 1
        except Exception:
            pass  # refused: the victim closed it before the handshake
    return connected


async def _echo(request, context):
    return request


def _inbound(victim: P2P) -> int:
    return len(victim.get_connected_peers())


@pytest.mark.trio
async def test_identities_from_one_address_get_at_most_their_share_of_connections():
    limits = ResourceLimits(max_inbound_connections_per_ip=6)
    async with (
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False, limits=limits) as victim,
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False) as honest,
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False) as newcomer,
    ):
        for p2p in (victim, honest, newcomer):
            p2p.add_protobuf_handler("t::echo", _echo, BytesValue)
        # no host-wide stream semaphore: streams others open to us never queue our own calls
        assert victim.host.get_network()._stream_semaphore is None
        # an honest peer connected before the flood keeps its connection and its calls
        await honest.connect(victim.get_visible_maddrs()[0])
        reply = await honest.call_protobuf_handler(
            victim.peer_id, "t::echo", BytesValue(value=b"before"), BytesValue
        )
        assert reply.value == b"before"

        async with AsyncExitStack() as crowd:
            assert await _flood(crowd, victim, 14) == 5  # 6 from 127.0.0.1, one is honest's
            assert _inbound(victim) == 6
            assert victim.statistics()["inbound_connections_refused_per_ip"] >= 9
            reply = await honest.call_protobuf_handler(
                victim.peer_id, "t::echo", BytesValue(value=b"during"), BytesValue
            )
            assert reply.value == b"during"
            # our own dials are not inbound: the victim still reaches whom it wants
            await victim.connect(newcomer.get_visible_maddrs()[0])
            reply = await victim.call_protobuf_handler(
                newcomer.peer_id, "t::echo", BytesValue(value=b"out"), BytesValue
            )
            assert reply.value == b"out"
        # the crowd left: its slots are free again
        with trio.fail_after(10):
            await wait_until(lambda: _inbound(victim) <= 2)
        async with AsyncExitStack() as later:
            assert await _flood(later, victim, 3) == 3


@pytest.mark.trio
async def test_the_host_wide_inbound_cap_holds_and_is_released():
    limits = ResourceLimits(max_inbound_connections=5)
    async with P2P.create(host_maddrs=[LOOPBACK], use_autonat=False, limits=limits) as victim:
        async with AsyncExitStack() as crowd:
            await _flood(crowd, victim, 9)  # past the cap: closed after the handshake
            assert _inbound(victim) == 5
        with trio.fail_after(10):
            await wait_until(lambda: _inbound(victim) == 0)
        async with AsyncExitStack() as later:
            assert await _flood(later, victim, 5) == 5
            assert _inbound(victim) == 5


def test_libp2ps_own_connection_manager_agrees_with_our_limits():
    plain = build_connection_config(1024, auto_connect=False, grace_period=20.0)
    assert plain.max_connections - plain.min_connections > 1024  # its inbound cap never binds
    assert (plain.low_watermark, plain.high_watermark, plain.grace_period) == (0, 768, 20.0)
    dialling = build_connection_config(1024, auto_connect=True, grace_period=5.0)
    assert dialling.max_connections - dialling.min_connections > 1024
    assert (dialling.low_watermark, dialling.high_watermark) == (100, 300)  # py-libp2p's
    small = build_connection_config(8, auto_connect=True, grace_period=0.0)
    assert small.low_watermark <= small.high_watermark <= small.max_connections
    with pytest.raises(ValueError, match="connection_grace_period"):
        ResourceLimits(connection_grace_period=-1)


@pytest.mark.trio
async def test_connections_that_ended_give_their_inbound_slot_back():
    """py-libp2p kept each accepted connection's handler (and inbound slot) until the host
    stopped: its 300 slots were used up by 300 connect-and-disconnect cycles, after which the
    host refused every inbound connection. Here the cap is 3 and one peer cycles 8 times."""
    limits = ResourceLimits(max_inbound_connections=3)
    async with (
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False, limits=limits) as victim,
        P2P.create(use_autonat=False) as cycler,
    ):
        slots = victim.host.get_network()._inbound_limiter
        for _ in range(8):
            with trio.fail_after(5):
                await cycler.connect(victim.get_visible_maddrs()[0])
            await cycler.host.get_network().close_peer(victim.peer_id)
            with trio.fail_after(5):
                await wait_until(lambda: _inbound(victim) == 0 and slots.borrowed_tokens == 0)
        async with AsyncExitStack() as later:
            assert await _flood(later, victim, 3) == 3


async def _call_as_a_newcomer(stack: AsyncExitStack, victim: P2P) -> BytesValue:
    """A fresh identity dials ``victim`` and calls its echo handler."""
    newcomer = await stack.enter_async_context(P2P.create(use_autonat=False))
    with trio.fail_after(5):
        await newcomer.connect(victim.get_visible_maddrs()[0])
        return await newcomer.call_protobuf_handler(
            victim.peer_id, "t::echo", BytesValue(value=b"in"), BytesValue
        )


@pytest.mark.trio
async def test_idle_identities_at_the_cap_lose_their_slots_to_a_newcomer():
    """A crowd holds every inbound slot with idle connections; a newcomer's dial is refused,
    which makes the host close idle connections older than the grace period, so that the
    newcomer's next dial gets in and its calls are answered. A crowd member with a call in
    progress keeps its connection."""
    limits = ResourceLimits(
        max_inbound_connections=6, max_inbound_connections_per_ip=64, connection_grace_period=0.5
    )
    async with (
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False, limits=limits) as victim,
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False) as busy,
    ):
        release = trio.Event()

        async def slow_echo(request, context):
            await release.wait()
            return request

        victim.add_protobuf_handler("t::echo", _echo, BytesValue)
        victim.add_protobuf_handler("t::slow", slow_echo, BytesValue)
        async with trio.open_nursery() as nursery, AsyncExitStack() as crowd:
            await busy.connect(victim.get_visible_maddrs()[0])
            replies: list[bytes] = []

            async def busy_call() -> None:
                reply = await busy.call_protobuf_handler(
                    victim.peer_id, "t::slow", BytesValue(value=b"busy"), BytesValue
                )
                replies.append(reply.value)

            nursery.start_soon(busy_call)
            assert await _flood(crowd, victim, 5) == 5
            assert _inbound(victim) == 6  # at the cap: busy + 5 idle identities
            reply = None
            for _ in range(40):  # dials refused while the host is full make it trim
                try:
                    reply = await _call_as_a_newcomer(crowd, victim)
                    break
                except Exception:
                    await trio.sleep(0.25)
            assert reply is not None and reply.value == b"in"
            assert _inbound(victim) <= 6
            assert busy.peer_id in victim.get_connected_peers()  # its call still runs
            release.set()
        assert replies == [b"busy"]


@pytest.mark.trio
async def test_hosts_do_not_dial_peers_they_only_know_of():
    """py-libp2p's auto-connector dials the peerstore's peers until a host holds the midpoint
    of its watermarks (150 connections by default, even with a low watermark of 0): ours
    dial only whom they talk to, unless ``auto_connect=True`` asks for py-libp2p's way."""
    async with (
        P2P.create(host_maddrs=[LOOPBACK], use_autonat=False) as known,
        P2P.create(use_autonat=False) as ours,
        P2P.create(use_autonat=False, auto_connect=True) as dialling,
    ):
        for host in (ours, dialling):
            host.host.get_peerstore().add_addrs(
                known.peer_id, known.host.get_transport_addrs(), 600
            )
            with trio.fail_after(10):
                await host.host.get_network().auto_connector.maybe_connect()
        with trio.fail_after(10):
            await wait_until(lambda: known.peer_id in dialling.get_connected_peers())
        assert known.peer_id not in ours.get_connected_peers()
