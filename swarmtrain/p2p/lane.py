"""Direct data lanes: bulk RPCs over a plain TCP connection, encrypted, beside libp2p.

py-libp2p's Noise + yamux path costs Python work per 64 KiB (see benchmarks/RESULTS.md), which
caps a stream at ~10-20% of raw TCP. A lane moves one RPC stream's bytes over its own TCP
connection in 1 MiB AES-256-GCM records (``lane_records``) instead:

1. the caller asks the callee for a ticket over their libp2p connection (Noise authenticates
   both peers and encrypts the ticket: a random id and one fresh key per direction);
2. it dials ``port`` on the IP its direct libp2p connection to the callee comes from and sends
   the ticket id; the callee answers with an encrypted "ok" record, which proves it holds the
   keys, and then serves RPC calls on the lane exactly as on a libp2p stream, attributed to
   the peer the ticket was issued to.

On a long path (the first connection's kernel RTT >= ``stripe_min_rtt``) a lane spreads
over several connections of one ticket (``stripe_core``, ``lane_stripes.StripedLane``): the
caller asks for ``stripes``, the callee grants what its lane limits leave, and each
connection shows the ticket id with its stripe index and count.

A ticket is single-use (one connection per granted stripe) and expires after ``TICKET_TTL``.
Only ``bulk=True`` calls use lanes, and every failure to get one (no direct connection,
relayed peers, callees behind NAT or in client mode, a firewall, an old peer without the
ticket method) falls back to the libp2p stream. A peer whose lane failed is not tried again
for a while: ``RETRY_FIRST`` seconds after a first failure, doubling up to ``RETRY_AFTER``
while they go on (a success forgets them); a callee that offers no lanes is asked again
after ``RETRY_AFTER``.

Limits (``ResourceLimits``): a peer holds at most ``max_lanes_per_peer`` lanes and tickets
at once (more: the ticket call fails with ``ResourceLimitError`` and its bulk calls use
libp2p) and ``max_tickets_per_peer`` unredeemed tickets (its oldest is dropped); the book
of all tickets drops from the peer holding the most when full, so nobody's flood of
tickets stops others from getting one. The host holds at most ``max_lanes_total`` lanes (one
file descriptor each; at most half the soft ``ulimit -n``): when all are open, a new lane
takes the place of a stale idle one (``lane_books.LaneBook``: idle longer than the gaps in a
round, past its caller's reuse window first, else idle the longest; a caller that reused it
meanwhile is told nothing was served, ``NOT_SERVED``, and sends the call again), else it is
refused and its caller goes over libp2p, asking again after ``RETRY_BUSY``. Idle lanes wait
for their caller's next call for minutes (``LANE_IDLE_TIMEOUT``, granted in the ticket; older
peers: a libp2p stream's 30 s), so a lane outlives the gaps between slow rounds. Connections
that have not shown a ticket are capped per source IP and in all (the oldest is closed for a
new one), and closed after ``HANDSHAKE_TIMEOUT``, so silent sockets cannot keep an honest
caller out.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import trio

from swarmtrain.p2p.errors import (
    AddressInUseError,
    LaneError,
    LaneResetError,
    ResourceLimitError,
    RPCError,
)
from swarmtrain.p2p.lane_books import (
    LANE_IDLE_TIMEOUT,
    MAX_LANE_IDLE_TIMEOUT,
    MAX_PENDING_HANDSHAKES,
    RETRY_AFTER,
    RETRY_BUSY,
    LaneBook,
    PendingHandshakes,
    TicketBook,
    first_lane_wait,
    lane_reuse_time,
    lane_reuse_window,
    retry_delay,
    wait_after_ticket,
)
from swarmtrain.p2p.lane_connections import (
    AUTO_CONGESTION,
    CONNECT_TIMEOUT,
    StripeGroup,
    StripeToken,
    congestion_for_path,
    congestion_of,
    dial,
    dial_stripe,
    set_congestion,
    show_ticket,
    stripe_timeout,
)
from swarmtrain.p2p.lane_records import TICKET_ID_SIZE, RecordOpener, RecordSealer
from swarmtrain.p2p.lane_stream import LaneStream
from swarmtrain.p2p.lane_stripes import StripedLane
from swarmtrain.p2p.limits import ResourceLimits, fd_soft_limit, lanes_within_fd_limit
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME, SERVER_STREAM_IDLE_TIMEOUT
from swarmtrain.p2p.rpc_stream import RPCStream
from swarmtrain.p2p.stripe_core import MAX_STRIPES, stripes_for_path
from swarmtrain.p2p.tcp_info import tcp_rtt
from swarmtrain.proto import p2p_pb2

logger = logging.getLogger(__name__)

TICKET_METHOD = "swarmtrain::Lane.ticket"
LANE_VERSION = 1
HANDSHAKE_TIMEOUT = 5.0
#: a call waits this long for a new lane before it goes over libp2p (a first lane to a peer:
#: more on a long path, ``lane_books.first_lane_wait``)
OPEN_WAIT = 0.5
#: a call to a peer whose last lane opened waits this long for a new one (ticket, dial and
#: handshakes on a long lossy path) before it goes over libp2p
KNOWN_PEER_WAIT = 6.0
MAX_PEERS_REMEMBERED = 4096
#: the most connections per lane on a long path (P2PConfig.lane_stripes; how many: chosen per
#: path, ``stripe_core.stripes_for_path``); half the default ``max_lanes_per_peer``, so a peer
#: may hold two striped lanes to a callee at once
DEFAULT_STRIPES = 8
DEFAULT_STRIPE_MIN_RTT = 0.01  # s: stripe when the lane's TCP RTT is at least this
# on a full host, an idle lane may be taken for a newcomer once it sat idle this long (longer
# than the gaps between the calls of one round); its caller may still reuse it: a call sent
# on it meanwhile gets NOT_SERVED and goes again over another stream (``LaneBook``)
STALE_LANE_AFTER = CALLER_STREAM_REUSE_TIME + 1.0


class DataLanes:
    """Both ends of the lanes of one ``P2P`` host: the listener + ticket handler (unless the
    host is in client mode) and ``open(peer_id)`` for callers."""

    def __init__(
        self,
        p2p,
        listen_host: str | None,
        port: int = 0,
        limits: ResourceLimits | None = None,
        stripes: int = DEFAULT_STRIPES,
        stripe_min_rtt: float = DEFAULT_STRIPE_MIN_RTT,
        congestion: str | None = AUTO_CONGESTION,
        idle_timeout: float = LANE_IDLE_TIMEOUT,
    ):
        """``stripes``: the most connections one of our lanes spreads over (1: plain
        lanes), used when the first connection's TCP RTT is at least ``stripe_min_rtt``
        seconds; the callee may grant fewer (``stripe_core``). ``congestion``: the TCP
        congestion control of our lane sockets, the ones we dial and the ones we accept
        (None: the system's default; ``"auto"``: ``LONG_PATH_CONGESTION`` on a long path, RTT
        >= ``stripe_min_rtt``; where the kernel refuses it, logged once). ``idle_timeout``: how
        long a lane waits for its caller's next call, at most (each side's: the callee grants
        the smaller of both in the ticket; an older peer's lanes keep the server's stream idle
        timeout, 30 s)."""
        if not 1 <= stripes <= MAX_STRIPES:
            raise ValueError(f"lane stripes must be in 1..{MAX_STRIPES}, got {stripes}")
        limits = limits if limits is not None else ResourceLimits()
        self.stripes, self.stripe_min_rtt = stripes, stripe_min_rtt
        self.congestion = congestion
        self.idle_timeout = idle_timeout
        self._congestion_refused = False
        self._p2p = p2p
        self._listen_host = listen_host
        self._port = port
        self._listener: trio.socket.SocketType | None = None
        self.tickets = TicketBook(per_peer=limits.max_tickets_per_peer)
        total = lanes_within_fd_limit(limits.max_lanes_total, fd_soft_limit())
        if total < limits.max_lanes_total:
            logger.info(
                "data lanes capped at %d (half the soft limit on open files, ulimit -n; "
                "max_lanes_total=%d)",
                total,
                limits.max_lanes_total,
            )
        self.open_lanes = LaneBook(total, limits.max_lanes_per_peer, STALE_LANE_AFTER)
        self._failed_until: dict[object, float] = {}
        self._failures: dict[object, int] = {}  # failed lanes in a row, per peer
        # peers whose last lane attempt worked (most recent last): a call to them waits
        # for a new lane rather than go over libp2p, which on a long lossy path is far slower
        self._lanes_worked: OrderedDict[object, None] = OrderedDict()
        self._opening: set[object] = set()
        # the idle timeout the callee granted in its last ticket to each peer (popped by
        # _open_or_remember; absent: an older callee)
        self._idle_granted: dict[object, float] = {}
        self.pending_handshakes = PendingHandshakes(
            MAX_PENDING_HANDSHAKES, limits.max_pending_handshakes_per_ip
        )
        self._forming: dict[bytes, StripeGroup] = {}  # striped lanes waiting for stripes
        self.lanes_opened = 0
        self.lanes_accepted = 0
        self.striped_lanes_opened = 0
        self.striped_lanes_accepted = 0
        self.fallbacks = 0

    def _prepare_socket(self, raw: socket.socket) -> None:
        """Socket options of a lane socket (before it connects, or once accepted)."""
        if self.congestion in (None, AUTO_CONGESTION) or self._congestion_refused:
            return
        error = set_congestion(raw, self.congestion)
        if error is not None:
            self._congestion_refused = True  # once: the next sockets keep the default
            logger.warning(
                "lane congestion control %r refused (%s): lanes keep the system's default",
                self.congestion,
                error,
            )

    def _fit_to_path(self, raw: socket.socket, rtt: float | None) -> None:
        """Under ``lane_congestion="auto"``, a connected lane socket on a long path (``rtt`` >=
        ``stripe_min_rtt``) gets ``LONG_PATH_CONGESTION``; where the kernel refuses, that is
        logged once and lanes keep the system's default."""
        name = congestion_for_path(self.congestion, rtt, self.stripe_min_rtt)
        if name is None or self._congestion_refused:
            return
        error = set_congestion(raw, name)
        if error is not None:
            self._congestion_refused = True
            logger.info(
                "lanes on long paths would use %s congestion control, which random loss and "
                "idle gaps do not slow; the kernel refused it (%s), so they keep the system's "
                "default. To allow it: modprobe tcp_bbr and add %s to "
                "net.ipv4.tcp_allowed_congestion_control; lane_congestion=None silences this",
                name,
                error,
                name,
            )

    @property
    def port(self) -> int | None:
        return self._listener.getsockname()[1] if self._listener is not None else None

    async def start(self, nursery: trio.Nursery) -> None:
        """Listen (when ``listen_host`` is set) and serve tickets; runs until the nursery ends."""
        if self._listen_host is None:
            return
        family = socket.AF_INET6 if ":" in self._listen_host else socket.AF_INET
        listener = trio.socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            await listener.bind((self._listen_host, self._port))
        except OSError as e:
            listener.close()
            if e.errno == errno.EADDRINUSE:
                where = f"{self._listen_host} port {self._port} (data lanes)"
                raise AddressInUseError(where) from None
            raise
        listener.listen(128)
        self._listener = listener
        self._p2p.add_protobuf_handler(TICKET_METHOD, self._issue_ticket, p2p_pb2.LaneTicketRequest)
        nursery.start_soon(self._accept_loop, listener)

    async def _issue_ticket(self, request, context) -> p2p_pb2.LaneTicket:
        if self._listener is None or not self._p2p.lanes_offered():
            return p2p_pb2.LaneTicket(version=LANE_VERSION)
        peer = context.remote_id
        now = trio.current_time()
        held = self.tickets.outstanding(peer)
        self.open_lanes.check(peer, now, tickets=held)
        wanted = min(max(1, request.stripes), MAX_STRIPES)
        granted = max(1, min(wanted, self.open_lanes.room(peer, now, tickets=held)))
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

    # ---------------------------------------------------------------- caller side

    async def open(
        self,
        peer_id,
        remote_ip: str | None,
        nursery: trio.Nursery,
        on_late_lane: Callable[[Any, Any], None],  # (peer_id, lane)
        wait: float | None = None,
        path: tuple[float, float | None] | None = None,
    ) -> LaneStream | StripedLane | None:
        """A lane to ``peer_id`` at ``remote_ip`` if one opens within ``wait`` seconds
        (default: ``KNOWN_PEER_WAIT`` for a peer whose last lane opened, else ``OPEN_WAIT``
        plus a few of the libp2p connection's round trips, ``path``'s RTT:
        ``first_lane_wait``; once the ticket came, at least a few of its round trips more:
        ``wait_after_ticket``), else None (the caller goes over libp2p). ``path``: (RTT,
        loss) of the libp2p connection (``autonat.connection_path``), which also sets how
        many stripes we ask for (``stripe_core.stripes_for_path``). An attempt still
        running after ``wait`` goes on in ``nursery`` and hands its lane to ``on_late_lane``
        (e.g. the idle pool), so a slow path or a firewall that drops packets never stalls a
        call for ``CONNECT_TIMEOUT``."""
        now = trio.current_time()
        if remote_ip is None or self._failed_until.get(peer_id, 0.0) > now:
            return None
        if peer_id in self._opening:
            return None  # an attempt is under way: this call goes over libp2p
        self._opening.add(peer_id)
        handover: list[LaneStream | StripedLane | None] = []
        settled = trio.Event()
        waiting = True
        if wait is None:
            if peer_id in self._lanes_worked:
                wait = KNOWN_PEER_WAIT
            else:
                rtt = path[0] if path is not None else None
                wait = first_lane_wait(rtt, OPEN_WAIT, KNOWN_PEER_WAIT)
        patience = trio.CancelScope(deadline=trio.current_time() + wait)

        def on_ticket(seconds: float) -> None:
            # the callee offers a lane and the ticket's round trip says how far it is: a
            # call waits for the dial and handshake on a long path too
            if waiting:
                later = trio.current_time() + wait_after_ticket(seconds, 2 * CONNECT_TIMEOUT)
                patience.deadline = max(patience.deadline, later)

        async def attempt() -> None:
            try:
                lane = await self._open_or_remember(peer_id, remote_ip, on_ticket, path)
            finally:
                self._opening.discard(peer_id)
            if lane is not None and not waiting:
                logger.debug("lane to %s opened after its call went over libp2p", peer_id)
                on_late_lane(peer_id, lane)
            else:
                handover.append(lane)
            settled.set()

        nursery.start_soon(attempt)
        returning = False
        try:
            with patience:
                await settled.wait()
            returning = True
        finally:
            waiting = False
            late = handover[0] if handover else None
            if not returning and late is not None:
                handover.pop()
                on_late_lane(peer_id, late)  # we were cancelled: keep it for later
        return handover[0] if handover else None

    async def _open_or_remember(
        self,
        peer_id,
        remote_ip: str,
        on_ticket: Callable[[float], None] | None = None,
        path: tuple[float, float | None] | None = None,
    ) -> LaneStream | StripedLane | None:
        offered = True
        busy = False
        started = trio.current_time()
        self._idle_granted.pop(peer_id, None)
        try:
            wanted = self.stripes  # lane_stripe_min_rtt 0: every lane striped, all of them
            if self.stripe_min_rtt > 0:
                rtt, loss = path if path is not None else (None, None)
                wanted = stripes_for_path(rtt, loss, self.stripes)
            lane = await self._open(peer_id, remote_ip, on_ticket, wanted)
            offered = lane is not None
        except ResourceLimitError as e:  # the callee is up, its lanes are taken: ask again soon
            logger.debug("no data lane to %s (%s): %s", peer_id, remote_ip, e)
            lane, busy = None, True
        except Exception as e:  # any failure: fall back, remember for a while
            logger.debug("no data lane to %s (%s): %r", peer_id, remote_ip, e)
            lane = None
        if lane is None:
            self.fallbacks += 1
            self._lanes_worked.pop(peer_id, None)
            if busy:
                wait = RETRY_BUSY
            else:
                failures = self._failures.get(peer_id, 0) + 1
                self._failures[peer_id] = failures
                wait = RETRY_AFTER if not offered else retry_delay(failures)
            self._failed_until[peer_id] = trio.current_time() + wait
            return None
        opened_in = trio.current_time() - started
        first = lane.stripes[0] if isinstance(lane, StripedLane) else lane
        lane.reuse_time = lane_reuse_time(
            opened_in,
            tcp_rtt(first.raw) or 0.0,
            CALLER_STREAM_REUSE_TIME,
            SERVER_STREAM_IDLE_TIMEOUT,
            self._idle_granted.pop(peer_id, None),
        )
        self._failures.pop(peer_id, None)
        self._failed_until.pop(peer_id, None)
        self._lanes_worked[peer_id] = None
        self._lanes_worked.move_to_end(peer_id)
        while len(self._lanes_worked) > MAX_PEERS_REMEMBERED:
            self._lanes_worked.popitem(last=False)
        self.lanes_opened += 1
        if isinstance(lane, StripedLane):
            self.striped_lanes_opened += 1
        logger.debug(
            "lane to %s (%s): %d connection(s) (%s), opened in %.3f s, reused for %.1f s",
            peer_id,
            remote_ip,
            len(lane.stripes) if isinstance(lane, StripedLane) else 1,
            congestion_of(first.raw),
            opened_in,
            lane.reuse_time,
        )
        return lane

    async def _open(
        self,
        peer_id,
        remote_ip: str,
        on_ticket: Callable[[float], None] | None = None,
        stripes: int | None = None,
    ) -> LaneStream | StripedLane | None:
        """A new lane of up to ``stripes`` connections (None: ``self.stripes``)."""
        asked = trio.current_time()
        ticket = await self._p2p.call_protobuf_handler(
            peer_id,
            TICKET_METHOD,
            p2p_pb2.LaneTicketRequest(
                version=LANE_VERSION,
                stripes=stripes or self.stripes,
                idle_timeout=self.idle_timeout,
            ),
            p2p_pb2.LaneTicket,
            timeout=HANDSHAKE_TIMEOUT,
        )
        ticket_seconds = trio.current_time() - asked
        if not ticket.ticket_id or ticket.version != LANE_VERSION:
            return None
        if ticket.idle_timeout > 0:  # (NaN is not: an older callee's 30 s then)
            self._idle_granted[peer_id] = min(ticket.idle_timeout, MAX_LANE_IDLE_TIMEOUT)
        if on_ticket is not None:
            on_ticket(ticket_seconds)
        logger.debug(
            "lane ticket from %s in %.3f s: %d stripe(s)", peer_id, ticket_seconds, ticket.stripes
        )
        granted = min(max(1, ticket.stripes), MAX_STRIPES)  # an older callee: 0, one
        lanes: list[LaneStream] = []
        first = await dial(remote_ip, ticket.port, prepare=self._prepare_socket)
        try:
            count = 1
            rtt = tcp_rtt(first[0]) or ticket_seconds  # no sample: a SYN was re-sent
            self._fit_to_path(first[0], rtt)
            if granted == 1:  # the original handshake: the ticket id alone
                return await show_ticket(first, ticket, lanes)
            if rtt >= self.stripe_min_rtt:
                count = granted
            timeout = stripe_timeout(rtt)

            def prepare_stripe(raw: socket.socket) -> None:
                self._prepare_socket(raw)
                self._fit_to_path(raw, rtt)  # the first connection's RTT is the path's

            async with trio.open_nursery() as nursery:
                for stripe in range(1, count):
                    nursery.start_soon(
                        dial_stripe,
                        remote_ip,
                        ticket,
                        stripe,
                        count,
                        lanes,
                        timeout,
                        prepare_stripe,
                    )
                await show_ticket(first, ticket, lanes, 0, count, timeout)
            lanes.sort(key=lambda lane: lane.stripe)
            if count == 1:
                return lanes[0]
            return StripedLane(list(lanes))
        except BaseException:
            for lane in lanes:
                lane.reset_now()
            first[1].close()
            raise


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


def lanes_disabled_by_env() -> bool:
    """``SWARMTRAIN_DISABLE_DATA_LANES=1`` turns lanes off (benchmarks' A/B switch)."""
    return os.environ.get("SWARMTRAIN_DISABLE_DATA_LANES") == "1"


def lane_listen_host(host_maddrs: Sequence[str], client_mode: bool) -> str | None:
    """The IP lanes listen on: that of the first TCP listen address (None: no lanes)."""
    if client_mode:
        return None
    for addr in host_maddrs:
        parts = addr.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            return parts[2]
    return None


async def _receive_exactly(sock, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await sock.recv(size - len(data))
        if not chunk:
            raise LaneResetError("the lane closed during the handshake")
        data += chunk
    return data
