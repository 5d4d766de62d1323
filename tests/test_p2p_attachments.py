"""RPC attachments (ATTACHED_MESSAGE frames): the sans-IO decoder, lane reads straight into a
buffer, and real hosts exchanging ``Attached`` items over libp2p streams and data lanes."""

import os

import numpy as np
import pytest
import trio
from google.protobuf.wrappers_pb2 import Int64Value
from lane_util import lane_over_socketpair

from swarmtrain.p2p import (
    P2P,
    Attached,
    MessageTooLargeError,
    RPCCancelledError,
    RPCError,
    RPCProtocolError,
)
from swarmtrain.p2p.framing import (
    FrameDecoder,
    FrameKind,
    attached_message_header,
    encode_header,
    message_header,
)
from swarmtrain.p2p.lane_records import MAX_RECORD_PLAINTEXT, RecordSealer
from swarmtrain.p2p.rpc_stream import RPCStream
from swarmtrain.proto import p2p_pb2

END = encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.END))

# ------------------------------------------------------------------ decoder (sans-IO)


def test_attached_frames_round_trip_split_at_every_byte():
    attachment = bytes(range(200))
    wire = (
        attached_message_header(5, len(attachment))
        + b"hello"
        + attachment
        + message_header(2)
        + b"hi"
        + attached_message_header(0, 3)
        + b"xyz"
        + END
    )
    for split in range(len(wire) + 1):
        decoder = FrameDecoder(max_payload_size=1000)
        got = []
        for piece in (wire[:split], wire[split:]):
            decoder.feed(piece)
            while True:
                if decoder.attachment_pending:
                    if not decoder.attachment_complete:
                        if decoder.writable() is None:
                            decoder.begin_attachment()
                        if not decoder.attachment_complete:
                            break
                    got.append(("attachment", bytes(decoder.take_attachment())))
                    continue
                frame = decoder.next_frame()
                if frame is None:
                    break
                got.append((frame.kind, bytes(frame.payload), frame.attachment_size))
        assert got == [
            (FrameKind.ATTACHED_MESSAGE, b"hello", 200),
            ("attachment", attachment),
            (FrameKind.MESSAGE, b"hi", 0),
            (FrameKind.ATTACHED_MESSAGE, b"", 3),
            ("attachment", b"xyz"),
            (FrameKind.END, b"", 0),
        ], split
        assert not decoder.in_frame


def test_attachment_fills_the_callers_buffer_in_place():
    decoder = FrameDecoder(max_payload_size=1 << 20)
    decoder.feed(attached_message_header(1, 1000) + b"m" + b"\x07" * 10)
    assert decoder.next_frame().attachment_size == 1000
    # the attachment comes first (a typed error: a server whose receive of it failed part-way
    # and that reads on reports a protocol error, not an unexpected failure)
    with pytest.raises(RPCProtocolError, match="not taken"):
        decoder.next_frame()
    with pytest.raises(ValueError, match="1000 bytes"):
        decoder.begin_attachment(np.empty(999, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        decoder.begin_attachment(bytes(1000))
    target = np.zeros(1000, np.uint8)
    assert decoder.begin_attachment(target) is target
    assert decoder.in_frame and not decoder.attachment_complete
    view = decoder.writable()  # a reader receives straight into the rest
    assert len(view) == 990
    view[:990] = b"\x09" * 990
    decoder.advance(990)
    assert decoder.take_attachment() is target
    assert target[:10].tolist() == [7] * 10 and target[10:].tolist() == [9] * 990
    assert not decoder.in_frame and decoder.next_frame() is None


def test_attachment_sizes_are_checked_before_buffering():
    decoder = FrameDecoder(max_payload_size=100)
    decoder.feed(attached_message_header(50, 51))
    with pytest.raises(MessageTooLargeError):
        decoder.next_frame()
    decoder = FrameDecoder(max_payload_size=100)
    decoder.feed(
        encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.MESSAGE, attachment_size=4)) + b"abcd"
    )
    with pytest.raises(RPCProtocolError, match="attachment"):
        decoder.next_frame()


# ------------------------------------------------------------------ streams


