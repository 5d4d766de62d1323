"""Sans-IO framing of RPC streams.

A frame is ``varint(len(header)) | RPCFrameHeader | payload``; the payload (one serialized
protobuf message) follows the header as raw bytes so large messages are never copied into a
protobuf field. An ``ATTACHED_MESSAGE`` frame then carries ``attachment_size`` more raw bytes
(e.g. a tensor's), which the receiver places straight into a buffer of its choice
(``begin_attachment``). ``FrameDecoder`` takes bytes in and gives whole frames out; it checks
the declared sizes against a limit *before* buffering anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from swarmtrain.p2p.errors import MessageTooLargeError, RPCProtocolError
from swarmtrain.proto import p2p_pb2

FrameKind = p2p_pb2.RPCFrameHeader.Kind
#: the frame kinds that carry a message (and, for ATTACHED_MESSAGE, an attachment after it)
MESSAGE_KINDS = frozenset((FrameKind.MESSAGE, FrameKind.ATTACHED_MESSAGE))
_KNOWN_KINDS = frozenset(FrameKind.values()) - {FrameKind.KIND_UNSPECIFIED}
MAX_HEADER_SIZE = 64 * 1024
_VARINT_MAX_BYTES = 10


@dataclass(frozen=True)
class Frame:
    header: p2p_pb2.RPCFrameHeader
    payload: bytes | bytearray | memoryview = b""

    @property
    def kind(self) -> int:
        return self.header.kind

    @property
    def attachment_size(self) -> int:
        """Bytes that follow this frame's payload (0 unless ATTACHED_MESSAGE)."""
        return self.header.attachment_size if self.header.kind == FrameKind.ATTACHED_MESSAGE else 0


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


def attached_message_header(payload_size: int, attachment_size: int) -> bytes:
    return encode_header(
        p2p_pb2.RPCFrameHeader(
            kind=FrameKind.ATTACHED_MESSAGE,
            payload_size=payload_size,
            attachment_size=attachment_size,
        )
    )


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
    declares a payload (plus attachment) larger than ``max_payload_size``, before buffering it.

    A payload being received is filled in place: ``writable()`` is the part still missing (a
    reader may receive straight into it) and ``advance(n)`` counts bytes written there. After
    an ATTACHED_MESSAGE frame, the caller must ``begin_attachment(buffer)`` (a writable buffer
    of exactly ``attachment_size`` bytes, or None for a new numpy array), fill it the same way
    and ``take_attachment()`` before the next frame.
    """

    def __init__(self, max_payload_size: int):
        self.max_payload_size = max_payload_size
        self._buffer = bytearray()
        self._pending_header: p2p_pb2.RPCFrameHeader | None = None
        self._payload: bytearray | None = None
        self._payload_filled = 0
        self._attachment_wanted: int | None = None  # size of the attachment that follows
        self._attachment: object = None  # the caller's buffer, while it is filled
        self._attachment_view: memoryview | None = None
        self._attachment_filled = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) + self._payload_filled + self._attachment_filled

    @property
    def in_frame(self) -> bool:
        """Whether the stream stopped inside a frame (bytes buffered or an attachment due)."""
        return bool(self.buffered_bytes) or self._attachment_wanted is not None

    @property
    def attachment_pending(self) -> bool:
        """An ATTACHED_MESSAGE frame was returned and its attachment is not taken yet."""
        return self._attachment_wanted is not None

    @property
    def bytes_wanted(self) -> int:
        """How many more bytes would complete the current payload (0 if not inside one)."""
        view = self.writable()
        return 0 if view is None else len(view)

    def writable(self) -> memoryview | None:
        """The unfilled rest of the payload or attachment being received (None: none is)."""
        if self._attachment_view is not None:
            return self._attachment_view[self._attachment_filled :]
        if self._payload is not None:
            return memoryview(self._payload)[self._payload_filled :]
        return None

    def advance(self, count: int) -> None:
        """``count`` bytes were written at the start of ``writable()``."""
        if self._attachment_view is not None:
            self._attachment_filled += count
        elif self._payload is not None:
            self._payload_filled += count
        elif count:
            raise RuntimeError("advance() without a payload or attachment being received")

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        target = self.writable()
        if target is not None and len(data):
            take = min(len(data), len(target))
            target[:take] = data[:take]
            self.advance(take)
            data = data[take:]
        if len(data):
            self._buffer += data

    def begin_attachment(self, buffer=None):
        """Receive the pending attachment into ``buffer`` (None: a new uint8 numpy array);
        bytes already buffered go there at once. Returns the buffer."""
        size = self._attachment_wanted
        if size is None or self._attachment_view is not None:
            raise RuntimeError("no attachment is due")
        if buffer is None:
            buffer = np.empty(size, dtype=np.uint8)
        view = memoryview(buffer).cast("B")
        if view.readonly or view.nbytes != size:
            raise ValueError(
                f"an attachment of {size} bytes needs a writable buffer of that size, "
                f"got {view.nbytes} bytes{' (read-only)' if view.readonly else ''}"
            )
        self._attachment, self._attachment_view, self._attachment_filled = buffer, view, 0
        take = min(size, len(self._buffer))
        if take:
            view[:take] = self._buffer[:take]
            del self._buffer[:take]
            self._attachment_filled = take
        return buffer

    @property
    def attachment_complete(self) -> bool:
        return self._attachment_view is not None and self._attachment_filled == len(
            self._attachment_view
        )

    def take_attachment(self):
        """The filled attachment buffer; the decoder moves on to the next frame."""
        if not self.attachment_complete:
            raise RuntimeError("the attachment is not complete")
        buffer = self._attachment
        self._attachment = self._attachment_view = self._attachment_wanted = None
        self._attachment_filled = 0
        return buffer

    def _complete(self, header: p2p_pb2.RPCFrameHeader, payload) -> Frame:
        frame = Frame(header, payload)
        if header.kind == FrameKind.ATTACHED_MESSAGE:
            self._attachment_wanted = header.attachment_size
        return frame

    def next_frame(self) -> Frame | None:
        if self._attachment_wanted is not None:
            raise RuntimeError("the attachment of the previous frame was not taken")
        if self._payload is not None:
            if self._payload_filled < len(self._payload):
                return None
            header, payload = self._pending_header, self._payload
            self._pending_header, self._payload, self._payload_filled = None, None, 0
            return self._complete(header, payload)

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
        if header.kind not in _KNOWN_KINDS:
            raise RPCProtocolError(f"malformed frame: unknown kind {header.kind}")
        if header.payload_size and header.kind not in MESSAGE_KINDS:
            raise RPCProtocolError("malformed frame: only MESSAGE frames carry a payload")
        if header.attachment_size and header.kind != FrameKind.ATTACHED_MESSAGE:
            raise RPCProtocolError("malformed frame: only ATTACHED_MESSAGE frames have attachments")
        if header.payload_size + header.attachment_size > self.max_payload_size:
            raise MessageTooLargeError(
                f"peer announced a message of {header.payload_size + header.attachment_size} "
                f"bytes; the limit is {self.max_payload_size} bytes (max_message_size)"
            )
        del self._buffer[: offset + header_size]
        if header.payload_size == 0:
            return self._complete(header, b"")
        size = header.payload_size
        if len(self._buffer) >= size:
            payload = self._buffer[:size]
            del self._buffer[:size]
            return self._complete(header, payload)
        # Start a payload buffer of the announced (already limit-checked) size.
        self._pending_header = header
        self._payload = bytearray(size)
        self._payload_filled = len(self._buffer)
        self._payload[: self._payload_filled] = self._buffer
        self._buffer.clear()
        return None
