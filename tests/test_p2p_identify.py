"""Identify runs toward peers we dialled, and toward a peer that dialled us only once we call it."""

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from polling import wait_until

from swarmtrain.p2p import P2P

pytestmark = pytest.mark.trio


async def echo(request, context):
    return request


def identified(host: P2P, peer) -> bool:
    return peer in host._host._identified_peers


async def test_a_listener_identifies_its_caller_only_when_it_calls_back():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler("test::Echo.echo", echo, BytesValue)
        b.add_protobuf_handler("test::Echo.echo", echo, BytesValue)
        request = BytesValue(value=b"x")
        await b.call_protobuf_handler(a.peer_id, "test::Echo.echo", request, BytesValue)
        # b dialled a: b identifies a; a, only called so far, learns nothing about b
        with trio.fail_after(10):
            await wait_until(lambda: identified(b, a.peer_id))
        await trio.sleep(0.3)
        assert not identified(a, b.peer_id)
        assert a.known_addrs(b.peer_id) == []
        # a's first call to b identifies b, so a could dial b again later
        await a.call_protobuf_handler(b.peer_id, "test::Echo.echo", request, BytesValue)
        with trio.fail_after(10):
            await wait_until(lambda: identified(a, b.peer_id))

        def without_peer_id(maddrs):
            return {m.rsplit("/p2p/", 1)[0] for m in maddrs}

        assert without_peer_id(a.known_addrs(b.peer_id)) >= without_peer_id(b.get_visible_maddrs())
