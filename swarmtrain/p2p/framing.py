"""Sans-IO framing of RPC streams.

A frame is ``varint(len(header)) | RPCFrameHeader | payload``; the payload (one serialized
protobuf message) follows the header as raw bytes so large messages are never copied into a
protobuf field. ``FrameDecoder`` takes bytes in and gives whole frames out; it checks the
declared payload size against a limit *before* buffering the payload.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from swarmtrain.p2p.errors import MessageTooLargeError, RPCProtocolError
from swarmtrain.proto import p2p_pb2

FrameKind = p2p_pb2.RPCFrameHeader.Kind
MAX_HEADER_SIZE = 64 * 1024
_VARINT_MAX_BYTES = 10


@dataclass(frozen=True)
class Frame:
    header: p2p_pb2.RPCFrameHeader
    payload: bytes | bytearray | memoryview = b""

    @property
    def kind(self) -> int:
        return self.header.kind


def encode_varint(value: int) -> bytes:
    if value < 0:
        raise ValueError("varint must be non-negative")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_header(header: p2p_pb2.RPCFrameHeader) -> bytes:
    """Serialize a header with its varint length prefix (the payload is written separately)."""
    raw = header.SerializeToString()
    return encode_varint(len(raw)) + raw


def message_header(payload_size: int) -> bytes:
    return encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.MESSAGE, payload_size=payload_size))


def _decode_varint(buf: bytearray | memoryview, start: int) -> tuple[int, int] | None:
    """Return (value, next_offset), or None if the buffer ends inside the varint."""
    value = shift = 0
    pos = start
    while pos < len(buf):
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
        if pos - start >= _VARINT_MAX_BYTES:
            raise RPCProtocolError("malformed frame: header length varint is too long")
    return None


class FrameDecoder:
    """Incremental decoder: ``feed(data)``, then ``next_frame()`` until it returns None.

    Raises ``RPCProtocolError`` on malformed input and ``MessageTooLargeError`` when a header
    declares a payload larger than ``max_payload_size`` (before the payload is buffered).
    """

    def __init__(self, max_payload_size: int):
        self.max_payload_size = max_payload_size
        self._buffer = bytearray()
        self._pending_header: p2p_pb2.RPCFrameHeader | None = None
        self._payload: bytearray | None = None
        self._payload_filled = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) + self._payload_filled

    @property
    def bytes_wanted(self) -> int:
        """How many more bytes would complete the current payload (0 if not inside one)."""
        if self._payload is None:
            return 0
        return len(self._payload) - self._payload_filled

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._payload is not None:
            take = min(len(data), len(self._payload) - self._payload_filled)
            self._payload[self._payload_filled : self._payload_filled + take] = data[:take]
            self._payload_filled += take
            data = data[take:]
        if data:
            self._buffer += data

    def next_frame(self) -> Frame | None:
        if self._payload is not None:
            if self._payload_filled < len(self._payload):
                return None
            frame = Frame(self._pending_header, self._payload)
            self._pending_header, self._payload, self._payload_filled = None, None, 0
            return frame

        decoded = _decode_varint(self._buffer, 0)
        if decoded is None:
            return None
        header_size, offset = decoded
        if header_size > MAX_HEADER_SIZE:
            raise RPCProtocolError(f"malformed frame: header of {header_size} bytes")
        if len(self._buffer) < offset + header_size:
            return None
        header = p2p_pb2.RPCFrameHeader()
        try:
            header.ParseFromString(bytes(self._buffer[offset : offset + header_size]))
        except DecodeError as e:
            raise RPCProtocolError(f"malformed frame header: {e}") from None
        if header.kind not in FrameKind.values() or header.kind == FrameKind.KIND_UNSPECIFIED:
            raise RPCProtocolError(f"malformed frame: unknown kind {header.kind}")
        if header.payload_size and header.kind != FrameKind.MESSAGE:
            raise RPCProtocolError("malformed frame: only MESSAGE frames carry a payload")
        if header.payload_size > self.max_payload_size:
            raise MessageTooLargeError(
                f"peer announced a message of {header.payload_size} bytes; "
                f"the limit is {self.max_payload_size} bytes (max_message_size)"
            )
        del self._buffer[: offset + header_size]
        if header.payload_size == 0:
            return Frame(header, b"")
        size = header.payload_size
        if len(self._buffer) >= size:
            payload = bytes(self._buffer[:size])
            del self._buffer[:size]
            return Frame(header, payload)
        # Start a payload buffer of the announced (already limit-checked) size.
        self._pending_header = header
        self._payload = bytearray(size)
        self._payload_filled = len(self._buffer)
        self._payload[: self._payload_filled] = self._buffer
        self._buffer.clear()
        return None
