"""The callee's side of data lanes (``LaneCallee``, a part of ``lane.DataLanes``): issuing
tickets, accepting lane connections and serving their calls, counted in the host's
``LaneBook``; a striped lane's stripes gathered into one. See ``lane.py`` for the protocol."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import trio

from swarmtrain.p2p.errors import LaneError, LaneResetError, ResourceLimitError, RPCError
from swarmtrain.p2p.lane_books import (
    HANDSHAKE_TIMEOUT,
    LANE_VERSION,
    LaneBook,
    PendingHandshakes,
    TicketBook,
    lane_reuse_window,
)
from swarmtrain.p2p.lane_connections import LaneSocketOptions, StripeGroup, StripeToken
from swarmtrain.p2p.lane_records import TICKET_ID_SIZE, RecordOpener, RecordSealer
from swarmtrain.p2p.lane_stream import LaneStream
from swarmtrain.p2p.lane_stripes import StripedLane
from swarmtrain.p2p.rpc import SERVER_STREAM_IDLE_TIMEOUT
from swarmtrain.p2p.rpc_stream import RPCStream
from swarmtrain.p2p.stripe_core import MAX_STRIPES
from swarmtrain.p2p.tcp_info import tcp_rtt
from swarmtrain.proto import p2p_pb2

logger = logging.getLogger("swarmtrain.p2p.lane")  # one logger for all of a host's lanes


class LaneCallee(LaneSocketOptions):
    """The callee's methods of ``DataLanes`` (its state is set up there)."""

    _p2p: Any
    _listener: trio.socket.SocketType | None
    idle_timeout: float
    tickets: TicketBook
    open_lanes: LaneBook
    pending_handshakes: PendingHandshakes
    _forming: dict[bytes, StripeGroup]
    lanes_accepted: int
    striped_lanes_accepted: int

    @property
    def port(self) -> int | None:
        return self._listener.getsockname()[1] if self._listener is not None else None

    async def _issue_ticket(self, request, context) -> p2p_pb2.LaneTicket:
        if self._listener is None or not self._p2p.lanes_offered():
            return p2p_pb2.LaneTicket(version=LANE_VERSION)
        peer = context.remote_id
        now = trio.current_time()
        held = self.tickets.outstanding(peer)
        self.open_lanes.check(peer, now, tickets=held)
        wanted = min(max(1, request.stripes), MAX_STRIPES)
        granted = self.open_lanes.stripes_to_grant(peer, wanted, now, tickets=held)
        # a caller that sets idle_timeout keeps lanes idle that long and understands
        # NOT_SERVED; an older one gets the server's stream idle timeout (and a bare close)
        idle = min(request.idle_timeout, self.idle_timeout) if request.idle_timeout > 0 else None
        ticket_id, ticket = self.tickets.issue(peer, now, stripes=granted, idle_timeout=idle)
        return p2p_pb2.LaneTicket(
            version=LANE_VERSION,
            ticket_id=ticket_id,
            caller_key=ticket.caller_key,
            callee_key=ticket.callee_key,
            port=self.port,
            expires_in=self.tickets.ttl,
            stripes=granted,
            idle_timeout=idle or 0.0,
            long_path_congestion=self.long_path_congestion or "",
        )

    async def _accept_loop(self, listener) -> None:
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as e:
                        logger.debug("lane accept failed: %r", e)
                        await trio.sleep(0.1)
                        continue
                    raw = socket.socket(fileno=conn.detach())
                    raw.setblocking(False)
                    self._prepare_socket(raw)
                    try:
                        ip = raw.getpeername()[0]
                    except OSError:
                        raw.close()
                        continue
                    handshake = trio.CancelScope(deadline=trio.current_time() + HANDSHAKE_TIMEOUT)
                    for old in self.pending_handshakes.admit(handshake, ip):
                        old.cancel()  # silent sockets make room for newcomers, oldest first
                    nursery.start_soon(self._serve_connection, raw, handshake)
        finally:
            listener.close()

    async def _serve_connection(self, raw: socket.socket, handshake: trio.CancelScope) -> None:
        sock = trio.socket.from_stdlib_socket(raw)
        lane = None
        book = self.open_lanes
        token = trio.CancelScope()  # cancelled if the lane is taken for a newcomer
        handed_over = False  # a stripe handed to its striped lane's owner
        try:
            ticket = None
            try:
                with handshake:
                    ticket_id = await _receive_exactly(sock, TICKET_ID_SIZE)
                    stripe, count = 0, 1
                    found = self.tickets.lookup(ticket_id, trio.current_time())
                    if found is not None and found.stripes > 1:
                        stripe, count = await _receive_exactly(sock, 2)
                    ticket = self.tickets.redeem(ticket_id, trio.current_time(), stripe, count)
            finally:
                self.pending_handshakes.done(handshake)
            if ticket is None:
                return
            self._fit_to_path(raw, tcp_rtt(raw))
            if count > 1:
                handed_over = await self._join_stripe(raw, sock, ticket_id, ticket, stripe)
                return
            try:
                taken = book.admit(
                    token, ticket.peer_id, trio.current_time(), _reuse_window_of(ticket)
                )
            except ResourceLimitError as e:
                logger.debug("refusing a lane of %s: %s", ticket.peer_id, e)
                return
            for stale in taken:
                stale.cancel()  # its task closes it; the book already let it go

            with token:
                lane = LaneStream(
                    raw, sock, RecordSealer(ticket.callee_key), RecordOpener(ticket.caller_key)
                )
                with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:
                    await lane.send_accept()
                if scope.cancelled_caught:
                    return
                self.lanes_accepted += 1
                await self._p2p._serve_lane(
                    lane, ticket.peer_id, self._marker(token), ticket.idle_timeout
                )
            if token.cancelled_caught and ticket.idle_timeout is not None:
                await _tell_not_served(lane, [lane])  # taken for a newcomer while idle
        except (OSError, LaneError) as e:
            logger.debug("lane connection failed: %r", e)
        finally:
            if not handed_over:
                book.done(token)
                if lane is not None:
                    await lane.reset()
                else:
                    sock.close()

    def _marker(self, *tokens) -> Callable[[bool], None]:
        """``on_call(busy)`` for the server: marks the lane's tokens busy or idle."""
        book = self.open_lanes

        def on_call(busy: bool) -> None:
            for token in tokens:
                if busy:
                    book.busy(token)
                else:
                    book.idle(token, trio.current_time())

        return on_call

    async def _join_stripe(self, raw, sock, ticket_id: bytes, ticket, stripe: int) -> bool:
        """One connection of a striped lane: counted as a lane, accepted, handed to the group. The
        stripe that redeemed first owns the group: it waits for the others (``TICKET_TTL``: each
        of their dials and handshakes may take ``stripe_timeout``), serves the striped lane, and
        closes every stripe at the end. True when this connection was handed over (the group
        closes it)."""
        book = self.open_lanes
        count = ticket.count
        group = self._forming.get(ticket_id)
        owner = group is None
        if group is None:
            group = self._forming[ticket_id] = StripeGroup(count)
        token = StripeToken(group)
        lane = None
        try:
            try:
                taken = book.admit(
                    token, ticket.peer_id, trio.current_time(), _reuse_window_of(ticket)
                )
            except ResourceLimitError as e:
                logger.debug("refusing a stripe of %s: %s", ticket.peer_id, e)
                group.scope.cancel()
                return False
            for stale in taken:
                stale.cancel()
            if group.closed:
                return False  # the lane did not form in time: no accept for this one
            lane = LaneStream(
                raw,
                sock,
                RecordSealer(ticket.callee_key, stripe),
                RecordOpener(ticket.caller_key, stripe),
            )
            with trio.move_on_after(HANDSHAKE_TIMEOUT):
                await lane.send_accept()
                if group.add(stripe, lane, token):
                    lane = None  # the group holds it now
            if lane is not None:
                return False
            if not owner:
                return True
            return await self._serve_striped(ticket_id, ticket, group)
        finally:
            if lane is not None:
                book.done(token)
                await lane.reset()
            if owner:
                self._close_group(ticket_id, group)

    async def _serve_striped(self, ticket_id: bytes, ticket, group: StripeGroup) -> bool:
        striped = None
        with group.scope:
            with trio.move_on_after(self.tickets.ttl):  # its stripes' dials may be slow
                await group.complete.wait()
            if not group.complete.is_set():
                logger.debug("a striped lane of %s did not form", ticket.peer_id)
                return True
            striped = StripedLane([group.lanes[i] for i in range(group.count)])
            self.lanes_accepted += 1
            self.striped_lanes_accepted += 1
            await self._p2p._serve_lane(
                striped, ticket.peer_id, self._marker(*group.tokens), ticket.idle_timeout
            )
        if striped is not None and group.scope.cancelled_caught and ticket.idle_timeout is not None:
            await _tell_not_served(striped, striped.stripes)  # a stripe was taken while idle
        return True

    def _close_group(self, ticket_id: bytes, group: StripeGroup) -> None:
        if self._forming.get(ticket_id) is group:
            del self._forming[ticket_id]
        self.tickets.cancel(ticket_id)  # stripes still to come are refused
        group.closed = True
        for token in group.tokens:
            self.open_lanes.done(token)
        for lane in group.lanes.values():
            lane.reset_now()


