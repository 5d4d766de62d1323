"""The caller's side of data lanes (``LaneCaller``, a part of ``lane.DataLanes``): opening a
lane for a bulk call within a wait fitted to the path, parking peers whose lanes failed, and
how long an opened lane is reused. See ``lane.py`` for the protocol."""

from __future__ import annotations

import logging
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import trio

from swarmtrain.p2p.errors import ResourceLimitError
from swarmtrain.p2p.lane_books import (
    HANDSHAKE_TIMEOUT,
    LANE_VERSION,
    MAX_LANE_IDLE_TIMEOUT,
    RETRY_AFTER,
    RETRY_BUSY,
    TICKET_METHOD,
    first_lane_wait,
    lane_reuse_time,
    retry_delay,
    wait_after_ticket,
)
from swarmtrain.p2p.lane_connections import (
    CONNECT_TIMEOUT,
    LaneSocketOptions,
    congestion_of,
    dial,
    dial_stripe,
    show_ticket,
    stripe_timeout,
    stripes_to_dial,
)
from swarmtrain.p2p.lane_stream import LaneStream
from swarmtrain.p2p.lane_stripes import StripedLane
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME, SERVER_STREAM_IDLE_TIMEOUT
from swarmtrain.p2p.stripe_core import MAX_STRIPES, stripes_for_path
from swarmtrain.p2p.tcp_info import tcp_rtt
from swarmtrain.proto import p2p_pb2

logger = logging.getLogger("swarmtrain.p2p.lane")  # one logger for all of a host's lanes

#: a call waits this long for a new lane before it goes over libp2p (a first lane to a peer:
#: more on a long path, ``lane_books.first_lane_wait``)
OPEN_WAIT = 0.5
#: a call to a peer whose last lane opened waits this long for a new one (ticket, dial and
#: handshakes on a long lossy path) before it goes over libp2p
KNOWN_PEER_WAIT = 6.0
MAX_PEERS_REMEMBERED = 4096


class LaneCaller(LaneSocketOptions):
    """The caller's methods of ``DataLanes`` (its state is set up there)."""

    _p2p: Any
    stripes: int
    stripe_min_rtt: float
    idle_timeout: float
    _failed_until: dict[object, float]
    _failures: dict[object, int]
    _lanes_worked: OrderedDict[object, None]
    _opening: set[object]
    _idle_granted: dict[object, float]
    lanes_opened: int
    striped_lanes_opened: int
    fallbacks: int

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
                count = stripes_to_dial(
                    granted, self.long_path_congestion, ticket.long_path_congestion or None
                )
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
