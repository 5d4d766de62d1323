"""Property tests of the RPC frame decoder (sans-IO): any split of valid frames decodes to the
same frames; garbage raises only the framing errors; declared sizes allocate nothing."""

from __future__ import annotations

import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.p2p.errors import MessageTooLargeError, ResourceLimitError, RPCProtocolError
from swarmtrain.p2p.framing import (
    FrameDecoder,
    FrameKind,
    attached_message_header,
    encode_header,
    encode_varint,
    message_header,
)
from swarmtrain.p2p.limits import ByteBudget
from swarmtrain.p2p.rpc import parse_message
from swarmtrain.proto import averaging_pb2, dht_pb2, matchmaking_pb2, p2p_pb2

MAX_PAYLOAD = 4096
FRAMING_ERRORS = (RPCProtocolError, MessageTooLargeError)


@st.composite
def frames(draw):
    """(wire bytes of one frame, (kind, method, payload, attachment)) of a valid frame."""
    kind = draw(st.sampled_from(["open", "message", "attached", "end", "error"]))
    if kind == "open":
        method = draw(st.text(max_size=30))
        header = p2p_pb2.RPCFrameHeader(kind=FrameKind.OPEN, method=method)
        return encode_header(header), (FrameKind.OPEN, method, b"", b"")
    if kind == "end":
        return encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.END)), (
            FrameKind.END,
            "",
            b"",
            b"",
        )
    if kind == "error":
        text = draw(st.text(max_size=30))
        header = p2p_pb2.RPCFrameHeader(kind=FrameKind.ERROR, error_message=text)
        return encode_header(header), (FrameKind.ERROR, "", b"", b"")
    payload = draw(st.binary(max_size=600))
    if kind == "message":
        return message_header(len(payload)) + payload, (FrameKind.MESSAGE, "", payload, b"")
    attachment = draw(st.binary(max_size=600))
    wire = attached_message_header(len(payload), len(attachment)) + payload + attachment
    return wire, (FrameKind.ATTACHED_MESSAGE, "", payload, attachment)


def decode_all(decoder: FrameDecoder, pieces, own_attachments: bool) -> list[tuple]:
    """Feed ``pieces`` one by one and take every frame (and attachment) out as it completes."""
    got: list[tuple] = []
    pending = None  # an ATTACHED_MESSAGE frame whose attachment is being received
    for piece in pieces:
        decoder.feed(piece)
        while True:
            if pending is not None:
                if not decoder.attachment_complete:
                    break
                attachment = bytes(decoder.take_attachment())
                got.append((*pending, attachment))
                pending = None
            frame = decoder.next_frame()
            if frame is None:
                break
            entry = (frame.kind, frame.header.method, bytes(frame.payload))
            if frame.kind == FrameKind.ATTACHED_MESSAGE:
                size = frame.attachment_size
                decoder.begin_attachment(None if own_attachments else bytearray(size))
                pending = entry
            else:
                got.append((*entry, b""))
    assert pending is None or decoder.attachment_pending  # (the input ended inside it)
    return got


@given(st.lists(frames(), min_size=1, max_size=6), st.data(), st.booleans())
def test_frames_survive_any_split(items, data, own_attachments):
    wire = b"".join(w for w, _ in items)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    budget = ByteBudget(1 << 20)
    decoder = FrameDecoder(MAX_PAYLOAD, budget, first_allocation=64)
    assert decode_all(decoder, pieces, own_attachments) == [want for _, want in items]
    assert decoder.buffered_bytes == 0 and not decoder.in_frame and not decoder.attachment_pending
    decoder.close()
    assert budget.used == 0


