"""Sans-IO tests of the RPC frame codec (no sockets)."""

import pytest

from swarmtrain.p2p.errors import MessageTooLargeError, RPCProtocolError
from swarmtrain.p2p.framing import (
    FrameDecoder,
    FrameKind,
    encode_header,
    encode_varint,
    message_header,
)
from swarmtrain.proto import p2p_pb2


def frames_of(decoder):
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    return out


def test_roundtrip_split_at_every_byte():
    wire = (
        encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.OPEN, method="x::Y.z"))
        + message_header(5)
        + b"hello"
        + message_header(0)
        + encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.END))
    )
    for split in range(len(wire) + 1):
        decoder = FrameDecoder(max_payload_size=100)
        decoder.feed(wire[:split])
        got = frames_of(decoder)
        decoder.feed(wire[split:])
        got += frames_of(decoder)
        assert [f.kind for f in got] == [
            FrameKind.OPEN,
            FrameKind.MESSAGE,
            FrameKind.MESSAGE,
            FrameKind.END,
        ]
        assert got[0].header.method == "x::Y.z"
        assert bytes(got[1].payload) == b"hello"
        assert bytes(got[2].payload) == b""
        assert decoder.buffered_bytes == 0


def test_large_payload_fed_in_pieces_is_assembled_in_place():
    payload = bytes(range(256)) * 4096
    decoder = FrameDecoder(max_payload_size=len(payload))
    decoder.feed(message_header(len(payload)) + payload[:10])
    assert decoder.next_frame() is None
    assert decoder.bytes_wanted == len(payload) - 10
    for start in range(10, len(payload), 100_000):
        decoder.feed(payload[start : start + 100_000])
    frame = decoder.next_frame()
    assert bytes(frame.payload) == payload


def test_oversized_payload_rejected_before_buffering():
    decoder = FrameDecoder(max_payload_size=1000)
    decoder.feed(message_header(2**40))
    with pytest.raises(MessageTooLargeError, match="1099511627776 bytes"):
        decoder.next_frame()
    assert decoder.buffered_bytes < 100


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff" * 20,  # endless varint
        encode_varint(10**6) + b"x",  # absurd header length
        encode_varint(4) + b"\xff\xff\xff\xff",  # not a protobuf
        encode_header(p2p_pb2.RPCFrameHeader(kind=77)),  # unknown kind
        encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.END, payload_size=3)),
    ],
)
def test_garbage_raises_protocol_error(garbage):
    decoder = FrameDecoder(max_payload_size=1000)
    decoder.feed(garbage)
    with pytest.raises(RPCProtocolError):
        decoder.next_frame()