def _reuse_window_of(ticket) -> float:
    """How long the caller of ``ticket``'s lane may reuse it while idle (the callee's book)."""
    idle = ticket.idle_timeout if ticket.idle_timeout is not None else SERVER_STREAM_IDLE_TIMEOUT
    return lane_reuse_window(idle)


async def _tell_not_served(lane: LaneStream | StripedLane, stripes: list[LaneStream]) -> None:
    """Tell the caller of an idle lane we close that nothing of a call it sent meanwhile was
    read (ERROR ``NOT_SERVED``: it sends the call again elsewhere), and close the lane only
    once the caller closed its side (or after ``HANDSHAKE_TIMEOUT``), so no reset drops the
    answer."""
    with trio.move_on_after(HANDSHAKE_TIMEOUT):
        try:
            await RPCStream(lane, max_message_size=0).send_error(  # (it reads nothing)
                p2p_pb2.NOT_SERVED, "LaneTaken", "the idle lane was taken for a newcomer"
            )
        except (RPCError, LaneError, OSError) as e:
            logger.debug("could not tell a lane's caller it was not served: %r", e)
        async with trio.open_nursery() as nursery:
            for stripe in stripes:
                nursery.start_soon(stripe.close_after_peer, HANDSHAKE_TIMEOUT)


async def _receive_exactly(sock, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await sock.recv(size - len(data))
        if not chunk:
            raise LaneResetError("the lane closed during the handshake")
        data += chunk
    return data