def mutate(data: st.DataObject, wire: bytes) -> bytes:
    """``wire`` with a few bytes flipped, inserted or removed."""
    out = bytearray(wire)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        at = data.draw(st.integers(0, len(out)))
        if op == "insert" or not out:
            out[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "flip":
            at = min(at, len(out) - 1)
            out[at] ^= data.draw(st.integers(1, 255))
        else:
            del out[at : at + data.draw(st.integers(1, 4))]
    return bytes(out)


@given(st.data())
def test_garbage_raises_only_framing_errors(data):
    """Random or mutated bytes: frames, None, or a framing error; never another exception, and
    a declared payload is never allocated beyond the limit."""
    if data.draw(st.booleans()):
        wire = data.draw(st.binary(max_size=300))
    else:
        wire = mutate(data, b"".join(w for w, _ in data.draw(st.lists(frames(), max_size=4))))
    budget = ByteBudget(1 << 20)
    decoder = FrameDecoder(MAX_PAYLOAD, budget, first_allocation=64)
    try:
        decode_all(decoder, [wire[:7], wire[7:]], own_attachments=True)
    except FRAMING_ERRORS:
        pass
    # memory follows the bytes: never more than twice what arrived, plus the first piece (a
    # payload of up to twice the first piece gets its whole size at once: 85 bytes for 10)
    assert decoder.allocated_bytes <= 2 * len(wire) + 2 * 64
    assert budget.used <= 2 * len(wire) + 2 * 64
    decoder.close()
    assert budget.used == 0


@given(
    st.integers(MAX_PAYLOAD + 1, 2**64 - 1),
    st.sampled_from([FrameKind.MESSAGE, FrameKind.ATTACHED_MESSAGE]),
)
def test_oversized_declarations_are_refused_before_buffering(size, kind):
    header = p2p_pb2.RPCFrameHeader(kind=kind)
    if kind == FrameKind.MESSAGE:
        header.payload_size = size
    else:
        header.attachment_size = size
    decoder = FrameDecoder(MAX_PAYLOAD)
    decoder.feed(encode_header(header) + b"x" * 16)
    try:
        decoder.next_frame()
    except MessageTooLargeError:
        return
    raise AssertionError("an oversized frame was accepted")


@given(st.integers(1 << 20, (1 << 30) - 1), st.binary(max_size=100))
def test_declared_size_within_the_limit_allocates_with_arrival(size, start):
    """A header declaring up to 1 GiB, then a few bytes: memory stays near those bytes."""
    decoder = FrameDecoder(1 << 30, first_allocation=4096)
    tracemalloc.start()
    try:
        decoder.feed(message_header(size) + start)
        assert decoder.next_frame() is None
        decoder.feed(b"y" * 10_000)
        assert decoder.next_frame() is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoder.allocated_bytes <= 2 * (10_000 + len(start)) + 4096
    assert peak < max(256 * 1024, size // 4)  # (room for other threads of the process)
    decoder.close()


@given(st.integers(0, 2**70))
def test_header_length_varint(value):
    """Any header length prefix: the frame waits for more bytes or is refused as malformed."""
    decoder = FrameDecoder(MAX_PAYLOAD)
    decoder.feed(encode_varint(value))
    try:
        assert decoder.next_frame() is None
    except RPCProtocolError:
        assert value > 64 * 1024 or value == 0  # too long, or an empty header (no kind)
    else:
        assert 0 < value <= 64 * 1024


def test_byte_budget_refusal_is_typed():
    """A budget smaller than the first piece: the frame fails with ResourceLimitError."""
    decoder = FrameDecoder(MAX_PAYLOAD, ByteBudget(10), first_allocation=64)
    decoder.feed(message_header(MAX_PAYLOAD) + b"z")
    try:
        decoder.next_frame()
    except ResourceLimitError:
        return
    raise AssertionError("the budget was not charged")


@given(
    st.sampled_from(
        [
            dht_pb2.DHTStoreRequest,
            dht_pb2.DHTFindResponse,
            averaging_pb2.AveragingTensorPart,
            matchmaking_pb2.MatchmakingJoinRequest,
            p2p_pb2.LaneTicket,
        ]
    ),
    st.binary(max_size=200),
)
def test_rpc_payloads_parse_or_raise_protocol_error(message_type, payload):
    """What every RPC handler and caller runs on a received payload."""
    try:
        message = parse_message(message_type, memoryview(payload), "request")
    except RPCProtocolError:
        return
    assert isinstance(message, message_type)
