"""Typed RPC between real py-libp2p hosts on loopback (TCP + Noise + Yamux)."""

import random
import time

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value, StringValue

from swarmtrain.p2p import (
    P2P,
    MessageTooLargeError,
    NoSuchMethodError,
    PeerUnreachableError,
    RemoteError,
    RPCCancelledError,
    RPCTimeoutError,
)
from swarmtrain.p2p.identity import generate_identity, peer_id_of
from swarmtrain.p2p.rpc import RPC_PROTOCOL_ID

pytestmark = pytest.mark.trio


async def reverse(request, context):
    return StringValue(value=request.value[::-1])


async def whoami(request, context):
    return StringValue(value=str(context.remote_id))


async def fail(request, context):
    raise KeyError(f"no such key {request.value}")


async def count_to(request, context):
    for i in range(request.value):
        yield Int64Value(value=i)


async def total_size(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


async def echo_each(requests, context):
    async for request in requests:
        yield StringValue(value=request.value.upper())


def serve_all(p2p):
    p2p.add_protobuf_handler("test::Demo.reverse", reverse, StringValue)
    p2p.add_protobuf_handler("test::Demo.whoami", whoami, StringValue)
    p2p.add_protobuf_handler("test::Demo.fail", fail, StringValue)
    p2p.add_protobuf_handler("test::Demo.count_to", count_to, Int64Value, stream_output=True)
    p2p.add_protobuf_handler("test::Demo.total_size", total_size, BytesValue, stream_input=True)
    p2p.add_protobuf_handler(
        "test::Demo.echo_each", echo_each, StringValue, stream_input=True, stream_output=True
    )


async def test_unary_between_three_peers():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        serve_all(b)
        async with P2P.create(initial_peers=a.get_visible_maddrs() + b.get_visible_maddrs()) as c:
            for server in (a, b):
                reply = await c.call_protobuf_handler(
                    server.peer_id, "test::Demo.reverse", StringValue(value="swarm"), StringValue
                )
                assert reply.value == "mraws"
                who = await c.call_protobuf_handler(
                    server.peer_id, "test::Demo.whoami", StringValue(), StringValue
                )
                assert who.value == str(c.peer_id)
            # b was told about a; b calls a the other way round
            reply = await b.call_protobuf_handler(
                a.peer_id, "test::Demo.reverse", StringValue(value="ab"), StringValue
            )
            assert reply.value == "ba"
            assert set(c.get_connected_peers()) == {a.peer_id, b.peer_id}


async def test_streaming_shapes():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        async with b.iterate_protobuf_handler(
            a.peer_id, "test::Demo.count_to", Int64Value(value=100), Int64Value
        ) as responses:
            assert [r.value async for r in responses] == list(range(100))

        async def requests():
            for size in (0, 1, 10, 100_000):
                yield BytesValue(value=b"x" * size)

        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.total_size", requests(), Int64Value, stream_input=True
        )
        assert reply.value == 100_011
        words = [StringValue(value=w) for w in ("a", "bc", "def")]
        async with b.iterate_protobuf_handler(
            a.peer_id, "test::Demo.echo_each", words, StringValue, stream_input=True
        ) as responses:
            assert [r.value async for r in responses] == ["A", "BC", "DEF"]


async def test_remote_errors_are_typed():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        with pytest.raises(RemoteError) as info:
            await b.call_protobuf_handler(
                a.peer_id, "test::Demo.fail", StringValue(value="k1"), StringValue
            )
        assert info.value.error_type == "KeyError"
        assert "no such key k1" in info.value.remote_message
        with pytest.raises(NoSuchMethodError):
            await b.call_protobuf_handler(a.peer_id, "test::Demo.nope", StringValue(), StringValue)
        # the connection survives errors
        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.reverse", StringValue(value="ok"), StringValue
        )
        assert reply.value == "ko"


