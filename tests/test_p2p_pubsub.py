"""Gossipsub between real py-libp2p hosts on loopback (TCP + Noise + Yamux), no mocks."""

import os
import time
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from google.protobuf.wrappers_pb2 import Int64Value
from libp2p.pubsub.pb import rpc_pb2
from libp2p.utils import encode_varint_prefixed
from polling import wait_until

from swarmtrain.p2p import P2P, MessageTooLargeError, P2PError
from swarmtrain.p2p.pubsub import (
    DEFAULT_MAX_MESSAGE_SIZE,
    GOSSIPSUB_PROTOCOLS,
    MAX_MESSAGE_SIZE_LIMIT,
    PubSub,
    PubSubConfig,
)

pytestmark = pytest.mark.trio

TOPIC = "swarmtrain/test/progress"
MESH_TIMEOUT = 10.0


@asynccontextmanager
async def open_hosts(count: int, *, chain: bool = False):
    """``count`` hosts: a star around the first one, or a chain 0-1-2-..."""
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(P2P.create())]
        for _ in range(count - 1):
            hub = hosts[-1] if chain else hosts[0]
            hosts.append(
                await stack.enter_async_context(P2P.create(initial_peers=hub.get_visible_maddrs()))
            )
        yield hosts


@asynccontextmanager
async def open_pubsubs(hosts, **settings):
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(PubSub.create(h, **settings)) for h in hosts]


async def receive_all(sub, count: int, within: float = 10.0) -> list:
    """Up to ``count`` messages, as many as arrive ``within`` seconds."""
    messages = []
    with trio.move_on_after(within):
        while len(messages) < count:
            messages.append(await sub.receive())
    return messages


