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

A ticket is single-use and expires after ``TICKET_TTL``. Only ``bulk=True`` calls use lanes,
and every failure to get one (no direct connection, relayed peers, callees behind NAT or in
client mode, a firewall, an old peer without the ticket method) falls back to the libp2p
stream. A peer whose lane failed is not tried again for a while: ``RETRY_FIRST`` seconds
after a first failure, doubling up to ``RETRY_AFTER`` while they go on (a success forgets
them); a callee that offers no lanes is asked again after ``RETRY_AFTER``.

Limits (``ResourceLimits``): a peer holds at most ``max_lanes_per_peer`` lanes and tickets
at once (more: the ticket call fails with ``ResourceLimitError`` and its bulk calls use
libp2p) and ``max_tickets_per_peer`` unredeemed tickets (its oldest is dropped); the book
of all tickets drops from the peer holding the most when full, so nobody's flood of
tickets stops others from getting one. The host holds at most ``max_lanes_total`` lanes (one
file descriptor each; at most half the soft ``ulimit -n``): when all are open, a new lane
takes the place of a stale idle one (``lane_books.LaneBook``: idle longer than callers reuse
streams, the oldest of the peer holding the most lanes), else it is refused and its caller
goes over libp2p, asking again after ``RETRY_BUSY``. Connections that have not shown a
ticket are capped per source IP and in all (the oldest is closed for a new one), and closed
after ``HANDSHAKE_TIMEOUT``, so silent sockets cannot keep an honest caller out.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import trio

from swarmtrain.p2p.errors import AddressInUseError, LaneError, LaneResetError, ResourceLimitError
from swarmtrain.p2p.lane_books import (
    MAX_PENDING_HANDSHAKES,
    RETRY_AFTER,
    RETRY_BUSY,
    LaneBook,
    PendingHandshakes,
    TicketBook,
    retry_delay,
)
from swarmtrain.p2p.lane_records import TICKET_ID_SIZE, RecordOpener, RecordSealer
from swarmtrain.p2p.lane_stream import LaneStream
from swarmtrain.p2p.limits import ResourceLimits, fd_soft_limit, lanes_within_fd_limit
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME
from swarmtrain.proto import p2p_pb2

logger = logging.getLogger(__name__)

TICKET_METHOD = "swarmtrain::Lane.ticket"
LANE_VERSION = 1
HANDSHAKE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
OPEN_WAIT = 0.5  # a call waits this long for a new lane before it goes over libp2p
# an idle lane may be taken for a newcomer once no caller would reuse it (plus latency)
STALE_LANE_AFTER = CALLER_STREAM_REUSE_TIME + 1.0