async def test_timeout_cancels_the_remote_handler():
    handler_started, handler_cancelled = trio.Event(), trio.Event()

    async def hang(request, context):
        handler_started.set()
        try:
            await trio.sleep_forever()
        finally:
            handler_cancelled.set()

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler("test::Demo.hang", hang, StringValue)
        with pytest.raises(RPCTimeoutError):
            await b.call_protobuf_handler(
                a.peer_id, "test::Demo.hang", StringValue(), StringValue, timeout=0.5
            )
        assert handler_started.is_set()
        with trio.fail_after(5):
            await handler_cancelled.wait()


async def test_caller_cancellation_cancels_the_remote_stream_handler():
    sent, cancelled = [], trio.Event()

    async def endless(request, context):
        try:
            i = 0
            while True:
                sent.append(i)
                yield Int64Value(value=i)
                i += 1
                await trio.sleep(0.01)
        finally:
            cancelled.set()

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler("test::Demo.endless", endless, Int64Value, stream_output=True)
        async with b.iterate_protobuf_handler(
            a.peer_id, "test::Demo.endless", Int64Value(), Int64Value
        ) as responses:
            async for response in responses:
                if response.value == 5:
                    break
        with trio.fail_after(5):
            await cancelled.wait()
        count = len(sent)
        await trio.sleep(0.2)
        assert len(sent) == count  # the handler really stopped


async def test_callee_shutdown_reaches_the_caller():
    started = trio.Event()

    async def slow(request, context):
        started.set()
        await trio.sleep_forever()

    async with P2P.create() as b, trio.open_nursery() as nursery:
        a_scope = trio.CancelScope()

        async def run_a(task_status=trio.TASK_STATUS_IGNORED):
            with a_scope:
                async with P2P.create() as a:
                    a.add_protobuf_handler("test::Demo.slow", slow, StringValue)
                    task_status.started(a)
                    await trio.sleep_forever()

        a = await nursery.start(run_a)
        b.add_addrs(a.peer_id, a.get_visible_maddrs())

        async def close_a_later():
            await started.wait()
            a_scope.cancel()

        nursery.start_soon(close_a_later)
        # a call in flight is told (an idle stream learns it from the connection)
        with trio.fail_after(10), pytest.raises(RPCCancelledError, match="shutting down"):
            await b.call_protobuf_handler(
                a.peer_id, "test::Demo.slow", StringValue(), StringValue, timeout=None
            )


async def test_message_size_limits_on_both_sides():
    async with (
        P2P.create() as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), max_message_size=50_000) as b,
    ):
        a.add_protobuf_handler(
            "test::Demo.small", total_size, BytesValue, stream_input=True, max_message_size=1000
        )

        async def big_reply(request, context):
            return BytesValue(value=b"z" * request.value)

        a.add_protobuf_handler("test::Demo.big_reply", big_reply, Int64Value)
        # the receiver (a) refuses a request over its handler's limit
        with pytest.raises(MessageTooLargeError, match="1000"):
            await b.call_protobuf_handler(
                a.peer_id,
                "test::Demo.small",
                [BytesValue(value=b"x" * 5000)],
                Int64Value,
                stream_input=True,
            )
        # the sender (b) refuses to send over its own limit, before dialling
        with pytest.raises(MessageTooLargeError):
            await b.call_protobuf_handler(
                a.peer_id, "test::Demo.reverse", StringValue(value="y" * 60_000), StringValue
            )
        # the caller (b) refuses a response over its limit
        with pytest.raises(MessageTooLargeError):
            await b.call_protobuf_handler(
                a.peer_id, "test::Demo.big_reply", Int64Value(value=60_000), BytesValue
            )
        ok = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.big_reply", Int64Value(value=40_000), BytesValue
        )
        assert len(ok.value) == 40_000