def pubsub_tasks() -> list[str]:
    """Names of running tasks with a pubsub frame anywhere in their await chain."""
    found, stack = [], [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
        coro = task.coro
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                break
            filename = frame.f_code.co_filename.replace(os.sep, "/")
            if filename.endswith(("libp2p/pubsub/pubsub.py", "swarmtrain/p2p/pubsub.py")):
                found.append(task.name)
                break
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return found


async def test_delivery_to_three_subscribers_through_relaying_peers():
    # a - b - c - d: c and d hear a only through the peers between them; d connects after
    # every PubSub started, the others were connected before.
    async with open_hosts(3, chain=True) as (a, b, c), P2P.create() as d:
        async with open_pubsubs([a, b, c, d]) as (pa, pb, pc, pd):
            subs = [await p.subscribe(TOPIC) for p in (pa, pb, pc, pd)]
            await d.connect(c.get_visible_maddrs()[0])
            with trio.fail_after(MESH_TIMEOUT):
                for pubsub, neighbours in ((pa, 1), (pb, 2), (pc, 2), (pd, 1)):
                    await pubsub.wait_mesh_peers(TOPIC, neighbours)
            assert not d.is_connected(a.peer_id) and not d.is_connected(b.peer_id)

            await pa.publish(TOPIC, b"epoch 7")
            for sub in subs[1:]:
                with trio.fail_after(5):
                    msg = await sub.receive()
                assert (msg.topic, msg.data, msg.sender) == (TOPIC, b"epoch 7", a.peer_id)

            await pd.publish_protobuf(TOPIC, Int64Value(value=42))
            with trio.fail_after(5):
                msg = await subs[0].receive()
            assert msg.sender == d.peer_id and Int64Value.FromString(msg.data).value == 42
            # our own "epoch 7" was published first but is not delivered back to us
            with pytest.raises(trio.WouldBlock):
                subs[0].receive_nowait()
            assert pa.statistics().published == 1 and pa.statistics().delivered == 1
            assert pd.statistics().delivered == 1  # "epoch 7"; its own message is not echoed


async def test_burst_is_delivered_to_every_subscriber():
    burst = 150
    async with open_hosts(4) as hosts, open_pubsubs(hosts) as pubsubs:
        subs = [await p.subscribe(TOPIC) for p in pubsubs[1:]]
        with trio.fail_after(MESH_TIMEOUT):
            await pubsubs[0].wait_topic_peers(TOPIC, 3)  # it publishes without subscribing
        started = time.monotonic()
        for i in range(burst):
            await pubsubs[0].publish(TOPIC, b"%d" % i)
        published = time.monotonic() - started
        received: list[list[bytes]] = [[] for _ in subs]

        async def drain(i, sub):
            received[i] = [m.data for m in await receive_all(sub, burst)]

        async with trio.open_nursery() as nursery:
            for i, sub in enumerate(subs):
                nursery.start_soon(drain, i, sub)
        elapsed = time.monotonic() - started
        print(
            f"{burst} messages to 3 subscribers: published {published:.2f} s, all {elapsed:.2f} s"
        )
        for data in received:
            assert sorted(data, key=int) == [b"%d" % i for i in range(burst)]
        stats = pubsubs[0].statistics()
        assert (stats.published, stats.outbound_dropped, stats.rate_limited) == (burst, 0, 0)
        assert all(p.statistics().dropped == 0 for p in pubsubs)


async def test_py_libp2p_defaults_drop_most_of_a_burst():
    # The measured failure, kept as a check that the counters see it: 10 messages per second
    # per topic and 32-slot queues (py-libp2p's defaults) let 10 of 50 through, never repaired.
    settings = dict(max_messages_per_topic_per_second=10, outbound_queue_size=32)
    async with open_hosts(2) as hosts, open_pubsubs(hosts, **settings) as (pa, pb):
        sub = await pb.subscribe(TOPIC)
        with trio.fail_after(MESH_TIMEOUT):
            await pa.wait_topic_peers(TOPIC, 1)
        for i in range(50):
            await pa.publish(TOPIC, b"%d" % i)
        limited = pa.statistics().rate_limited
        assert limited >= 30  # 40 unless publishing took over a second
        assert len(await receive_all(sub, 50, within=0.5)) == 50 - limited


async def test_slow_consumer_loses_the_oldest_messages():
    async with open_hosts(2) as hosts, open_pubsubs(hosts) as (pa, pb):
        sub = await pb.subscribe(TOPIC, buffer_size=10)
        other = await pb.subscribe(TOPIC)  # a second subscription to the same topic
        with trio.fail_after(MESH_TIMEOUT):
            await pa.wait_topic_peers(TOPIC, 1)
        for i in range(50):
            await pa.publish(TOPIC, b"%d" % i)
        assert len(await receive_all(other, 50)) == 50  # the router never waited for `sub`
        assert [m.data for m in await receive_all(sub, 10)] == [b"%d" % i for i in range(40, 50)]
        assert sub.statistics().dropped == 40 and pb.statistics().dropped == 40
        await sub.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await sub.receive()
        assert TOPIC in pb.statistics().topics  # `other` still subscribes


async def test_size_limit_raises_on_publish_and_the_limit_itself_is_delivered():
    with pytest.raises(ValueError, match="max_message_size"):
        PubSubConfig(max_message_size=MAX_MESSAGE_SIZE_LIMIT + 1)
    async with open_hosts(3) as (a, b, c):
        async with (
            PubSub.create(a, max_message_size=MAX_MESSAGE_SIZE_LIMIT) as pa,
            PubSub.create(b, max_message_size=MAX_MESSAGE_SIZE_LIMIT) as pb,
            PubSub.create(c) as pc,
        ):
            sub_b, sub_c = await pb.subscribe(TOPIC), await pc.subscribe(TOPIC)
            with trio.fail_after(MESH_TIMEOUT):
                await pa.wait_topic_peers(TOPIC, 2)
            with pytest.raises(MessageTooLargeError):
                await pc.publish(TOPIC, bytes(DEFAULT_MAX_MESSAGE_SIZE + 1))
            with pytest.raises(MessageTooLargeError):
                await pa.publish(TOPIC, bytes(MAX_MESSAGE_SIZE_LIMIT + 1))
            assert pc.statistics().published == pa.statistics().published == 0

            big = os.urandom(MAX_MESSAGE_SIZE_LIMIT)  # the largest allowed still fits a frame
            await pa.publish(TOPIC, big)
            with trio.fail_after(10):
                assert (await sub_b.receive()).data == big
            # c's limit is lower: it rejects the message instead of delivering it
            await pa.publish(TOPIC, b"small")
            with trio.fail_after(5):
                assert (await sub_c.receive()).data == b"small"
            assert pc.statistics().rejected == 1


async def test_unsubscribe_and_close_leave_no_tasks():
    async with open_hosts(3) as hosts:
        async with open_pubsubs(hosts) as (pa, pb, pc):
            subs = [await p.subscribe(TOPIC) for p in (pb, pc)]
            with trio.fail_after(MESH_TIMEOUT):
                await pa.wait_topic_peers(TOPIC, 2)
            assert pubsub_tasks()  # stream readers in the hosts' task groups, among others
            await subs[1].aclose()
            with trio.fail_after(5):
                await wait_until(lambda: hosts[2].peer_id not in pa.topic_peers(TOPIC))
            await pa.publish(TOPIC, b"after unsubscribe")
            with trio.fail_after(5):
                assert (await subs[0].receive()).data == b"after unsubscribe"
            assert pc.statistics().delivered == 0
        with pytest.raises(trio.EndOfChannel):
            await subs[0].receive()
        with pytest.raises(P2PError):
            await pa.publish(TOPIC, b"closed")
        with trio.move_on_after(5):
            await wait_until(lambda: not pubsub_tasks())
        assert pubsub_tasks() == []
        # the host still works, and pubsub can start again on it
        async with open_pubsubs(hosts[:2]) as (pa, pb):
            sub = await pb.subscribe(TOPIC)
            with trio.fail_after(MESH_TIMEOUT):
                await pa.wait_topic_peers(TOPIC, 1)
            await pa.publish(TOPIC, b"again")
            with trio.fail_after(5):
                assert (await sub.receive()).data == b"again"


async def test_garbage_from_a_peer_does_not_crash_subscribers():
    async with open_hosts(2) as (a, b), open_pubsubs([a, b]) as (pa, pb):
        raw = await pb.subscribe(TOPIC)
        typed = await pb.subscribe(TOPIC, protobuf_type=Int64Value)
        with trio.fail_after(MESH_TIMEOUT):
            await pa.wait_topic_peers(TOPIC, 1)

        # 1. a frame that is not a protobuf at all
        stream = await a.new_stream(b.peer_id, GOSSIPSUB_PROTOCOLS[0])
        await stream.write(encode_varint_prefixed(b"\xff" * 64))
        # 2. a well-formed RPC whose message claims an undecodable key and a bad signature
        bogus = rpc_pb2.Message(
            from_id=b"\x00\x01garbage",
            data=b"x",
            seqno=b"\x00" * 8,
            topicIDs=[TOPIC],
            signature=b"\x01" * 64,
            key=b"\x02" * 40,
        )
        stream2 = await a.new_stream(b.peer_id, GOSSIPSUB_PROTOCOLS[0])
        await stream2.write(
            encode_varint_prefixed(rpc_pb2.RPC(publish=[bogus]).SerializeToString())
        )
        # 3. a valid message whose payload is not an Int64Value
        await pa.publish(TOPIC, b"\xff\xff\xff")
        await pa.publish_protobuf(TOPIC, Int64Value(value=5))

        with trio.fail_after(5):
            assert [m.data for m in await receive_all(raw, 2)] == [b"\xff\xff\xff", b"\x08\x05"]
            msg = await typed.receive()
        assert msg.message == Int64Value(value=5)
        assert typed.statistics().malformed == 1
        with trio.fail_after(5):
            await wait_until(lambda: pb.statistics().rejected >= 2)
        # b's pubsub is still alive and still hears a
        await pa.publish_protobuf(TOPIC, Int64Value(value=6))
        with trio.fail_after(5):
            assert (await typed.receive()).message.value == 6


async def test_one_pubsub_per_host_and_bad_arguments():
    async with P2P.create() as a, PubSub.create(a) as pa:
        with pytest.raises(P2PError):
            async with PubSub.create(a):
                pass
        with pytest.raises(ValueError):
            await pa.publish("", b"x")
        with pytest.raises(TypeError):
            await pa.publish(TOPIC, "not bytes")
        with pytest.raises(ValueError):
            PubSubConfig(heartbeat_interval=0)


async def test_a_peer_that_talks_to_us_one_way_gets_our_stream_back():
    """A failed first attach (e.g. while the other pubsub was still starting) left a peer whose
    stream reaches us but ours none to it: it heard nothing we published, for good. The
    state is made here by dropping a's registration of b (b's stream to a stays open)."""
    async with open_hosts(2) as (a, b), open_pubsubs([a, b]) as (pa, pb):
        sub = await pb.subscribe(TOPIC)
        inner = pa._pubsub
        with trio.fail_after(MESH_TIMEOUT):
            await wait_until(lambda: b.peer_id in inner.peer_topics.get(TOPIC, ()))
        inner.peers.pop(b.peer_id)  # a forgets its stream to b, as if its attach had failed
        inner.peer_queues.pop(b.peer_id).close()
        inner.router.remove_peer(b.peer_id)
        assert inner.one_way_peers() == {b.peer_id}
        with trio.fail_after(MESH_TIMEOUT):
            await wait_until(lambda: not inner.one_way_peers())
        await pa.publish(TOPIC, b"heard")
        with trio.fail_after(5):
            msg = await sub.receive()
        assert (msg.data, msg.sender) == (b"heard", a.peer_id)
