"""Sans-IO framing of RPC streams.

A frame is ``varint(len(header)) | RPCFrameHeader | payload``; the payload (one serialized
protobuf message) follows the header as raw bytes so large messages are never copied into a
protobuf field. An ``ATTACHED_MESSAGE`` frame then carries ``attachment_size`` more raw bytes
(e.g. a tensor's), which the receiver places straight into a buffer of its choice
(``begin_attachment``). ``FrameDecoder`` takes bytes in and gives whole frames out; it checks
the declared sizes against a limit *before* buffering anything, and its buffers grow with
the bytes that arrive, not with what a header declares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from swarmtrain.p2p.errors import MessageTooLargeError, RPCProtocolError
from swarmtrain.p2p.limits import INITIAL_ALLOCATION, ByteBudget, PeerBytes
from swarmtrain.proto import p2p_pb2

FrameKind = p2p_pb2.RPCFrameHeader.Kind
#: the frame kinds that carry a message (and, for ATTACHED_MESSAGE, an attachment after it)
# The kinds as plain ints: an attribute of the protobuf enum wrapper costs ~1.7 us a lookup.
KIND_OPEN, KIND_MESSAGE, KIND_END, KIND_ERROR, KIND_ATTACHED = (
    FrameKind.OPEN,
    FrameKind.MESSAGE,
    FrameKind.END,
    FrameKind.ERROR,
    FrameKind.ATTACHED_MESSAGE,
)
MESSAGE_KINDS = frozenset((KIND_MESSAGE, KIND_ATTACHED))
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
        return self.header.attachment_size if self.header.kind == KIND_ATTACHED else 0


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


class GrowingBuffer:
    """Room for ``size`` declared bytes that is never much more than what was written into
    it: uninitialized pieces, each as large as all before it, until half of it arrived; then
    one array of the whole size, the pieces copied in (growing copies at most half of it).
    ``charge(n)`` and ``release(n)`` hear of every allocation and of its end; the budget is
    charged at most ``size`` in all (the copy's transient pieces are not charged: see
    ``_grow``)."""

    __slots__ = ("_charge", "_piece_filled", "_pieces", "_release", "allocated", "filled", "size")

    def __init__(self, size: int, first: int, charge, release):
        """``first``: the first piece (a payload of at most twice that gets its whole size)."""
        self.size, self._charge, self._release = size, charge, release
        first = size if size <= 2 * first else first
        charge(first)
        self._pieces = [np.empty(first, dtype=np.uint8)]  # filled before it is read
        self.allocated, self.filled, self._piece_filled = first, 0, 0

    @property
    def complete(self) -> bool:
        return self.filled == self.size

    def writable(self) -> memoryview:
        """The unfilled rest of the current piece (empty once complete)."""
        if self.filled == self.allocated < self.size:
            self._grow()
        return self._pieces[-1].data[self._piece_filled :]

    def advance(self, count: int) -> None:
        self.filled += count
        self._piece_filled += count

    def _grow(self) -> None:
        if 2 * self.filled < self.size:
            self._charge(self.filled)
            self._pieces.append(np.empty(self.filled, dtype=np.uint8))
            self.allocated += self.filled
            self._piece_filled = 0
            return
        # The pieces are freed right after the copy, with no await in between: at most one
        # such copy exists in a process at a time, so the budget is charged the growth only
        # (a message of the budget's whole size can complete).
        self._charge(self.size - self.allocated)
        whole = np.empty(self.size, dtype=np.uint8)
        start = 0
        for piece in self._pieces:
            whole[start : start + len(piece)] = piece
            start += len(piece)
        self._pieces, self.allocated, self._piece_filled = [whole], self.size, self.filled

    def take(self) -> np.ndarray:
        """The complete bytes (one uint8 array of exactly ``size``); releases the charge."""
        if not self.complete:
            raise RuntimeError("the buffer is not complete")
        (whole,) = self._pieces
        self.discard()
        return whole

    def discard(self) -> None:
        self._release(self.allocated)
        self._pieces, self.allocated = [], 0


class FrameDecoder:
    """Incremental decoder: ``feed(data)``, then ``next_frame()`` until it returns None.

    Raises ``RPCProtocolError`` on malformed input and ``MessageTooLargeError`` when a header
    declares a payload (plus attachment) larger than ``max_payload_size``, before buffering it.

    Memory follows the bytes that arrived, never a declaration: a payload (or an attachment
    received into a buffer of the decoder's own) that did not arrive whole goes into a
    ``GrowingBuffer`` (at first ``INITIAL_ALLOCATION`` bytes or what arrived, or the whole
    payload when that is at most twice as much; then at most twice what arrived). Those
    buffers are charged to ``budget`` (a host's ``ByteBudget``, or ``budget.for_peer(peer)``
    to charge that peer's share too: ``ResourceLimitError`` when it is used up) until the
    frame is handed out or ``close()``.
    With ``awaiting_open`` set (a callee before each call), any frame but OPEN is a protocol
    error as soon as its header is read.

    A payload being received is filled in place: ``writable()`` is the part still missing (a
    reader may receive straight into it) and ``advance(n)`` counts bytes written there. After
    an ATTACHED_MESSAGE frame, the caller must ``begin_attachment(buffer)`` (a writable buffer
    of exactly ``attachment_size`` bytes, or None for a new numpy array), fill it the same way
    and ``take_attachment()`` before the next frame.
    """

    def __init__(
        self,
        max_payload_size: int,
        budget: ByteBudget | PeerBytes | None = None,
        first_allocation: int = INITIAL_ALLOCATION,
    ):
        """``first_allocation``: the first buffer of a payload that did not arrive whole (a
        data lane's record size, so records decrypt in place)."""
        self.max_payload_size = max_payload_size
        self.budget = budget
        self.first_allocation = first_allocation
        self.awaiting_open = False
        self._buffer = bytearray()
        self._pending_header: p2p_pb2.RPCFrameHeader | None = None
        self._payload: GrowingBuffer | None = None
        self._attachment_wanted: int | None = None  # size of the attachment that follows
        self._attachment_own: GrowingBuffer | None = None  # ours (begin_attachment(None))
        self._attachment: object = None  # the caller's buffer, while it is filled
        self._attachment_view: memoryview | None = None
        self._attachment_filled = 0
        self._charged = 0  # bytes of our own buffers charged to the budget

    @property
    def buffered_bytes(self) -> int:
        payload = self._payload.filled if self._payload is not None else 0
        own = self._attachment_own.filled if self._attachment_own is not None else 0
        return len(self._buffer) + payload + own + self._attachment_filled

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the payload or attachment buffers this decoder allocated itself."""
        payload = self._payload.allocated if self._payload is not None else 0
        own = self._attachment_own.allocated if self._attachment_own is not None else 0
        return payload + own

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
        """How many more bytes would complete the current payload or attachment (0 if not
        inside one)."""
        if self._attachment_own is not None:
            return self._attachment_own.size - self._attachment_own.filled
        if self._attachment_view is not None:
            return self._attachment_view.nbytes - self._attachment_filled
        if self._payload is not None:
            return self._payload.size - self._payload.filled
        return 0

    def _charge(self, count: int) -> None:
        if self.budget is not None:
            self.budget.reserve(count)
            self._charged += count

    def _uncharge(self, count: int) -> None:
        if self.budget is not None and count:
            self.budget.release(count)
            self._charged -= count

    def _growing(self, size: int) -> GrowingBuffer:
        first = max(self.first_allocation, len(self._buffer))
        return GrowingBuffer(size, first, self._charge, self._uncharge)

    def writable(self) -> memoryview | None:
        """The unfilled rest of the buffer of the payload or attachment being received (None:
        none is); a full buffer of a frame still missing bytes grows first."""
        if self._attachment_own is not None:
            return self._attachment_own.writable()
        if self._attachment_view is not None:
            return self._attachment_view[self._attachment_filled :]
        if self._payload is not None:
            return self._payload.writable()
        return None

    def advance(self, count: int) -> None:
        """``count`` bytes were written at the start of ``writable()``."""
        if self._attachment_own is not None:
            self._attachment_own.advance(count)
        elif self._attachment_view is not None:
            self._attachment_filled += count
        elif self._payload is not None:
            self._payload.advance(count)
        elif count:
            raise RuntimeError("advance() without a payload or attachment being received")

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._payload is None and self._attachment_view is None and not self._attachment_own:
            self._buffer += data  # between frames (the common case of small messages)
            return
        data = memoryview(data).cast("B")
        while len(data):
            target = self.writable()
            if target is None or not len(target):
                break
            take = min(len(data), len(target))
            target[:take] = data[:take]
            self.advance(take)
            data = data[take:]
        if len(data):
            self._buffer += data

    def begin_attachment(self, buffer=None):
        """Receive the pending attachment into ``buffer`` (None: a new uint8 numpy array,
        grown as bytes arrive, which ``take_attachment`` returns); bytes already buffered go
        there at once. Returns ``buffer``."""
        size = self._attachment_wanted
        if size is None or self._attachment_view is not None or self._attachment_own is not None:
            raise RuntimeError("no attachment is due")
        take = min(size, len(self._buffer))
        if buffer is None:
            own = self._attachment_own = self._growing(size)
            if take:
                own.writable()[:take] = self._buffer[:take]
                own.advance(take)
        else:
            view = memoryview(buffer).cast("B")
            if view.readonly or view.nbytes != size:
                raise ValueError(
                    f"an attachment of {size} bytes needs a writable buffer of that size, "
                    f"got {view.nbytes} bytes{' (read-only)' if view.readonly else ''}"
                )
            self._attachment, self._attachment_view = buffer, view
            view[:take] = self._buffer[:take]
            self._attachment_filled = take
        del self._buffer[:take]
        return buffer

    @property
    def attachment_complete(self) -> bool:
        if self._attachment_own is not None:
            return self._attachment_own.complete
        return (
            self._attachment_view is not None and self._attachment_filled == self._attachment_wanted
        )

    def take_attachment(self):
        """The filled attachment buffer; the decoder moves on to the next frame."""
        if not self.attachment_complete:
            raise RuntimeError("the attachment is not complete")
        if self._attachment_own is not None:
            buffer = self._attachment_own.take()
        else:
            buffer = self._attachment
            self._attachment_view.release()
        self._attachment = self._attachment_view = self._attachment_wanted = None
        self._attachment_own, self._attachment_filled = None, 0
        return buffer

    def close(self) -> None:
        """Drop every buffer and give their bytes back to the budget (the stream is done)."""
        for growing in (self._payload, self._attachment_own):
            if growing is not None:
                growing.discard()
        self._uncharge(self._charged)
        self._buffer = bytearray()
        self._payload = self._pending_header = self._attachment_own = None
        self._attachment = self._attachment_view = self._attachment_wanted = None
        self._attachment_filled = 0

    def _complete(self, header: p2p_pb2.RPCFrameHeader, payload) -> Frame:
        frame = Frame(header, payload)
        if header.kind == KIND_ATTACHED:
            self._attachment_wanted = header.attachment_size
        elif header.kind == KIND_OPEN:
            self.awaiting_open = False
        return frame

    def next_frame(self) -> Frame | None:
        if self._attachment_wanted is not None:
            # a receive of the attachment failed or was cancelled part-way (a timeout on a slow
            # link, say): the stream's position is lost, the call cannot go on
            raise RPCProtocolError(
                "the attachment of the previous frame was not taken: after a failed or cancelled "
                "receive of it the stream cannot be read further"
            )
        if self._payload is not None:
            if not self._payload.complete:
                return None
            pending, received = self._pending_header, self._payload.take().data
            assert pending is not None  # set together with _payload
            self._pending_header, self._payload = None, None
            return self._complete(pending, received)

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
        if self.awaiting_open and header.kind != KIND_OPEN:
            kind = FrameKind.Name(header.kind)
            raise RPCProtocolError(f"a call must start with OPEN, got {kind}")
        if header.payload_size and header.kind not in MESSAGE_KINDS:
            raise RPCProtocolError("malformed frame: only MESSAGE frames carry a payload")
        if header.attachment_size and header.kind != KIND_ATTACHED:
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
        # The rest is received into a buffer that grows as it arrives (never the declared size).
        self._pending_header, self._payload = header, self._growing(size)
        if self._buffer:
            self._payload.writable()[: len(self._buffer)] = self._buffer
            self._payload.advance(len(self._buffer))
            self._buffer.clear()
        return None