async def test_unreachable_peers_fail_fast():
    async with P2P.create(dial_timeout=3.0) as a:
        unknown = peer_id_of(generate_identity())
        started = time.monotonic()
        with pytest.raises(PeerUnreachableError, match="no known addresses"):
            await a.call_protobuf_handler(unknown, "x::Y.z", StringValue(), StringValue)
        # a closed port on loopback: refused at once, well before dial_timeout
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        a.add_addrs(unknown, [f"/ip4/127.0.0.1/tcp/{port}"])
        with pytest.raises(PeerUnreachableError):
            await a.call_protobuf_handler(unknown, "x::Y.z", StringValue(), StringValue)
        assert time.monotonic() - started < 2.5
        # a refused dial is retried once, quickly (py-libp2p's default: 3 times over 0.7 s)
        retry = a.host.get_network().retry_config
        assert retry.max_retries == 1 and retry.initial_delay <= 0.1


@pytest.mark.parametrize("bulk", [False, True])
async def test_a_cancelled_stream_input_call_closes_its_request_generator(bulk):
    closed = trio.Event()

    async def requests():
        try:
            for _ in range(10_000):
                yield BytesValue(value=b"x" * 100_000)
        finally:
            closed.set()

    async def read_one_then_hang(incoming, context):
        async for _ in incoming:
            break
        await trio.sleep_forever()
        return Int64Value()

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler("test::Demo.hang", read_one_then_hang, BytesValue, stream_input=True)
        with trio.move_on_after(1.0):  # the sender is blocked by flow control by then
            await b.call_protobuf_handler(
                a.peer_id,
                "test::Demo.hang",
                requests(),
                Int64Value,
                stream_input=True,
                timeout=None,
                bulk=bulk,
            )
        assert closed.is_set()  # closed by the call, not left to the garbage collector


async def test_garbage_on_a_stream_is_rejected_and_others_keep_working():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        for garbage in (b"\xff" * 64, b"\x05hello world", b"\x02\x08\x02" + b"\x00" * 10):
            stream = await b.new_stream(a.peer_id, RPC_PROTOCOL_ID)
            await stream.write(garbage)
            with trio.fail_after(5):
                data = b""
                try:
                    while chunk := await stream.read(1024):
                        data += chunk
                except Exception:
                    pass  # closed or reset: either way the callee gave up on this stream
            await stream.close()
        # an oversized request header is refused before the callee allocates anything
        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.reverse", StringValue(value="still fine"), StringValue
        )
        assert reply.value == "enif llits"


async def test_many_concurrent_calls():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        results = {}

        async def one(i):
            reply = await b.call_protobuf_handler(
                a.peer_id, "test::Demo.reverse", StringValue(value=f"{i:04d}"), StringValue
            )
            results[i] = reply.value

        async def stream_one(i):
            async with b.iterate_protobuf_handler(
                a.peer_id, "test::Demo.count_to", Int64Value(value=i % 7), Int64Value
            ) as responses:
                assert [r.value async for r in responses] == list(range(i % 7))

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
                nursery.start_soon(stream_one, i)
        assert results == {i: f"{i:04d}"[::-1] for i in range(100)}


async def echo_bytes(request, context):
    return BytesValue(value=request.value)


async def test_calls_cancelled_at_random_moments_leave_the_connection_usable():
    """A call cancelled while py-libp2p writes a frame used to kill the whole connection (a
    skipped Noise nonce or a half-sent frame), after which every call to the peer failed."""
    generator = random.Random(5)
    payload = BytesValue(value=bytes(200_000))
    errors: list[Exception] = []
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        b.add_protobuf_handler("test::Demo.echo", echo_bytes, BytesValue)
        await a.call_protobuf_handler(b.peer_id, "test::Demo.echo", payload, BytesValue)
        (connection,) = a._host.get_network().connections[b.peer_id]

        async def call_cancelled_soon():
            with trio.move_on_after(generator.random() * 0.01):
                try:
                    await a.call_protobuf_handler(b.peer_id, "test::Demo.echo", payload, BytesValue)
                except Exception as e:
                    errors.append(e)

        for _ in range(30):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(call_cancelled_soon)
        reply = await a.call_protobuf_handler(b.peer_id, "test::Demo.echo", payload, BytesValue)
        assert reply.value == payload.value
        assert errors == []
        assert a._host.get_network().connections[b.peer_id] == [connection]
        assert not connection.is_closed


