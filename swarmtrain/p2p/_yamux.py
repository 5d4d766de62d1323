"""swarmtrain's yamux: py-libp2p 0.8.1's ``Yamux`` with these changes, for our hosts only.

Our hosts' upgraders adopt every new yamux connection into ``TunedYamux``
(``use_tuned_yamux``, from ``_tuning.tune_host``), which adopts every stream it stores
(``_AdoptingStreams``) into ``TunedYamuxStream``. py-libp2p's own classes and module are left
as imported, so a stock host in the same process behaves as stock py-libp2p. The changes:

- Frames of up to ``MAX_FRAME_SIZE`` (1 MiB) instead of 64 KiB (a Python round trip each;
  sender side only: any yamux receiver accepts frames up to its window).
- Cancelled frame writes: a task cancelled while py-libp2p writes a frame killed the whole
  connection; frame writes are all-or-nothing here (``TunedYamux._write_frame``).
- Writers blocked on a closed send window are woken by the window update instead of polling
  every 10 ms (``send_window``/``closed`` properties whose setters set an event).
- Window updates: py-libp2p sends a WINDOW_UPDATE after every read (two extra encrypted frames
  per small RPC); credit goes back once half the window was consumed, as in go-yamux, and the
  round-trip-time pings (which fed only the replaced auto-tuning) are not sent.
  ``SWARMTRAIN_YAMUX_UPDATE_PER_READ=1`` keeps py-libp2p's per-read updates and pings.
- Receive windows are enforced: py-libp2p logs a peer that sends past a stream's receive
  window and buffers the data anyway, so a peer ignoring flow control could pile up any
  amount on a stream nobody reads (one the callee half-closed after refusing a call, say).
  Here each stream's buffer (``_WindowedBuffer``) refuses data past the window (plus
  ``WINDOW_SLACK``): the data is dropped and the connection closed, as go-yamux does.
- The read loop never waits for a write: py-libp2p's read loop writes the ACK of each new
  stream (and RSTs, ping replies) itself, under the connection's write lock. When both
  peers' socket buffers are full (bulk data both ways, a long RTT: TCP windows still small),
  each read loop waited behind its own blocked data writer for a socket the other side had
  stopped reading, and the connection froze until ``FRAME_WRITE_TIMEOUT`` (seen at 300 ms
  RTT through the netlab's packet-level delay line: every all-reduce stream stalled). Here
  the read loop queues those frames (at most ``MAX_QUEUED_CONTROL_FRAMES``; more: the peer is
  flooding, the connection is closed) and a task of the connection writes them.
- Slow paths (issue 18, 300 ms RTT and 1% loss: ~40 KB/s per connection): frames follow the
  connection's measured write rate (``stall_core.FrameSizer``: ~0.25 s of it, 16 KiB to
  1 MiB), so the window updates, stream opens and small calls queued behind bulk frames wait
  a fraction of a second, not ~25 s per 1 MiB frame (and a stock receiver's 60 s limit on a
  frame body holds); a connection with a kernel RTT of at least ``LONG_PATH_RTT`` gets
  ``TCP_NOTSENT_LOWAT`` (``NOTSENT_LOWAT``), so the kernel holds at most that much unsent
  data ahead of a window update instead of up to 4 MiB (~100 s at that rate). A writer
  waits for a closed send window up to ``WINDOW_WAIT_TIMEOUT`` (300 s, py-libp2p: 5 s): a
  window stays closed while the peer's application has not read (an all-reduce reducer
  reads a sender's next part only after every sender's previous one), which is backpressure,
  not a fault; the callers' own deadlines come first. A failed wait names itself
  (``WindowWaitTimeout``) rather than surfacing as the peer's reset.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct

import trio
from libp2p.stream_muxer.exceptions import MuxedConnUnavailable, MuxedStreamError
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux import yamux as yamux_module
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from swarmtrain.p2p.stall_core import FrameSizer
from swarmtrain.p2p.tcp_info import tcp_rtt, tcp_socket_of

#: the largest yamux frame our streams send (py-libp2p: 64 KiB)
MAX_FRAME_SIZE = 1024 * 1024
#: a yamux frame whose socket write makes no progress for this long: the connection is dead
FRAME_WRITE_TIMEOUT = 60.0
#: how long a yamux write waits for the peer to open a closed send window (py-libp2p: 5 s,
#: which failed honest streams whose reader was slow or whose path was; see the docstring):
#: a backstop against a peer that never reads, above any caller's own patience (an
#: all-reduce reducer may read a sender's next part only minutes later on a lossy path)
WINDOW_WAIT_TIMEOUT = 300.0
#: a connection whose kernel RTT is at least this is a long path: ``NOTSENT_LOWAT`` is set
LONG_PATH_RTT = 0.01
#: unsent bytes the kernel may queue on a long path's socket (the rest waits in frames)
NOTSENT_LOWAT = 128 * 1024
#: bytes a peer may send past a stream's receive window, in all (leniency), before the
#: connection is closed; a stream never buffers more than its window plus this
WINDOW_SLACK = 64 * 1024
#: control frames (ACK, RST, ping replies, 12 bytes each) the read loop may queue for writing;
#: more: the peer opens streams or pings faster than the socket takes our answers (closed)
MAX_QUEUED_CONTROL_FRAMES = 4096

logger = logging.getLogger(__name__)

_HEADER_SIZE = yamux_module.HEADER_SIZE
_HEADER_FORMAT = yamux_module.YAMUX_HEADER_FORMAT
_TYPE_DATA = yamux_module.TYPE_DATA
_MAX_WINDOW = yamux_module.MAX_WINDOW_SIZE


def _updates_per_read() -> bool:
    return os.environ.get("SWARMTRAIN_YAMUX_UPDATE_PER_READ") == "1"


class WindowWaitTimeout(MuxedStreamError):
    """The peer opened no send window for ``WINDOW_WAIT_TIMEOUT`` s (it does not read the
    stream); py-libp2p reports it as a reset of the stream, with this as its cause."""


def tune_long_path(conn: Yamux) -> float | None:
    """Set ``TCP_NOTSENT_LOWAT`` on ``conn``'s socket when its RTT is at least
    ``LONG_PATH_RTT``; returns the RTT (None: unknown, nothing set)."""
    sock = tcp_socket_of(conn)
    rtt = None if sock is None else tcp_rtt(sock)
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if rtt is not None and rtt >= LONG_PATH_RTT and option is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, NOTSENT_LOWAT)
        except OSError:
            pass
    return rtt


class TunedYamuxStream(YamuxStream):
    """A yamux stream with 1 MiB frames, woken writers and batched window updates.

    Streams are built by py-libp2p's ``Yamux`` code as ``YamuxStream`` and adopted into this
    class by ``TunedYamux`` (``adopt``) before anything else sees them."""

    _window_event: trio.Event | None = None
    _send_window_value: int  # set by adopt
    _closed_value: bool  # set by adopt

    @classmethod
    def adopt(cls, stream: YamuxStream) -> None:
        """Turn a freshly built ``YamuxStream`` into one of this class, in place."""
        if type(stream) is cls:
            return
        if type(stream) is not YamuxStream:
            raise TypeError(f"cannot adopt a {type(stream).__name__} stream")
        state = stream.__dict__
        # YamuxStream.__init__ set these as instance attributes; here they are properties
        send_window, closed = state.pop("send_window"), state.pop("closed")
        stream.__class__ = cls
        assert isinstance(stream, cls)
        stream._send_window_value = send_window
        stream._closed_value = closed

    # -------------------------------------------- send window and closed: wake writers

    def _wake(self) -> None:
        event = self._window_event
        if event is not None:
            event.set()

    @property
    def send_window(self) -> int:
        return self._send_window_value

    @send_window.setter
    def send_window(self, value: int) -> None:
        grew = value > self._send_window_value
        self._send_window_value = value
        if grew:
            self._wake()

    @property
    def closed(self) -> bool:
        return self._closed_value

    @closed.setter
    def closed(self, value: bool) -> None:
        self._closed_value = value
        if value:
            self._wake()

    async def _wait_for_window(self) -> None:
        deadline = trio.current_time() + WINDOW_WAIT_TIMEOUT
        while self.send_window <= 0 and not self.closed:
            event = self._window_event
            if event is None or event.is_set():
                event = self._window_event = trio.Event()  # shared by this stream's writers
            with trio.move_on_at(deadline):
                await event.wait()
            if trio.current_time() >= deadline and self.send_window <= 0 and not self.closed:
                raise WindowWaitTimeout(
                    f"the peer opened no yamux send window for {WINDOW_WAIT_TIMEOUT} s "
                    "(it does not read the stream)"
                )

    def _frame_limit(self) -> int:
        conn = self.conn
        return conn.frame_sizer.frame_size if isinstance(conn, TunedYamux) else MAX_FRAME_SIZE

    async def write(self, data: bytes) -> None:
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        total, sent = len(data), 0
        while sent < total:
            frame = None
            while frame is None:
                async with self.rw_lock.write_lock():
                    if self.send_closed:
                        raise MuxedStreamError("Stream is closed for sending")
                    async with self.window_lock:
                        if self.closed:
                            raise MuxedStreamError("Stream is closed")
                        if self.send_window > 0:
                            size = min(
                                self.send_window,
                                self._frame_limit() - _HEADER_SIZE,
                                total - sent,
                            )
                            self.send_window -= size
                            header = struct.pack(
                                _HEADER_FORMAT, 0, _TYPE_DATA, 0, self.stream_id, size
                            )
                            frame = header + data[sent : sent + size]
                if frame is None:
                    await self._wait_for_window()
            await self.conn._write_frame(frame)
            sent += size

    # --------------------------------------------------- receive credit in batches

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        """Grant credit once half the target window was consumed; each grant doubles the target
        (up to py-libp2p's 16 MiB) and restores the full window. (py-libp2p's own rule doubles
        only when updates come within 4 RTTs: fed with batched updates it stayed at 512 KiB.)"""
        if _updates_per_read():
            await super()._auto_tune_and_send_window_update(bytes_read=bytes_read)
            return
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            consumed = self.target_recv_window - (self.recv_window + buffered)
            if consumed <= 0 or consumed < self.target_recv_window // 2:
                return
            self.target_recv_window = min(2 * self.target_recv_window, _MAX_WINDOW)
            increment = self._grow_to_delta(buffered)
            self._pending_recv_release = 0
        await self.send_window_update(increment, skip_lock=True)


class TunedMuxerMultistream(MuxerMultistream):
    """py-libp2p's muxer selection whose yamux connections are ``TunedYamux``es (our hosts'
    upgraders get theirs adopted into this class, ``use_tuned_yamux``)."""

    async def new_conn(self, conn, peer_id):
        muxed = await super().new_conn(conn, peer_id)
        if type(muxed) is Yamux:
            TunedYamux.adopt(muxed)
        return muxed


def use_tuned_yamux(host) -> None:
    """Make ``host``'s (a py-libp2p BasicHost, not yet running) yamux connections
    ``TunedYamux``es: its upgrader's muxer selection becomes a ``TunedMuxerMultistream``."""
    upgrader = host.get_network().upgrader
    if type(upgrader.muxer_multistream) is not MuxerMultistream:
        raise RuntimeError("libp2p internals changed: the upgrader has no MuxerMultistream")
    upgrader.muxer_multistream.__class__ = TunedMuxerMultistream


