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
