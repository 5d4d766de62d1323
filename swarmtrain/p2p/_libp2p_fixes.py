"""Fixes for py-libp2p 0.8.1 bugs that swarmtrain works around (each checked for its internals)."""

from __future__ import annotations

import trio

#: a yamux frame whose socket write makes no progress for this long: the connection is dead
FRAME_WRITE_TIMEOUT = 60.0


def fix_cancelled_frame_writes() -> None:
    """Make every yamux frame write all-or-nothing under cancellation, idempotently.

    py-libp2p 0.8.1 writes each frame with ``await secured_conn.write(frame)``: Noise encrypts
    it (spending a nonce), then sends it. A task cancelled inside that await (a timeout around
    an RPC, a cancelled step) either drops an encrypted message or sends part of it; the peer
    then fails to decrypt everything after it and the connection is dead for good (measured:
    8 concurrent RPCs cancelled at random moments killed the connection within a few rounds,
    and every later call failed "No valid connections available"). Here the wait for the
    connection's write lock stays cancellable (nothing is sent yet) and the write itself is
    shielded, bounded by ``FRAME_WRITE_TIMEOUT``; a frame that cannot be written in that time
    closes the connection (it may be half-sent). Also drops the per-frame debug formatting.
    """
    from libp2p.stream_muxer.exceptions import MuxedConnUnavailable
    from libp2p.stream_muxer.yamux import yamux as yamux_module

    current = getattr(yamux_module.Yamux, "_write_frame", None)
    if current is None:
        raise RuntimeError("libp2p internals changed: Yamux._write_frame is missing")
    if getattr(current, "swarmtrain_fixed", False):
        return

    async def write_frame(self, data: bytes) -> None:
        async with self._write_lock:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(FRAME_WRITE_TIMEOUT) as stalled:
                    await self.secured_conn.write(data)
                if stalled.cancelled_caught:
                    with trio.move_on_after(1.0):
                        await self.secured_conn.close()
        if stalled.cancelled_caught:
            raise MuxedConnUnavailable(
                f"a yamux frame write made no progress for {FRAME_WRITE_TIMEOUT} s"
            )
        await trio.lowlevel.checkpoint()

    write_frame.swarmtrain_fixed = True  # type: ignore[attr-defined]
    yamux_module.Yamux._write_frame = write_frame


def _fix_hole_punch_dial_leak() -> None:
    """Replace py-libp2p 0.8.1's source-bound TCP dial, which only DCUtR uses, idempotently.

    DCUtR dials every address of the peer at once from our listen port and cancels the other
    dials as soon as one direct connection verifies. The original function closes its socket
    only on ``OSError``, so a dial cancelled inside ``bind``/``connect`` leaks the socket
    (a ``ResourceWarning`` at garbage collection; measured in about 1 of 12 loopback hole
    punches with a listening target). This version closes it on every exit but success.
    """
    from libp2p.transport.tcp import tcp as tcp_module

    current = getattr(tcp_module, "_open_tcp_stream_from", None)
    if getattr(current, "swarmtrain_fixed", False):
        return
    for name in ("_open_tcp_stream_from", "_set_reuse_flags", "OpenConnectionError"):
        if not hasattr(tcp_module, name):
            raise RuntimeError(f"libp2p internals changed: {tcp_module.__name__}.{name} is missing")
    set_reuse_flags = tcp_module._set_reuse_flags
    open_error = tcp_module.OpenConnectionError

    async def open_tcp_stream_from(host: str, port: int, source: tuple[str, int]):
        src_ip, src_port = source
        if (":" in src_ip) != (":" in host):
            raise open_error(f"Source/destination IP family mismatch: {src_ip} vs {host}")
        family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
        try:
            sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
        except OSError as e:
            raise open_error(f"Failed to create TCP socket: {e}") from e
        bound = False
        try:
            set_reuse_flags(sock)
            try:
                await sock.bind((src_ip, src_port))
                bound = True
            except OSError:
                pass  # this platform cannot share the listen port: dial from an ephemeral one
            if bound:
                await sock.connect((host, port))
                return trio.SocketStream(sock)
        except OSError as e:
            sock.close()
            raise open_error(
                f"Failed to connect {host}:{port} from {src_ip}:{src_port}: {e}"
            ) from e
        except BaseException:
            sock.close()
            raise
        sock.close()
        try:
            return await trio.open_tcp_stream(host, port)
        except OSError as e:
            raise open_error(f"Failed to connect {host}:{port}: {e}") from e

    open_tcp_stream_from.swarmtrain_fixed = True  # type: ignore[attr-defined]
    tcp_module._open_tcp_stream_from = open_tcp_stream_from


#: how long a yamux write waits for the peer to open a closed send window (py-libp2p's value)
WINDOW_WAIT_TIMEOUT = 5.0
_WINDOW_EVENT = "_swarmtrain_window_event"