async def test_a_dead_connection_is_redialled():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        b.add_protobuf_handler("test::Demo.echo", echo_bytes, BytesValue)
        request = BytesValue(value=b"ping")
        await a.call_protobuf_handler(b.peer_id, "test::Demo.echo", request, BytesValue)
        (connection,) = a._host.get_network().connections[b.peer_id]
        # corrupt the connection as a lost frame would: spend one Noise nonce, so b cannot
        # decrypt anything a sends on it and closes it
        connection.muxed_conn.secured_conn.conn.encrypt(b"lost")
        for _ in range(3):
            reply = await a.call_protobuf_handler(b.peer_id, "test::Demo.echo", request, BytesValue)
            assert reply.value == b"ping"
        assert connection.is_closed
        assert a.is_connected(b.peer_id)


async def test_bad_registrations_raise():
    async with P2P.create() as a:
        with pytest.raises(TypeError):
            a.add_protobuf_handler("x::Y.z", reverse, dict)
        a.add_protobuf_handler("x::Y.z", reverse, StringValue)
        with pytest.raises(ValueError, match="already registered"):
            a.add_protobuf_handler("x::Y.z", reverse, StringValue)

        def not_async(request, context):
            return request

        with pytest.raises(TypeError, match="async"):
            a.add_protobuf_handler("x::Y.w", not_async, StringValue)


async def test_websocket_transport_interoperates_with_tcp():
    async with P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0/ws"]) as ws_peer:
        (addr,) = ws_peer.get_visible_maddrs()
        assert "/ws/" in addr and "/tcp/0/" not in addr
        serve_all(ws_peer)
        # a TCP-listening peer dials the WebSocket one when asked to
        async with P2P.create(initial_peers=[addr], enable_websocket=True) as tcp_peer:
            reply = await tcp_peer.call_protobuf_handler(
                ws_peer.peer_id, "test::Demo.reverse", StringValue(value="ws"), StringValue
            )
            assert reply.value == "sw"
            async with tcp_peer.iterate_protobuf_handler(
                ws_peer.peer_id, "test::Demo.count_to", Int64Value(value=3), Int64Value
            ) as responses:
                assert [r.value async for r in responses] == [0, 1, 2]


async def test_back_to_back_calls_reuse_streams_and_survive_a_restarted_callee(tmp_path):
    key = str(tmp_path / "callee.key")
    async with P2P.create() as b:
        async with P2P.create(identity_path=key) as a:
            serve_all(a)
            address = a.get_visible_maddrs()[0]
            await b.connect(address)
            for i in range(20):
                reply = await b.call_protobuf_handler(
                    a.peer_id, "test::Demo.reverse", StringValue(value=f"n{i}"), StringValue
                )
                assert reply.value == f"n{i}"[::-1]
            # errors and streaming calls in between do not poison pooled streams
            with pytest.raises(RemoteError):
                await b.call_protobuf_handler(
                    a.peer_id, "test::Demo.fail", StringValue(value="x"), StringValue
                )
            async with b.iterate_protobuf_handler(
                a.peer_id, "test::Demo.count_to", Int64Value(value=3), Int64Value
            ) as responses:
                assert [r.value async for r in responses] == [0, 1, 2]
            reply = await b.call_protobuf_handler(
                a.peer_id, "test::Demo.reverse", StringValue(value="ok"), StringValue
            )
            stats = b.statistics()
            assert stats["rpc_streams_reused"] >= 19, stats
            assert stats["rpc_streams_opened"] <= 4, stats
        # The callee restarts with the same identity and address: b's pooled streams are dead,
        # and its next call still works (a fresh stream over a fresh connection).
        async with P2P.create(
            identity_path=key, host_maddrs=[address.split("/p2p/")[0]]
        ) as restarted:
            serve_all(restarted)
            reply = await b.call_protobuf_handler(
                restarted.peer_id, "test::Demo.reverse", StringValue(value="again"), StringValue
            )
            assert reply.value == "niaga"