class _WindowedBuffer(bytearray):
    """The receive buffer of one stream of a ``TunedYamux``: data past the stream's receive
    window is refused (``TunedYamux.window_exceeded``) instead of buffered."""

    def __init__(self, conn: TunedYamux, stream_id: int, data=b""):
        super().__init__(data)
        self.conn, self.stream_id = conn, stream_id
        self.overshoot = 0  # bytes received past the window, in all

    def extend(self, data) -> None:
        conn = self.conn
        if conn.flow_control_broken:
            return  # the connection is closing: drop whatever still comes
        stream = conn.streams.get(self.stream_id)
        window = stream.recv_window if stream is not None else 0
        over = len(data) - max(window, 0)
        if over > 0:
            self.overshoot += over  # (py-libp2p then sets the window to 0, not below)
            if self.overshoot > WINDOW_SLACK:
                conn.window_exceeded(self.stream_id, self.overshoot)
                return
        super().extend(data)


class _WindowedBuffers(dict):
    """``Yamux.stream_buffers`` of a ``TunedYamux``: every buffer stored is windowed."""

    def __init__(self, conn: TunedYamux):
        super().__init__()
        self.conn = conn

    def __setitem__(self, stream_id, buffer) -> None:
        if not isinstance(buffer, _WindowedBuffer):
            buffer = _WindowedBuffer(self.conn, stream_id, buffer)
        super().__setitem__(stream_id, buffer)


