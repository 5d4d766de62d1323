"""A striped data lane: one RPC stream over several lane connections (``stripe_core``).

``StripedLane`` has the byte-stream interface ``RPCStream`` expects of a lane (``read``,
``read_into``, ``write``, ``close``, ``reset``, ``is_reusable``). Its stripes are
``LaneStream`` connections that share one ticket's keys (each with its own nonce prefix).
Writing: each record goes to a stripe whose socket can take it now; stripes send with
``TCP_NOTSENT_LOWAT``, so a socket counts as writable only when its own queue of unsent bytes
is short, and a flow that stalls (loss recovery) stops getting records while the others go
on. Reading: the stripes that ``StripeReassembler.wanted`` names are read at once, the first
records to complete are taken. A stripe that fails fails the whole lane (``LaneStripeError``
or the stripe's ``LaneResetError``): the call fails like one over a reset stream.
"""

from __future__ import annotations

import select
import socket

import trio

from swarmtrain.p2p.errors import LaneClosedError, LaneEndOfStream, LaneError
from swarmtrain.p2p.lane_stream import LaneStream
from swarmtrain.p2p.stripe_core import (
    STRIPE_RECORD_SIZE,
    StripeReassembler,
    StripeSender,
)

#: a stripe's socket counts as writable while fewer unsent bytes than this wait in it
NOTSENT_LOWAT = 128 * 1024
_TCP_NOTSENT_LOWAT: int | None = getattr(socket, "TCP_NOTSENT_LOWAT", None)


def set_notsent_lowat(raw: socket.socket, size: int = NOTSENT_LOWAT) -> bool:
    """Report ``raw`` writable only below ``size`` unsent bytes (Linux, macOS); False where
    the option is missing (the stripes then take records while their buffers have room)."""
    if _TCP_NOTSENT_LOWAT is None or raw.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        raw.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, size)
    except OSError:
        return False
    return True