async def first_two(requests, context):
    """Answers after two request messages and leaves the rest of the request unread."""
    for _ in range(2):
        request = await requests.__anext__()
        yield Int64Value(value=request.value)


async def test_handler_that_stops_reading_early_leaves_the_pooled_stream_usable():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler(
            "test::Demo.first_two", first_two, Int64Value, stream_input=True, stream_output=True
        )
        for k in range(30):
            requests = [Int64Value(value=10 * k + i) for i in range(4)]
            async with b.iterate_protobuf_handler(
                a.peer_id, "test::Demo.first_two", requests, Int64Value, stream_input=True
            ) as responses:
                assert [r.value async for r in responses] == [10 * k, 10 * k + 1]
        stats = b.statistics()
        assert stats["rpc_streams_reused"] >= 20, stats


async def test_closing_hosts_leaves_no_tasks_behind():
    def descendants(task):
        out = []
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                out.append(child)
                out += descendants(child)
        return out

    root = trio.lowlevel.current_root_task()
    before = {id(t) for t in descendants(root)}
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        await b.call_protobuf_handler(a.peer_id, "test::Demo.reverse", StringValue(), StringValue)
        async with b.iterate_protobuf_handler(
            a.peer_id, "test::Demo.count_to", Int64Value(value=2), Int64Value
        ) as responses:
            assert [r.value async for r in responses] == [0, 1]
        assert len(descendants(root)) > len(before)
    for _ in range(10):
        await trio.sleep(0.01)
    leftover = [t.name for t in descendants(root) if id(t) not in before]
    assert leftover == []


@pytest.mark.parametrize("pace", ["crawling", "stopped"])
async def test_a_request_message_is_idle_only_when_its_bytes_stop(pace):
    """The callee's ``request_idle_timeout`` (here 0.5 s) ends a call whose request message
    stops arriving, not one whose message takes longer than that because it crawls in (a
    large message over a lossy long path, issue 18): bytes arriving are progress."""
    from swarmtrain.p2p.framing import encode_header, message_header
    from swarmtrain.p2p.rpc_stream import RPCStream
    from swarmtrain.proto import p2p_pb2

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve_all(a)
        a._rpc_server.request_idle_timeout = 0.5
        payload = BytesValue(value=b"x" * 100_000).SerializeToString()
        open_frame = p2p_pb2.RPCFrameHeader(
            kind=p2p_pb2.RPCFrameHeader.OPEN, method="test::Demo.total_size"
        )
        end = encode_header(p2p_pb2.RPCFrameHeader(kind=p2p_pb2.RPCFrameHeader.END))
        wire = encode_header(open_frame) + message_header(len(payload)) + payload + end
        stream = await b.new_stream(a.peer_id, RPC_PROTOCOL_ID)
        pieces = [wire[i : i + 5_000] for i in range(0, len(wire), 5_000)]
        if pace == "stopped":
            pieces = pieces[: len(pieces) // 2]
        started = trio.current_time()
        for piece in pieces:  # 0.1 s apart: the whole message takes ~2 s, 4x the timeout
            await stream.write(piece)
            await trio.sleep(0.1)
        reader = RPCStream(stream, 1 << 20)
        with trio.fail_after(5):
            frame = await reader.receive_frame() if pace == "crawling" else None
            if pace == "stopped":  # given up on 0.5 s after the last bytes: the stream ends
                last_write = trio.current_time()
                assert await reader.receive_frame() is None
                assert trio.current_time() - last_write < 2.0
        if pace == "crawling":
            assert trio.current_time() - started > 4 * a._rpc_server.request_idle_timeout
            assert Int64Value.FromString(bytes(frame.payload)).value == 100_000
        await stream.close()