class _AdoptingStreams(dict):
    """``Yamux.streams`` of a ``TunedYamux``: adopts every stream stored into it."""

    def __setitem__(self, stream_id, stream) -> None:
        TunedYamuxStream.adopt(stream)
        super().__setitem__(stream_id, stream)


class TunedYamux(Yamux):
    """py-libp2p's yamux connection whose streams are ``TunedYamuxStream``s.

    py-libp2p builds its ``Yamux`` by name (``MuxerMultistream.new_conn`` ignores the class in
    ``muxer_opt`` for yamux), so our upgrader's muxer selection (``TunedMuxerMultistream``)
    adopts each new connection into this class before it starts."""

    #: the peer sent past a receive window: the connection is being closed
    flow_control_broken = False
    #: the size of the data frames our streams write (set by adopt)
    frame_sizer: FrameSizer
    #: the kernel's RTT when the connection was adopted (None: unknown, e.g. relayed)
    path_rtt: float | None = None

    @classmethod
    def adopt(cls, conn: Yamux) -> None:
        """Turn a freshly built, not yet started ``Yamux`` into one of this class, in place."""
        if type(conn) is not Yamux:
            raise TypeError(f"cannot adopt a {type(conn).__name__} connection")
        if conn.streams or type(conn.streams) is not dict or conn.event_started.is_set():
            raise RuntimeError("libp2p internals changed: a new Yamux has streams or started")
        buffers = getattr(conn, "stream_buffers", None)
        if type(buffers) is not dict or buffers or not hasattr(conn, "_nursery"):
            raise RuntimeError("libp2p internals changed: Yamux.stream_buffers or _nursery")
        conn.__class__ = cls
        assert isinstance(conn, cls)
        conn.streams = _AdoptingStreams()
        conn.stream_buffers = _WindowedBuffers(conn)
        conn.frame_sizer = FrameSizer(MAX_FRAME_SIZE)
        conn.path_rtt = tune_long_path(conn)

    def window_exceeded(self, stream_id: int, excess: int) -> None:
        """The peer sent ``excess`` bytes past the receive window of ``stream_id``: drop its
        data from now on and close the connection (from the connection's own nursery)."""
        if self.flow_control_broken:
            return
        self.flow_control_broken = True
        logger.warning(
            "peer %s sent %d bytes past the receive window of yamux stream %d: closing the "
            "connection",
            self.peer_id,
            excess,
            stream_id,
        )
        nursery = self._nursery
        if nursery is not None:
            nursery.start_soon(self.close)

    #: the task running the read loop (``handle_incoming``): it queues, never writes
    _reader: trio.lowlevel.Task | None = None
    _control_frames: collections.deque[bytes] | None = None
    _control_ready: trio.Event | None = None

    async def handle_incoming(self) -> None:
        self._reader = trio.lowlevel.current_task()
        await super().handle_incoming()

    async def _write_frame(self, data: bytes) -> None:
        if self._reader is not None and trio.lowlevel.current_task() is self._reader:
            self._queue_control_frame(data)
            await trio.lowlevel.checkpoint()
            return
        await self._write_frame_now(data)

    def _queue_control_frame(self, data: bytes) -> None:
        """Queue a frame of the read loop for ``_send_control_frames`` (started on first use in
        the connection's nursery)."""
        if self.flow_control_broken:
            return
        if self._nursery is None:
            raise MuxedConnUnavailable("the yamux connection is not running")
        if self._control_frames is None:
            self._control_frames = collections.deque()
            self._control_ready = trio.Event()
            self._nursery.start_soon(self._send_control_frames)
        if len(self._control_frames) >= MAX_QUEUED_CONTROL_FRAMES:
            self.flow_control_broken = True
            logger.warning(
                "peer %s: %d yamux control frames wait for the socket (stream opens or pings "
                "faster than it reads our answers): closing the connection",
                self.peer_id,
                len(self._control_frames),
            )
            self._nursery.start_soon(self.close)
            return
        self._control_frames.append(data)
        assert self._control_ready is not None
        self._control_ready.set()

    async def _send_control_frames(self) -> None:
        """Write the read loop's queued frames, in order, all that wait in one write."""
        frames, ready = self._control_frames, self._control_ready
        assert frames is not None and ready is not None
        while True:
            await ready.wait()
            self._control_ready = ready = trio.Event()
            while frames:
                batch = b"".join(frames)
                frames.clear()
                try:
                    await self._write_frame_now(batch)
                except Exception as e:  # the connection is failing: the read loop ends it
                    logger.debug("peer %s: control frames not sent: %r", self.peer_id, e)
                    return

    async def _write_frame_now(self, data: bytes) -> None:
        """Write one frame all-or-nothing under cancellation.

        py-libp2p writes with ``await secured_conn.write(frame)``: Noise encrypts the frame
        (spending a nonce), then sends it; a task cancelled inside drops an encrypted message or
        sends part of it, and the peer fails to decrypt everything after it. Here the wait for
        the write lock stays cancellable (nothing sent yet) and the write is shielded, bounded
        by ``FRAME_WRITE_TIMEOUT``; a frame that cannot be written in that time closes the
        connection (it may be half-sent)."""
        async with self._write_lock:
            with trio.CancelScope(shield=True):
                started = trio.current_time()
                with trio.move_on_after(FRAME_WRITE_TIMEOUT) as stalled:
                    await self.secured_conn.write(data)
                self.frame_sizer.on_write(len(data), trio.current_time() - started)
                if stalled.cancelled_caught:
                    with trio.move_on_after(1.0):
                        await self.secured_conn.close()
        if stalled.cancelled_caught:
            raise MuxedConnUnavailable(
                f"a yamux frame write made no progress for {FRAME_WRITE_TIMEOUT} s"
            )
        await trio.lowlevel.checkpoint()

    async def _measure_rtt_loop(self) -> None:
        """No pings: the round-trip time fed only the auto-tuning ``TunedYamuxStream`` replaces
        (~2% of a DHT node's CPU with ~50 connections). Pings from the peer are still answered."""
        if _updates_per_read():
            await super()._measure_rtt_loop()