def wake_writers_on_window_updates() -> None:
    """Wake a yamux writer blocked on a closed send window as soon as credit arrives.

    py-libp2p 0.8.1's ``YamuxStream.write`` polls a closed send window every 10 ms. When the
    receiver grants credit in large batches (``batch_window_updates``), the window closes at
    every batch and each poll costs up to 10 ms: one-process bulk throughput fell from 122 to
    36 MiB/s. Here ``send_window`` and ``closed`` become properties whose setters set an event
    (the incoming-frame handler assigns both), and ``write`` waits on that event; it still
    gives up after ``WINDOW_WAIT_TIMEOUT`` seconds without credit, as py-libp2p did, and sends
    the same frames. Idempotent; apply before any yamux stream exists.
    """
    import struct

    from libp2p.stream_muxer.exceptions import MuxedStreamError
    from libp2p.stream_muxer.yamux import yamux as yamux_module

    stream_class = yamux_module.YamuxStream
    if getattr(stream_class.write, "swarmtrain_fixed", False):
        return
    for name in ("HEADER_SIZE", "YAMUX_HEADER_FORMAT", "TYPE_DATA", "MAX_MESSAGE_SIZE"):
        if not hasattr(yamux_module, name):
            raise RuntimeError(f"libp2p internals changed: {yamux_module.__name__}.{name}")
    for name in ("rw_lock", "window_lock", "send_closed", "send_window", "closed"):
        if name not in stream_class.__init__.__code__.co_names:
            raise RuntimeError(f"libp2p internals changed: YamuxStream.{name} is not set")
    header_size = yamux_module.HEADER_SIZE
    header_format = yamux_module.YAMUX_HEADER_FORMAT
    type_data = yamux_module.TYPE_DATA

    def wake(stream) -> None:
        event = stream.__dict__.get(_WINDOW_EVENT)
        if event is not None:
            event.set()

    def get_send_window(self) -> int:
        return self._swarmtrain_send_window

    def set_send_window(self, value: int) -> None:
        grew = value > self.__dict__.get("_swarmtrain_send_window", 0)
        self._swarmtrain_send_window = value
        if grew:
            wake(self)

    def get_closed(self) -> bool:
        return self._swarmtrain_closed

    def set_closed(self, value: bool) -> None:
        self._swarmtrain_closed = value
        if value:
            wake(self)

    async def wait_for_window(self) -> None:
        deadline = trio.current_time() + WINDOW_WAIT_TIMEOUT
        while self.send_window <= 0 and not self.closed:
            event = self.__dict__.get(_WINDOW_EVENT)
            if event is None or event.is_set():
                event = trio.Event()  # shared by all writers of this stream until set
                setattr(self, _WINDOW_EVENT, event)
            with trio.move_on_at(deadline):
                await event.wait()
            if trio.current_time() >= deadline and self.send_window <= 0 and not self.closed:
                raise MuxedStreamError(
                    f"Timed out waiting for window update after {WINDOW_WAIT_TIMEOUT} seconds."
                )

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
                                yamux_module.MAX_MESSAGE_SIZE - header_size,  # tuned at runtime
                                total - sent,
                            )
                            self.send_window -= size
                            header = struct.pack(
                                header_format, 0, type_data, 0, self.stream_id, size
                            )
                            frame = header + data[sent : sent + size]
                if frame is None:
                    await wait_for_window(self)
            await self.conn._write_frame(frame)
            sent += size

    write.swarmtrain_fixed = True  # type: ignore[attr-defined]
    stream_class.send_window = property(get_send_window, set_send_window)
    stream_class.closed = property(get_closed, set_closed)
    stream_class.write = write


def batch_window_updates() -> None:
    """Grant yamux receive credit once half the window was consumed (go-yamux), idempotently.

    py-libp2p 0.8.1 grants the bytes of every read straight back in a WINDOW_UPDATE frame of
    its own (its "release on read" and "partial slack" branches), so every small RPC costs an
    extra encrypted frame and socket write on each side. Here a read sends an update only when
    the bytes consumed since the last grant reach half the current target window; each update
    doubles the target (up to py-libp2p's 16 MiB) and restores the full window. py-libp2p's
    own auto-tuning doubles only when updates come within 4 RTTs of each other: fed with
    per-read updates it reached 16 MiB within a few reads, fed with batched ones it stayed at
    512 KiB on loopback, and a writer of an older version (polling a closed window every
    10 ms) then moved 42 MiB/s instead of ~140. Needs ``wake_writers_on_window_updates``: a
    sender whose window closes between batches must resume at once, not at its next poll.
    Also stops py-libp2p's round-trip-time pings, which fed only the replaced auto-tuning.
    """
    from libp2p.stream_muxer.yamux import yamux as yamux_module

    stream_class = yamux_module.YamuxStream
    current = getattr(stream_class, "_auto_tune_and_send_window_update", None)
    for name in ("_auto_tune_and_send_window_update", "_grow_to_delta", "send_window_update"):
        if not hasattr(stream_class, name):
            raise RuntimeError(f"libp2p internals changed: YamuxStream.{name} is missing")
    if getattr(current, "swarmtrain_fixed", False):
        return
    max_window = yamux_module.MAX_WINDOW_SIZE

    async def send_window_update_when_due(self, *, bytes_read: int = 0) -> None:
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            consumed = self.target_recv_window - (self.recv_window + buffered)
            if consumed <= 0 or consumed < self.target_recv_window // 2:
                return
            # grow the window at every batch (py-libp2p's RTT-based rule, fed with its
            # per-read updates, grew it to the maximum within a few reads anyway)
            self.target_recv_window = min(2 * self.target_recv_window, max_window)
            increment = self._grow_to_delta(buffered)
            self._pending_recv_release = 0
        await self.send_window_update(increment, skip_lock=True)

    send_window_update_when_due.swarmtrain_fixed = True  # type: ignore[attr-defined]
    stream_class._auto_tune_and_send_window_update = send_window_update_when_due
    # The round-trip time py-libp2p measures (a ping 0.5 s after every connection opens, then
    # every 30 s) feeds only the auto-tuning replaced above, and a missing pong changes
    # nothing; with ~50 connections per DHT node the pings were ~2% of a node's CPU.
    # (Pings from the other side are still answered by the connection's read loop.)
    connection_class = yamux_module.Yamux
    if not hasattr(connection_class, "_measure_rtt_loop"):
        raise RuntimeError("libp2p internals changed: Yamux._measure_rtt_loop is missing")

    async def measure_no_rtt(self) -> None:
        return None

    connection_class._measure_rtt_loop = measure_no_rtt