class StripedLane:
    """Several lane connections carrying one byte stream (see the module docstring)."""

    cancel_safe = True
    record_size = STRIPE_RECORD_SIZE
    #: how long the caller's pool may reuse this lane while idle (``lane_books.lane_reuse_time``,
    #: set when it opened; None: the pool's default)
    reuse_time: float | None = None

    def __init__(self, stripes: list[LaneStream], window: int | None = None):
        if len(stripes) < 2:
            raise ValueError("a striped lane has at least two stripes")
        self.stripes = stripes
        self._sender = StripeSender(len(stripes))
        self._reassembler = StripeReassembler(len(stripes), window)
        self._fds = {lane.fileno(): i for i, lane in enumerate(stripes)}
        self._poll = select.poll()
        for fd in self._fds:
            self._poll.register(fd, select.POLLOUT)
        for lane in stripes:
            set_notsent_lowat(lane.raw)
        self._pending: memoryview | None = None  # the rest of the payload read() is returning
        self._send_lock = trio.StrictFIFOLock()
        self._recv_lock = trio.StrictFIFOLock()
        self.closed = False
        self._broken = False
        self.eof_received = False

    @property
    def bytes_on_wire(self) -> int:
        return sum(lane.bytes_on_wire for lane in self.stripes)

    def statistics(self) -> dict:
        return {
            "stripes": len(self.stripes),
            "records_per_stripe": list(self._sender.records_per_stripe),
            "peak_buffered_records": self._reassembler.peak_buffered,
        }

    # ---------------------------------------------------------------- reading

    async def _next_payload(self) -> memoryview:
        """The next payload in order; raises ``LaneEndOfStream`` at the clean end."""
        if self._pending:
            return self._pending
        reassembler = self._reassembler
        while True:
            payload = reassembler.pop()
            if payload is not None:
                self._pending = memoryview(payload)
                return self._pending
            try:
                wanted = reassembler.wanted()
            except LaneError:
                self._broken = True
                raise
            if not wanted:  # finished: every stripe ended, nothing left
                self.eof_received = True
                raise LaneEndOfStream("the peer ended the striped lane")
            await self._receive_some(wanted)

    async def _receive_some(self, wanted: list[int]) -> None:
        """Read one record from any of the ``wanted`` stripes (from several if they complete
        at once) into the reassembler. A read cancelled midway keeps its partial record in
        its stripe for the next call."""
        got: list[tuple[int, bytes]] = []
        failed: list[BaseException] = []

        async def read_one(stripe: int, scope: trio.CancelScope | None) -> None:
            try:
                got.append((stripe, await self.stripes[stripe].receive_record()))
            except LaneError as e:
                failed.append(e)
            if scope is not None:
                scope.cancel()

        try:
            if len(wanted) == 1:
                await read_one(wanted[0], None)
            else:
                async with trio.open_nursery() as nursery:
                    for stripe in wanted:
                        nursery.start_soon(read_one, stripe, nursery.cancel_scope)
        finally:  # records that completed are kept, even when this read was cancelled
            try:
                for stripe, record in got:
                    if record:
                        self._reassembler.on_record(stripe, record)
                    else:
                        self._reassembler.on_end(stripe)
            except LaneError:
                self._broken = True
                raise
        if failed:
            self._broken = True
            raise failed[0]

    async def read(self, n: int | None = None) -> bytes:
        """Up to ``n`` bytes (one record's worth when ``n`` is None)."""
        if self.closed:
            raise LaneClosedError("the lane is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        async with self._recv_lock:
            payload = await self._next_payload()
            count = len(payload) if n is None else min(n, len(payload))
            data = bytes(payload[:count])
            self._pending = payload[count:] if count < len(payload) else None
            return data

    async def read_into(self, view: memoryview) -> int:
        """Receive up to ``len(view)`` bytes into ``view``; the count."""
        if self.closed:
            raise LaneClosedError("the lane is closed")
        if not len(view):
            return 0
        await trio.lowlevel.checkpoint_if_cancelled()
        async with self._recv_lock:
            payload = await self._next_payload()
            count = min(len(view), len(payload))
            view[:count] = payload[:count]
            self._pending = payload[count:] if count < len(payload) else None
            return count

    # ---------------------------------------------------------------- writing

    def _writable(self) -> set[int]:
        return {self._fds[fd] for fd, _ in self._poll.poll(0)}

    async def _wait_any_writable(self) -> None:
        async def wait_one(lane: LaneStream, scope: trio.CancelScope) -> None:
            await trio.lowlevel.wait_writable(lane.fileno())
            scope.cancel()

        async with trio.open_nursery() as nursery:
            for lane in self.stripes:
                nursery.start_soon(wait_one, lane, nursery.cancel_scope)

    async def write(self, data) -> None:
        """Send ``data``, each record on a stripe that can take it. A write cancelled midway
        breaks the lane (a record may be cut)."""
        if self.closed or self._broken:
            raise LaneClosedError("the lane is closed")
        if not len(data):
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        async with self._send_lock:
            try:
                for frame in self._sender.frames(data):
                    stripe = self._sender.choose(self._writable())
                    while stripe is None:
                        await self._wait_any_writable()
                        stripe = self._sender.choose(self._writable())
                    await self.stripes[stripe].write(frame)
            except BaseException:
                self._broken = True
                raise

    # ---------------------------------------------------------------- ending

    def is_reusable(self) -> bool:
        """Open both ways, nothing buffered, every stripe idle."""
        if self.closed or self._broken or self.eof_received or self._pending:
            return False
        if self._reassembler.buffered:
            return False
        return all(lane.is_reusable() for lane in self.stripes)

    async def close(self) -> None:
        """End every stripe with its end record, then close them."""
        if self.closed:
            return
        self.closed = True
        try:
            for lane in self.stripes:
                if self._broken:
                    lane.reset_now()
                else:
                    await lane.close()
        finally:
            self.reset_now()

    async def reset(self) -> None:
        self.reset_now()

    def reset_now(self) -> None:
        """Close every stripe at once (no end records), from synchronous code."""
        self.closed = True
        for lane in self.stripes:
            lane.reset_now()
