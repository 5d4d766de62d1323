"""A libp2p stream carrying RPC frames: buffered frame reads and cancellation-safe writes.

On a stream of our own yamux (``_yamux.TunedYamuxStream``, every stream of our hosts) writes
are not shielded: its frame writes are all-or-nothing under cancellation
(``_yamux.TunedYamux._write_frame``: a frame cut by a cancellation killed the whole connection,
see LIBP2P-NOTES), so a cancelled call stops between frames, also while it waits for the
peer's flow-control window, and each frame write and window wait is bounded there
(``FRAME_WRITE_TIMEOUT``, ``WINDOW_WAIT_TIMEOUT``): a write that keeps moving frames is slow,
not stalled, however long it takes. On any other libp2p stream writes are shielded from
cancellation piece by piece (at most ``WRITE_PIECE_SIZE`` bytes each, each bounded by
``WRITE_STALL_TIMEOUT``), so a cancelled call stops *between* pieces and then closes the
stream. Data lanes are ``cancel_safe``: their writes are not shielded.

This is the one place where the stream errors of both transports (py-libp2p's ``StreamError``
family and the lanes' ``LaneError`` family) become RPC errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import trio
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamError, StreamReset

from swarmtrain.p2p._yamux import TunedYamuxStream, WindowWaitTimeout
from swarmtrain.p2p.errors import (
    LaneClosedError,
    LaneEndOfStream,
    LaneError,
    LaneResetError,
    RPCCancelledError,
    RPCTimeoutError,
)
from swarmtrain.p2p.framing import (
    KIND_OPEN,
    Frame,
    FrameDecoder,
    FrameKind,
    attached_message_header,
    encode_header,
    message_header,
)
from swarmtrain.p2p.limits import INITIAL_ALLOCATION, ByteBudget, PeerBytes
from swarmtrain.p2p.stall_core import ProgressDeadline
from swarmtrain.proto import p2p_pb2

READ_SIZE = 1024 * 1024
WRITE_PIECE_SIZE = 1024 * 1024
# A single shielded piece that makes no progress for this long means the connection is dead.
WRITE_STALL_TIMEOUT = 60.0
CLOSE_TIMEOUT = 2.0
_END_FRAME = encode_header(p2p_pb2.RPCFrameHeader(kind=FrameKind.END))


@runtime_checkable
class ByteStream(Protocol):
    """What ``RPCStream`` needs of the stream under it: a py-libp2p stream (raising
    py-libp2p's ``StreamError`` family) or a data lane (``DirectByteStream``)."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


@runtime_checkable
class DirectByteStream(ByteStream, Protocol):
    """A byte stream of our own (a data lane, ``swarmtrain.p2p.lane_stream.LaneStream``): it
    raises the ``LaneError`` family, and offers what ``RPCStream`` uses when present."""

    #: a cancelled write harms only this stream (writes need no shielding)
    cancel_safe: bool
    #: the stream delivers whole records of up to this many bytes
    record_size: int

    async def read_into(self, view: memoryview) -> int: ...

    def is_reusable(self) -> bool: ...


class RPCStream:
    """Frames over one byte stream (a libp2p stream or a data lane). Not safe for concurrent
    senders (one sender task)."""

    def __init__(
        self,
        stream: ByteStream,
        max_message_size: int,
        budget: ByteBudget | PeerBytes | None = None,
    ):
        """``budget``: the host's budget of bytes in flight (``for_peer``: and the calling
        peer's share of it), charged for receive buffers."""
        self.stream = stream
        self._cancel_safe = getattr(stream, "cancel_safe", False)
        # frames all-or-nothing, stalls bounded per frame (see the module docstring)
        self._frames_atomic = isinstance(getattr(stream, "muxed_stream", None), TunedYamuxStream)
        # a data lane delivers whole records: a first buffer of one record takes them in place
        first = max(INITIAL_ALLOCATION, getattr(stream, "record_size", 0))
        self._decoder = FrameDecoder(max_message_size, budget, first)
        self._eof = False
        self._pushed_back: Frame | None = None
        self.frames_received = 0
        self.serving_call = False  # server side: a call's OPEN arrived and it has not ended
        self.bytes_sent = 0
        self.bytes_received = 0
        #: called with the count of every read that brought bytes (a wait whose deadline
        #: moves while a large message keeps arriving: ``stall_core.ProgressDeadline``)
        self.on_bytes: Callable[[int], None] | None = None

    def set_max_message_size(self, max_message_size: int) -> None:
        self._decoder.max_payload_size = max_message_size

    def expect_open(self) -> None:
        """Until the next OPEN, any other frame is a protocol error once its header is read
        (a callee between calls: nothing the caller declares is buffered before a method)."""
        self._decoder.awaiting_open = True

    def release_buffers(self) -> None:
        """Drop what is buffered and give it back to the budget (the stream is done)."""
        self._pushed_back = None
        self._decoder.close()

    def unread(self, frame: Frame | None) -> None:
        """Put a frame back: the next ``receive_frame`` returns it again."""
        if frame is not None:
            self._pushed_back = frame

    def is_reusable(self) -> bool:
        """True if the stream is idle and open both ways (nothing buffered, no EOF or reset)."""
        if self._eof or self._pushed_back is not None or self._decoder.in_frame:
            return False
        own_check = getattr(self.stream, "is_reusable", None)
        if own_check is not None:  # a data lane
            return own_check()
        muxed = getattr(self.stream, "muxed_stream", None)
        return not any(
            getattr(muxed, flag, False)
            for flag in ("closed", "recv_closed", "send_closed", "reset_received")
        )

    async def receive_frame(self) -> Frame | None:
        """The next frame, or None on a clean end of stream between frames. After a frame
        with an attachment, call ``receive_attachment`` before the next frame."""
        if self._pushed_back is not None:
            pushed_back, self._pushed_back = self._pushed_back, None
            return pushed_back
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                self.frames_received += 1
                return frame
            if self._eof:
                if self._decoder.in_frame:
                    raise RPCCancelledError(
                        f"the peer closed the stream in the middle of a frame "
                        f"({self._decoder.buffered_bytes} bytes of it had arrived): it gave up "
                        "on the call"
                    )
                return None
            await self._receive_more()

    async def receive_attachment(self, buffer=None):
        """The attachment of the frame just received, filled into ``buffer`` (a writable
        buffer of exactly ``frame.attachment_size`` bytes; None: a new uint8 numpy array).
        On a data lane, whole records are decrypted straight into it."""
        self._decoder.begin_attachment(buffer)
        while not self._decoder.attachment_complete:
            if self._eof:
                # The peer's side ended (FIN) before the bytes it announced: a caller or
                # handler that gave up (cancelled, timed out) ends its stream so. Not a
                # protocol violation: nothing it sent was malformed.
                raise RPCCancelledError(
                    f"the peer closed the stream in the middle of an attachment "
                    f"({self._decoder.bytes_wanted} bytes were still due): it gave up on the call"
                )
            await self._receive_more()
        return self._decoder.take_attachment()

    async def _receive_more(self) -> None:
        """Read once from the stream into the decoder (straight into the payload or
        attachment being received, when the stream can do that)."""
        target = self._decoder.writable()
        read_into = getattr(self.stream, "read_into", None)
        try:
            if target is not None and read_into is not None:
                count = await read_into(target)
                self.bytes_received += count
                self._decoder.advance(count)
                if self.on_bytes is not None and count:
                    self.on_bytes(count)
                return
            data = await self.stream.read(max(READ_SIZE, self._decoder.bytes_wanted))
        except (StreamEOF, LaneEndOfStream):
            self._eof = True
            return
        except (StreamReset, LaneResetError):
            raise RPCCancelledError("the peer reset the stream") from None
        except (StreamError, LaneError) as e:
            raise RPCCancelledError(f"the stream failed: {e!r}") from None
        if not data:
            self._eof = True
            return
        self.bytes_received += len(data)
        self._decoder.feed(data)
        if self.on_bytes is not None:
            self.on_bytes(len(data))

    async def _write(self, data: bytes | memoryview) -> None:
        # A data lane's or our yamux's write may be cancelled (and bounds its own stalls);
        # another libp2p stream's must not be (see the docstring).
        try:
            if self._cancel_safe or self._frames_atomic:
                await self.stream.write(data)
            else:
                with trio.CancelScope(shield=True), trio.fail_after(WRITE_STALL_TIMEOUT):
                    await self.stream.write(data)
        except trio.TooSlowError:
            raise RPCTimeoutError(
                f"the peer did not accept data for {WRITE_STALL_TIMEOUT} s"
            ) from None
        except StreamReset as e:
            if isinstance(e.__cause__, WindowWaitTimeout):  # ours, not the peer's reset
                raise RPCTimeoutError(f"the peer did not read the stream: {e.__cause__}") from None
            raise RPCCancelledError(f"the peer closed the stream: {e!r}") from None
        except (StreamClosed, LaneClosedError, LaneResetError) as e:
            raise RPCCancelledError(f"the peer closed the stream: {e!r}") from None
        except (StreamError, LaneError) as e:
            raise RPCCancelledError(f"the stream failed: {e!r}") from None
        self.bytes_sent += len(data)

    async def send_message(self, payload: bytes, *, end: bool = False) -> None:
        """Send one message (and END right after it, in the same write when small)."""
        header = message_header(len(payload))
        if len(payload) <= 64 * 1024:
            await self._write(header + payload + (_END_FRAME if end else b""))
            return
        await self._write(header)
        view = memoryview(payload)
        for start in range(0, len(view), WRITE_PIECE_SIZE):
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._write(view[start : start + WRITE_PIECE_SIZE])
        if end:
            await self._write(_END_FRAME)

    async def send_attached(self, payload: bytes, attachment) -> None:
        """Send one message with an attachment (any contiguous buffer, e.g. a numpy array:
        its memory goes to the stream as it is, without a copy). On a data lane the
        attachment starts a new record, so the receiver can decrypt it in place."""
        view = memoryview(attachment).cast("B")
        await self._write(attached_message_header(len(payload), view.nbytes) + payload)
        if self._cancel_safe:  # a lane: one write, records of 1 MiB
            if view.nbytes:
                await self._write(view)
            return
        for start in range(0, view.nbytes, WRITE_PIECE_SIZE):
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._write(view[start : start + WRITE_PIECE_SIZE])

    async def send_control(self, header: p2p_pb2.RPCFrameHeader) -> None:
        await self._write(encode_header(header))

    async def send_open(
        self, method: str, first_payload: bytes | None = None, *, end: bool = False
    ) -> None:
        """Send OPEN, then optionally one message and END (one write when they are small)."""
        data = encode_header(p2p_pb2.RPCFrameHeader(kind=KIND_OPEN, method=method))
        if first_payload is not None and len(first_payload) <= 64 * 1024:
            data += message_header(len(first_payload)) + first_payload
            if end:
                data += _END_FRAME
            await self._write(data)
            return
        await self._write(data)
        if first_payload is not None:
            await self.send_message(first_payload)
        if end:
            await self.send_end()

    async def send_end(self) -> None:
        await self._write(_END_FRAME)

    async def send_error(self, code: p2p_pb2.RPCErrorCode, error_type: str, message: str) -> None:
        await self.send_control(
            p2p_pb2.RPCFrameHeader(
                kind=FrameKind.ERROR,
                error_code=code,
                error_type=error_type,
                error_message=message[:4096],
            )
        )

    async def aclose(self) -> None:
        """Half-close our side (FIN), shielded and bounded; never raises."""
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await self.stream.close()
            except Exception:
                pass

    async def reset(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await self.stream.reset()
            except Exception:
                pass


@contextmanager
def deadline_moved_by_bytes(
    stream: RPCStream,
    patience: float,
    relay: Callable[[int], None] | None = None,
) -> Iterator[tuple[trio.CancelScope, ProgressDeadline]]:
    """A cancel scope due ``patience`` s from now whose deadline moves while ``stream``'s bytes
    keep arriving (``ProgressDeadline``); each count is also passed to ``relay``. On leaving,
    the stream has no byte hook."""
    guard = ProgressDeadline(trio.current_time() + patience, patience)
    with trio.CancelScope(deadline=guard.deadline) as scope:

        def on_bytes(count: int) -> None:
            scope.deadline = guard.on_bytes(count, trio.current_time())
            if relay is not None:
                relay(count)

        stream.on_bytes = on_bytes
        try:
            yield scope, guard
        finally:
            stream.on_bytes = None