class _FakeStream:
    """A byte stream fed from a list of chunks; EOF after the last one."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    async def read(self, n=None):
        await trio.lowlevel.checkpoint()
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.trio
async def test_a_stream_cut_inside_an_attachment_is_the_peer_giving_up():
    """A peer that ends its side after part of an attachment gave up on the call (a caller
    past its deadline closes its stream so): a cancellation, not a protocol violation."""
    wire = attached_message_header(1, 1000) + b"m" + b"\x01" * 600
    stream = RPCStream(_FakeStream([wire[:300], wire[300:]]), max_message_size=1 << 20)
    frame = await stream.receive_frame()
    assert frame.kind == FrameKind.ATTACHED_MESSAGE
    with pytest.raises(RPCCancelledError, match=r"middle of an attachment \(400 bytes were still"):
        await stream.receive_attachment()
    assert not stream.is_reusable()


async def _send_all(sock, data):
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


@pytest.mark.trio
async def test_lane_decrypts_records_straight_into_the_buffer():
    key = os.urandom(32)
    lane, sock_b = lane_over_socketpair(key)
    sealer = RecordSealer(key)
    try:
        data = os.urandom(2 * MAX_RECORD_PLAINTEXT + 300)
        wire = b"".join(bytes(r) for r in sealer.seal(data)) + sealer.seal_end()
        target = np.zeros(len(data) - 100, np.uint8)
        counts, view = [], memoryview(target)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_all, sock_b, wire)
            filled = 0
            while filled < len(target):
                count = await lane.read_into(view[filled:])
                counts.append(count)
                filled += count
            rest = await lane.read()
        # whole records land in place; the last one is split between the buffer and read()
        assert counts == [MAX_RECORD_PLAINTEXT, MAX_RECORD_PLAINTEXT, 200]
        assert target.tobytes() + rest == data
    finally:
        await lane.reset()
        sock_b.close()


# ------------------------------------------------------------------ real hosts


async def echo_doubled(requests, context):
    """Answers each (attached) request with its attachment doubled and its value + 1."""
    async for item in requests:
        if isinstance(item, Attached):
            assert isinstance(item.attachment, np.ndarray) and item.attachment.flags.writeable
            yield Attached(Int64Value(value=item.message.value + 1), item.attachment * 2)
        elif item.value >= 100:
            yield Attached(item, b"zz")
        else:
            yield Int64Value(value=-item.value)


async def plain_echo(requests, context):
    async for item in requests:
        yield item


async def attach_anyway(requests, context):
    async for _ in requests:
        yield Attached(Int64Value(value=1), b"abc")


def serve(p2p):
    for name, handler, attachments in (
        ("t::A.echo", echo_doubled, True),
        ("t::A.plain", plain_echo, False),
        ("t::A.attach_anyway", attach_anyway, False),
    ):
        p2p.add_protobuf_handler(
            name,
            handler,
            Int64Value,
            stream_input=True,
            stream_output=True,
            attachments=attachments,
        )


@pytest.mark.trio
@pytest.mark.parametrize("bulk", [False, True], ids=["libp2p", "lane"])
async def test_attachments_round_trip_into_chosen_buffers(bulk):
    sizes = [0, 7, MAX_RECORD_PLAINTEXT, 2 * MAX_RECORD_PLAINTEXT + 13]
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 100, size=n, dtype=np.uint8) for n in sizes]
    targets = {}

    def choose(message, size):  # odd values go to buffers we own, even ones to new arrays
        if message.value % 2:
            targets[message.value] = np.empty(size, np.uint8)
            return targets[message.value]
        return None

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        requests = [Attached(Int64Value(value=i), array) for i, array in enumerate(arrays)]
        requests.append(Int64Value(value=5))  # plain messages mix with attached ones
        async with b.iterate_protobuf_handler(
            a.peer_id,
            "t::A.echo",
            requests,
            Int64Value,
            stream_input=True,
            bulk=bulk,
            attachments=True,
            attachment_buffer=choose,
        ) as responses:
            received = [r async for r in responses]
        assert (b.statistics()["lanes_opened"] == 1) == bulk
    for i, (item, array) in enumerate(zip(received[:-1], arrays, strict=True)):
        assert isinstance(item, Attached) and item.message.value == i + 1
        assert np.array_equal(item.attachment, array * 2)
        if i + 1 in targets:
            assert item.attachment is targets[i + 1]
    assert received[-1] == Int64Value(value=-5)


@pytest.mark.trio
async def test_attachments_need_both_sides_to_opt_in():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        attached = [Attached(Int64Value(value=1), np.zeros(10, np.uint8))]

        async def call(method, requests, **kwargs):
            async with b.iterate_protobuf_handler(
                a.peer_id, method, requests, Int64Value, stream_input=True, **kwargs
            ) as responses:
                return [r async for r in responses]

        # a handler not set up for attachments rejects them as a protocol error
        with pytest.raises(RPCProtocolError, match="attachment"):
            await call("t::A.plain", attached, attachments=True)
        # a caller that did not opt in can neither send them (a programming error)...
        with pytest.raises(TypeError, match="attachments"):
            await call("t::A.echo", attached)
        # ... nor receive them
        with pytest.raises(RPCProtocolError, match="attachment"):
            await call("t::A.echo", [Int64Value(value=100)])
        # a handler not set up for attachments cannot send them either
        with pytest.raises(RPCError, match="attachments"):
            await call("t::A.attach_anyway", [Int64Value(value=3)], attachments=True)
        # the attachment counts against max_message_size
        with pytest.raises(MessageTooLargeError):
            await call(
                "t::A.echo",
                [Attached(Int64Value(value=1), np.zeros(5000, np.uint8))],
                attachments=True,
                max_message_size=4096,
            )