class DataLanes:
    """Both ends of the lanes of one ``P2P`` host: the listener + ticket handler (unless the
    host is in client mode) and ``open(peer_id)`` for callers."""

    def __init__(
        self, p2p, listen_host: str | None, port: int = 0, limits: ResourceLimits | None = None
    ):
        limits = limits if limits is not None else ResourceLimits()
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
        self._opening: set[object] = set()
        self.pending_handshakes = PendingHandshakes(
            MAX_PENDING_HANDSHAKES, limits.max_pending_handshakes_per_ip
        )
        self.lanes_opened = 0
        self.lanes_accepted = 0
        self.fallbacks = 0

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
        self.open_lanes.check(peer, now, tickets=self.tickets.outstanding(peer))
        ticket_id, ticket = self.tickets.issue(peer, now)
        return p2p_pb2.LaneTicket(
            version=LANE_VERSION,
            ticket_id=ticket_id,
            caller_key=ticket.caller_key,
            callee_key=ticket.callee_key,
            port=self.port,
            expires_in=self.tickets.ttl,
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
        try:
            ticket = None
            try:
                with handshake:
                    ticket_id = await _receive_ticket_id(sock)
                    ticket = self.tickets.redeem(ticket_id, trio.current_time())
            finally:
                self.pending_handshakes.done(handshake)
            if ticket is None:
                return
            try:
                taken = book.admit(token, ticket.peer_id, trio.current_time())
            except ResourceLimitError as e:
                logger.debug("refusing a lane of %s: %s", ticket.peer_id, e)
                return
            for stale in taken:
                stale.cancel()  # its task closes it; the book already let it go

            def on_call(busy: bool) -> None:
                if busy:
                    book.busy(token)
                else:
                    book.idle(token, trio.current_time())

            with token:
                lane = LaneStream(
                    raw, sock, RecordSealer(ticket.callee_key), RecordOpener(ticket.caller_key)
                )
                with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:
                    await lane.send_accept()
                if scope.cancelled_caught:
                    return
                self.lanes_accepted += 1
                await self._p2p._serve_lane(lane, ticket.peer_id, on_call)
        except (OSError, LaneError) as e:
            logger.debug("lane connection failed: %r", e)
        finally:
            book.done(token)
            if lane is not None:
                await lane.reset()
            else:
                sock.close()

    # ---------------------------------------------------------------- caller side

    async def open(
        self,
        peer_id,
        remote_ip: str | None,
        nursery: trio.Nursery,
        on_late_lane: Callable[[Any, LaneStream], None],  # (peer_id, lane)
        wait: float | None = None,
    ) -> LaneStream | None:
        """A lane to ``peer_id`` at ``remote_ip`` if one opens within ``wait`` seconds
        (default ``OPEN_WAIT``), else None (the caller goes over libp2p). An attempt still
        running after ``wait`` goes on in ``nursery`` and hands its lane to ``on_late_lane``
        (e.g. the idle pool), so a slow path or a firewall that drops packets never stalls a
        call for ``CONNECT_TIMEOUT``."""
        now = trio.current_time()
        if remote_ip is None or self._failed_until.get(peer_id, 0.0) > now:
            return None
        if peer_id in self._opening:
            return None  # an attempt is under way: this call goes over libp2p
        self._opening.add(peer_id)
        handover: list[LaneStream | None] = []
        settled = trio.Event()
        waiting = True

        async def attempt() -> None:
            try:
                lane = await self._open_or_remember(peer_id, remote_ip)
            finally:
                self._opening.discard(peer_id)
            if lane is not None and not waiting:
                on_late_lane(peer_id, lane)
            else:
                handover.append(lane)
            settled.set()

        nursery.start_soon(attempt)
        returning = False
        try:
            with trio.move_on_after(OPEN_WAIT if wait is None else wait):
                await settled.wait()
            returning = True
        finally:
            waiting = False
            late = handover[0] if handover else None
            if not returning and late is not None:
                handover.pop()
                on_late_lane(peer_id, late)  # we were cancelled: keep it for later
        return handover[0] if handover else None

    async def _open_or_remember(self, peer_id, remote_ip: str) -> LaneStream | None:
        offered = True
        busy = False
        try:
            lane = await self._open(peer_id, remote_ip)
            offered = lane is not None
        except ResourceLimitError as e:  # the callee is up, its lanes are taken: ask again soon
            logger.debug("no data lane to %s (%s): %s", peer_id, remote_ip, e)
            lane, busy = None, True
        except Exception as e:  # any failure: fall back, remember for a while
            logger.debug("no data lane to %s (%s): %r", peer_id, remote_ip, e)
            lane = None
        if lane is None:
            self.fallbacks += 1
            if busy:
                wait = RETRY_BUSY
            else:
                failures = self._failures.get(peer_id, 0) + 1
                self._failures[peer_id] = failures
                wait = RETRY_AFTER if not offered else retry_delay(failures)
            self._failed_until[peer_id] = trio.current_time() + wait
            return None
        self._failures.pop(peer_id, None)
        self._failed_until.pop(peer_id, None)
        self.lanes_opened += 1
        return lane

    async def _open(self, peer_id, remote_ip: str) -> LaneStream | None:
        ticket = await self._p2p.call_protobuf_handler(
            peer_id,
            TICKET_METHOD,
            p2p_pb2.LaneTicketRequest(version=LANE_VERSION),
            p2p_pb2.LaneTicket,
            timeout=HANDSHAKE_TIMEOUT,
        )
        if not ticket.ticket_id or ticket.version != LANE_VERSION:
            return None
        family = socket.AF_INET6 if ":" in remote_ip else socket.AF_INET
        raw = socket.socket(family, socket.SOCK_STREAM)
        raw.setblocking(False)
        sock = trio.socket.from_stdlib_socket(raw)
        lane = None
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await sock.connect((remote_ip, ticket.port))
                lane = LaneStream(
                    raw,
                    sock,
                    RecordSealer(bytes(ticket.caller_key)),
                    RecordOpener(bytes(ticket.callee_key)),
                )
                await lane._send_all(bytes(ticket.ticket_id))
                await lane.receive_accept()
            return lane
        except BaseException:
            if lane is not None:
                await lane.reset()
            else:
                sock.close()
            raise


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


async def _receive_ticket_id(sock) -> bytes:
    data = b""
    while len(data) < TICKET_ID_SIZE:
        chunk = await sock.recv(TICKET_ID_SIZE - len(data))
        if not chunk:
            raise LaneResetError("the lane closed during the handshake")
        data += chunk
    return data
