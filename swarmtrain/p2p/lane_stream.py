"""One data lane's byte stream: 1 MiB AES-256-GCM records over a plain TCP socket
(``LaneStream``), with the interface ``RPCStream`` expects of a libp2p stream. How lanes are
set up (tickets, dialling, accepting) is ``lane.py``'s job."""

from __future__ import annotations

import socket

import trio

from swarmtrain.p2p.errors import LaneClosedError, LaneEndOfStream, LaneResetError
from swarmtrain.p2p.lane_records import (
    HEADER_SIZE,
    MAX_RECORD_CIPHERTEXT,
    MAX_RECORD_PLAINTEXT,
    TAG_SIZE,
    LaneRecordError,
    RecordOpener,
    RecordSealer,
)

RECV_BUFFER_FIRST = 64 * 1024
#: a lane that moves this many bytes without ever waiting for its socket lets other tasks run
#: (once), so a long transfer on a fast link cannot hold the event loop
YIELD_EVERY_BYTES = 4 * 1024 * 1024
WRITE_STALL_TIMEOUT = 60.0  # a write that makes no progress this long fails (TooSlowError)
ACCEPTED = b"swarmtrain-lane-ok"


class _Held:
    """``async with _Held(lock)``: holds a trio lock, without yielding when it is free
    (``trio.Lock.acquire`` always yields to the scheduler, once per record read or written)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: trio.StrictFIFOLock):
        self._lock = lock

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc_info) -> None:
        self._lock.release()


class LaneStream:
    """One lane with the byte-stream interface ``RPCStream`` expects of a libp2p stream:
    ``read`` (raises ``LaneEndOfStream`` at the clean end), ``write``, ``close``, ``reset``."""

    #: a cancelled write harms only this lane (RPCStream need not shield writes from
    #: cancellation, as it must for Noise over a shared libp2p connection)
    cancel_safe = True
    #: the most plaintext one record carries (a receive buffer this large takes it in place)
    record_size = MAX_RECORD_PLAINTEXT
    #: how long the caller's pool may reuse this lane while idle (``lane_books.lane_reuse_time``,
    #: set when it opened; None: the pool's default)
    reuse_time: float | None = None

    def __init__(self, raw: socket.socket, sock, sealer: RecordSealer, opener: RecordOpener):
        """``raw`` is the connected stdlib socket and ``sock`` its trio wrapper."""
        if raw.family in (socket.AF_INET, socket.AF_INET6):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._raw, self._sock = raw, sock
        self.raw = raw
        self.stripe = 0  # its index in a striped lane (``lane_stripes``)
        self._sealer, self._opener = sealer, opener
        # grows with the records' bytes as they arrive (up to MAX_RECORD_CIPHERTEXT), so an
        # idle or silent lane holds no record buffer
        self._recv_buffer = bytearray()
        # plaintext of the last record not yet returned by read() / read_into()
        self._pending: bytes | memoryview = b""
        # the record being received: header bytes so far, then its size and body bytes so far
        self._rx_header = bytearray(HEADER_SIZE)
        self._rx_header_got = 0
        self._rx_size: int | None = None
        self._rx_got = 0
        self._send_lock = trio.StrictFIFOLock()
        self._recv_lock = trio.StrictFIFOLock()
        self.closed = False
        self._broken = False
        self.eof_received = False
        self.bytes_on_wire = 0
        self.yield_every_bytes = YIELD_EVERY_BYTES
        self._moved_without_wait = 0  # bytes read or written since this lane last yielded

    # ---------------------------------------------------------------- reading

    async def _fill(self, view: memoryview, got: int) -> int:
        """Receive into ``view[got:]`` once; the new fill level. A cancelled receive takes no
        bytes (it is cancelled only while waiting), so progress kept in ``self`` is never lost.

        The socket is read directly (trio waits only when it has no data): trio's socket
        methods yield to the scheduler after every successful call, several times per record.
        """
        while True:
            try:
                count = self._raw.recv_into(view[got:])
                break
            except BlockingIOError:
                pass
            except OSError as e:
                raise LaneResetError(f"the lane failed: {e!r}") from None
            try:
                await trio.lowlevel.wait_readable(self._raw.fileno())
            except trio.ClosedResourceError:
                raise LaneClosedError("the lane was closed") from None
            self._moved_without_wait = 0
        if count == 0:
            raise LaneResetError("the lane was cut without an end record")
        self.bytes_on_wire += count
        await self._pace(count)
        return got + count

    async def _pace(self, count: int) -> None:
        """Count bytes moved without waiting; past ``yield_every_bytes``, let other tasks run.
        Never raises ``Cancelled`` (it may sit in the middle of a record)."""
        self._moved_without_wait += count
        if self._moved_without_wait >= self.yield_every_bytes:
            self._moved_without_wait = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _receive_body(self) -> memoryview:
        """The next record's ciphertext (a view of the receive buffer, valid until the next
        call). Resumable: a read cancelled midway (a timeout around it) leaves the partial
        header or body in place for the next call."""
        try:
            while self._rx_size is None:
                self._rx_header_got = await self._fill(
                    memoryview(self._rx_header), self._rx_header_got
                )
                if self._rx_header_got == HEADER_SIZE:
                    self._rx_size = self._opener.ciphertext_size(bytes(self._rx_header))
                    self._rx_got = 0
        except LaneRecordError as e:
            raise LaneResetError(f"lane: {e}") from None
        while self._rx_got < self._rx_size:
            if self._rx_got == len(self._recv_buffer):
                self._grow_recv_buffer()
            body = memoryview(self._recv_buffer)[: min(self._rx_size, len(self._recv_buffer))]
            self._rx_got = await self._fill(body, self._rx_got)
            body.release()
        self._rx_size, self._rx_header_got = None, 0
        return memoryview(self._recv_buffer)[: self._rx_got]

    def _grow_recv_buffer(self) -> None:
        """Room for more of the record being received: double what arrived (64 KiB first)."""
        size = min(MAX_RECORD_CIPHERTEXT, max(RECV_BUFFER_FIRST, 2 * len(self._recv_buffer)))
        grown = bytearray(size)  # a new buffer: views of the old one may still be around
        grown[: self._rx_got] = self._recv_buffer[: self._rx_got]
        self._recv_buffer = grown

    async def _receive_record(self) -> bytes:
        """The next record's plaintext (b"" for the end record)."""
        body = await self._receive_body()
        try:
            return self._opener.open(body)
        except LaneRecordError as e:
            raise LaneResetError(f"lane: {e}") from None

    async def receive_record(self) -> bytes:
        """The next record's whole plaintext (b"" for the end record), for a striped lane
        that reads its stripes record by record; resumable like ``read``."""
        if self.closed:
            raise LaneClosedError("the lane is closed")
        if self.eof_received:
            raise LaneEndOfStream("the peer ended the lane")
        record = await self._receive_record()
        if not record:
            self.eof_received = True
        return record

    def fileno(self) -> int:
        return self._raw.fileno()

    async def read(self, n: int | None = None) -> bytes:
        """Up to ``n`` bytes (one record's worth when ``n`` is None)."""
        if self.closed:
            raise LaneClosedError("the lane is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        async with _Held(self._recv_lock):
            if not self._pending:
                if self.eof_received:
                    raise LaneEndOfStream("the peer ended the lane")
                self._pending = await self._receive_record()
                if not self._pending:
                    self.eof_received = True
                    raise LaneEndOfStream("the peer ended the lane")
            if n is None or n >= len(self._pending):
                data, self._pending = self._pending, b""
            else:
                data, self._pending = self._pending[:n], self._pending[n:]
            return bytes(data)

    async def read_into(self, view: memoryview) -> int:
        """Receive up to ``len(view)`` bytes into ``view``; the count. A record that fits is
        decrypted straight into ``view`` (no copy). Raises ``LaneEndOfStream`` at the clean end."""
        if self.closed:
            raise LaneClosedError("the lane is closed")
        if not len(view):
            return 0
        await trio.lowlevel.checkpoint_if_cancelled()
        async with _Held(self._recv_lock):
            if not self._pending:
                if self.eof_received:
                    raise LaneEndOfStream("the peer ended the lane")
                body = await self._receive_body()
                size = len(body) - TAG_SIZE
                try:
                    if 0 < size <= len(view):
                        return self._opener.open_into(body, view[:size])
                    self._pending = memoryview(self._opener.open(body))
                except LaneRecordError as e:
                    raise LaneResetError(f"lane: {e}") from None
                if not self._pending:
                    self.eof_received = True
                    raise LaneEndOfStream("the peer ended the lane")
            count = min(len(view), len(self._pending))
            view[:count] = self._pending[:count]
            self._pending = self._pending[count:]
            return count

    async def receive_accept(self) -> None:
        """The callee's first record must be the accept marker (it holds the keys)."""
        record = await self._receive_record()
        if record != ACCEPTED:
            raise LaneResetError("the lane did not start with the accept record")

    # ---------------------------------------------------------------- writing

    async def _send_all(self, data) -> None:
        """Send all of ``data`` (directly, like ``_fill``); ``trio.TooSlowError`` when the
        peer takes nothing for ``WRITE_STALL_TIMEOUT`` seconds."""
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            try:
                count = self._raw.send(view[sent:])
                sent += count
                await self._pace(count)
                continue
            except BlockingIOError:
                pass
            except OSError as e:
                raise LaneResetError(f"the lane failed: {e!r}") from None
            try:
                with trio.fail_after(WRITE_STALL_TIMEOUT):
                    await trio.lowlevel.wait_writable(self._raw.fileno())
            except trio.ClosedResourceError:
                raise LaneClosedError("the lane was closed") from None
            self._moved_without_wait = 0
        self.bytes_on_wire += len(data)

    async def write(self, data) -> None:
        """Send ``data``. Cancellation-safe for the connection as a whole: a write cancelled
        midway breaks only this lane (it is then closed without an end record)."""
        if self.closed or self._broken:
            raise LaneClosedError("the lane is closed")
        if not len(data):
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        async with _Held(self._send_lock):
            try:
                for record in self._sealer.seal(data):
                    await self._send_all(record)
            except BaseException:
                self._broken = True  # a record may be cut: nothing more can follow it
                raise

    async def send_accept(self) -> None:
        async with self._send_lock:
            for record in self._sealer.seal(ACCEPTED):
                await self._send_all(record)

    # ---------------------------------------------------------------- ending

    def is_reusable(self) -> bool:
        """Open both ways, with nothing (not even an end of stream) waiting to be read."""
        if self.closed or self._broken or self.eof_received or self._pending or self._sealer.ended:
            return False
        try:
            self._raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # an end of stream or stray bytes: either way not idle

    async def close(self) -> None:
        """End our direction with an end record, then close the connection."""
        if self.closed:
            return
        try:
            await self._send_end()
        except (LaneResetError, LaneClosedError, LaneRecordError):
            pass
        finally:
            self._close_socket()

    async def _send_end(self) -> None:
        """Our end record, unless it went out already or the lane broke."""
        if not self._sealer.ended and not self._broken:
            async with self._send_lock:
                await self._send_all(self._sealer.seal_end())

    async def close_after_peer(self, linger: float) -> None:
        """End our direction with an end record, then drop what the peer still sends until it
        ends or closes its side (at most ``linger`` seconds), then close: a socket closed with
        bytes unread resets the connection, and a reset may drop what we sent last (a
        ``NOT_SERVED`` answer, on a lossy path). Never raises."""
        if self.closed:
            return
        try:
            await self._send_end()
            self._raw.shutdown(socket.SHUT_WR)
            scratch = bytearray(RECV_BUFFER_FIRST)
            with trio.move_on_after(linger):
                while True:
                    try:
                        if not self._raw.recv_into(scratch):
                            break  # the peer closed its side
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(self._raw.fileno())
        except (OSError, LaneResetError, LaneClosedError, trio.TooSlowError):
            pass  # cut or stalled: closed below all the same
        except trio.ClosedResourceError:
            pass
        finally:
            self._close_socket()

    async def reset(self) -> None:
        self._close_socket()

    def reset_now(self) -> None:
        """Close the connection at once (no end record), from synchronous code."""
        self._close_socket()

    def _close_socket(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()
