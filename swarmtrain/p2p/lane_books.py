"""The books a data lane's callee and caller keep (sans-IO): tickets, open lanes (per peer
and in all), connections that have not shown a ticket yet, how long a caller parks a peer
whose lane failed, waits for a lane and reuses it; and the protocol's names and numbers both
sides share. How lanes use them is ``lane.py``'s job."""

from __future__ import annotations

import math
import os
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from swarmtrain.p2p.errors import ResourceLimitError
from swarmtrain.p2p.lane_records import KEY_SIZE, TICKET_ID_SIZE
from swarmtrain.p2p.limits import ResourceLimits

TICKET_METHOD = "swarmtrain::Lane.ticket"
LANE_VERSION = 1
HANDSHAKE_TIMEOUT = 5.0
TICKET_TTL = 10.0
MAX_OUTSTANDING_TICKETS = 1024
MAX_PENDING_HANDSHAKES = 64  # connections that have not shown a valid ticket yet
RETRY_FIRST = 10.0  # after a first failed lane; doubles per failure in a row
RETRY_AFTER = 300.0
RETRY_BUSY = 10.0  # after a callee refused a lane because its lanes are all taken
#: how long a lane waits for its caller's next call (both sides' default; the callee grants
#: the smaller of the two in the ticket). Rounds on long lossy paths come minutes apart; an
#: idle lane costs one file descriptor, counted in ``LaneBook``, which takes idle lanes for
#: newcomers when full; a few minutes stays well under the idle time NATs keep TCP flows
LANE_IDLE_TIMEOUT = 240.0
#: the longest idle timeout a caller takes from a ticket (and its bulk pool keeps a lane)
MAX_LANE_IDLE_TIMEOUT = 600.0


@dataclass
class _Ticket:
    peer_id: object
    caller_key: bytes
    callee_key: bytes
    expires_at: float
    stripes: int = 1  # connections the ticket admits (a striped lane: stripe_core)
    # how long its lane waits for a call (None: the caller is older than idle timeouts in
    # tickets: the server's stream idle timeout, and no NOT_SERVED on eviction)
    idle_timeout: float | None = None
    count: int | None = None  # stripes the caller said it uses (set by the first one)
    redeemed: set[int] = field(default_factory=set)  # stripe indices that connected

    @property
    def open_slots(self) -> int:
        """Connections the ticket still admits."""
        return (self.stripes if self.count is None else self.count) - len(self.redeemed)


class TicketBook:
    """Outstanding tickets (sans-IO): issued per peer, expire after ``ttl``; each admits
    ``stripes`` connections (one per stripe index, each once; a plain lane's ticket one).

    A peer holds at most ``per_peer`` tickets (a new one drops its oldest); when the whole
    book is full, a new ticket drops the oldest of the peer holding the most, so one peer (or a
    few) filling the book never keeps another peer from getting a ticket."""

    def __init__(
        self,
        ttl: float = TICKET_TTL,
        capacity: int = MAX_OUTSTANDING_TICKETS,
        per_peer: int = ResourceLimits.max_tickets_per_peer,
    ):
        self.ttl, self.capacity, self.per_peer = ttl, capacity, per_peer
        self._tickets: dict[bytes, _Ticket] = {}  # in the order issued
        self._per_peer: Counter[Hashable] = Counter()
        self._slots: Counter[Hashable] = Counter()  # connections the peer's tickets admit
        self.dropped = 0

    def _drop_oldest_of(self, peer_id) -> None:
        for ticket_id, ticket in self._tickets.items():
            if ticket.peer_id == peer_id:
                self._remove(ticket_id)
                self.dropped += 1
                return

    def _remove(self, ticket_id: bytes) -> _Ticket | None:
        ticket = self._tickets.pop(ticket_id, None)
        if ticket is not None:
            for counter, count in ((self._per_peer, 1), (self._slots, ticket.open_slots)):
                counter[ticket.peer_id] -= count
                if counter[ticket.peer_id] <= 0:
                    del counter[ticket.peer_id]
        return ticket

    def issue(
        self, peer_id, now: float, stripes: int = 1, idle_timeout: float | None = None
    ) -> tuple[bytes, _Ticket]:
        if stripes < 1:
            raise ValueError("a ticket admits at least one connection")
        for ticket_id in [k for k, t in self._tickets.items() if t.expires_at <= now]:
            self._remove(ticket_id)
        if self._per_peer[peer_id] >= self.per_peer:
            self._drop_oldest_of(peer_id)
        elif len(self._tickets) >= self.capacity:
            self._drop_oldest_of(self._per_peer.most_common(1)[0][0])
        ticket_id = os.urandom(TICKET_ID_SIZE)
        ticket = _Ticket(
            peer_id,
            os.urandom(KEY_SIZE),
            os.urandom(KEY_SIZE),
            now + self.ttl,
            stripes,
            idle_timeout,
        )
        self._tickets[ticket_id] = ticket
        self._per_peer[peer_id] += 1
        self._slots[peer_id] += stripes
        return ticket_id, ticket

    def lookup(self, ticket_id: bytes, now: float) -> _Ticket | None:
        """The live ticket ``ticket_id`` (changes nothing): the callee reads a striped
        ticket's stripe index and count after its id."""
        ticket = self._tickets.get(bytes(ticket_id))
        return ticket if ticket is not None and ticket.expires_at > now else None

    def redeem(
        self, ticket_id: bytes, now: float, stripe: int = 0, count: int = 1
    ) -> _Ticket | None:
        """The ticket, for a connection that shows it as stripe ``stripe`` of ``count``; None
        if it is unknown, expired, used up, or the stripe is not one it admits (an index it
        saw, past ``count``, a count other than the first connection's or above its own).
        A ticket leaves the book once ``count`` stripes connected."""
        ticket_id = bytes(ticket_id)
        ticket = self._tickets.get(ticket_id)
        if ticket is None:
            return None
        if ticket.expires_at <= now:
            self._remove(ticket_id)
            return None
        fixed = ticket.count if ticket.count is not None else count
        if (
            not 1 <= count <= ticket.stripes
            or count != fixed
            or not 0 <= stripe < count
            or stripe in ticket.redeemed
        ):
            return None
        self._slots[ticket.peer_id] -= ticket.open_slots
        ticket.count = count
        ticket.redeemed.add(stripe)
        self._slots[ticket.peer_id] += ticket.open_slots
        if ticket.open_slots <= 0:
            self._remove(ticket_id)
        return ticket

    def cancel(self, ticket_id: bytes) -> None:
        """Drop ``ticket_id`` (a striped lane that failed to form)."""
        self._remove(bytes(ticket_id))

    def outstanding(self, peer_id) -> int:
        """Connections ``peer_id``'s tickets still admit (expired ones included until the
        next issue): what its lane count is checked with."""
        return self._slots.get(peer_id, 0)

    def __len__(self) -> int:
        return len(self._tickets)


@dataclass(slots=True)
class _OpenLane:
    peer_id: Hashable
    idle_since: float | None  # None: serving a call
    reuse_window: float  # its caller reuses it while idle for less than this


class LaneBook:
    """A callee's open lanes (sans-IO): at most ``per_peer`` of one peer, ``total`` in all.

    Each lane is busy (serving a call) or idle since some time. When all ``total`` are open, a
    new lane takes the place of a *stale* idle lane, one idle for at least ``stale_after``
    seconds (a caller between the calls of one round has no lane idle that long): first one
    past its own reuse window (its caller will not send on it again), else the one idle the
    longest (the least likely to carry a call soon), of the peer holding the most lanes on a
    tie. A caller that reused a taken lane meanwhile learns that nothing of its call was read
    (``RPCErrorCode.NOT_SERVED``) and sends it again. With no stale lane the new one is
    refused (``ResourceLimitError``; its caller goes over libp2p). So one peer, or many
    identities, holding every lane idle cannot keep others off lanes for long, and lanes that
    are in use are never cut."""

    def __init__(self, total: int, per_peer: int, stale_after: float):
        self.total, self.per_peer, self.stale_after = total, per_peer, stale_after
        self._lanes: dict[object, _OpenLane] = {}
        self._per_peer: Counter[Hashable] = Counter()
        self.refused = 0
        self.evicted = 0

    def check(self, peer_id, now: float, tickets: int = 0) -> None:
        """Raise ``ResourceLimitError`` if a new lane of ``peer_id`` (which also holds
        ``tickets`` unredeemed tickets) would be refused now; changes nothing else."""
        held = self._per_peer.get(peer_id, 0) + tickets
        if held >= self.per_peer:
            self.refused += 1
            raise ResourceLimitError(
                f"too many data lanes from one peer ({held} open or ticketed, limit "
                f"{self.per_peer})"
            )
        if len(self._lanes) >= self.total and self._stale_lane(now) is None:
            self.refused += 1
            raise ResourceLimitError(
                f"the callee's data lanes are all in use ({len(self._lanes)} of "
                f"{self.total} in all, none idle for {self.stale_after:g} s)"
            )

    def room(self, peer_id, now: float, tickets: int = 0) -> int:
        """How many new lanes of ``peer_id`` (which holds ``tickets`` unredeemed ticket
        slots) would be admitted now: what a striped lane's ticket may grant."""
        per_peer = self.per_peer - self._per_peer.get(peer_id, 0) - tickets
        stale = sum(1 for lane in self._lanes.values() if self._is_stale(lane, now))
        return max(0, min(per_peer, self.total - len(self._lanes) + stale))

    def stripes_to_grant(self, peer_id, wanted: int, now: float, tickets: int = 0) -> int:
        """How many connections a striped lane of ``peer_id`` gets when it asks for
        ``wanted``: within the ``room`` there is, and at most half the per-peer cap, so one
        lane never takes a peer's whole share (a second call to us, e.g. the other half of a
        round, would have to go over libp2p). At least one: a plain lane."""
        return max(1, min(wanted, self.room(peer_id, now, tickets), self.per_peer // 2))

    def admit(self, token, peer_id, now: float, reuse_window: float = math.inf) -> list:
        """Count a new lane ``token`` of ``peer_id`` (idle until its first call), whose
        caller reuses it while idle for less than ``reuse_window`` seconds, or raise
        ``ResourceLimitError``. Returns the tokens of lanes to close to make room."""
        self.check(peer_id, now)
        evict = []
        if len(self._lanes) >= self.total:
            stale = self._stale_lane(now)
            assert stale is not None  # check() made sure
            self.done(stale)
            self.evicted += 1
            evict.append(stale)
        self._lanes[token] = _OpenLane(peer_id, now, reuse_window)
        self._per_peer[peer_id] += 1
        return evict

    def busy(self, token) -> None:
        """The lane ``token`` serves a call (it cannot be taken)."""
        lane = self._lanes.get(token)
        if lane is not None:
            lane.idle_since = None

    def idle(self, token, now: float) -> None:
        """The lane ``token`` waits for its next call since ``now``."""
        lane = self._lanes.get(token)
        if lane is not None:
            lane.idle_since = now

    def done(self, token) -> None:
        """The lane ``token`` is closed (or was taken: then this was already called)."""
        lane = self._lanes.pop(token, None)
        if lane is not None:
            self._per_peer[lane.peer_id] -= 1
            if self._per_peer[lane.peer_id] <= 0:
                del self._per_peer[lane.peer_id]

    def _is_stale(self, lane: _OpenLane, now: float) -> bool:
        return lane.idle_since is not None and now - lane.idle_since >= self.stale_after

    def _stale_lane(self, now: float):
        """The lane to take for a newcomer (None: no lane is stale): one past its reuse
        window first, then the one idle the longest, then that of the peer holding the most."""
        best = None
        best_key: tuple[bool, float, int] | None = None
        for token, lane in self._lanes.items():
            if not self._is_stale(lane, now):
                continue
            assert lane.idle_since is not None
            idle = now - lane.idle_since
            key = (idle >= lane.reuse_window, idle, self._per_peer[lane.peer_id])
            if best_key is None or key > best_key:
                best, best_key = token, key
        return best

    def count(self, peer_id) -> int:
        return self._per_peer.get(peer_id, 0)

    def __len__(self) -> int:
        return len(self._lanes)


class PendingHandshakes:
    """Lane connections that have not shown a ticket yet (sans-IO): at most ``per_ip`` from
    one source IP and ``total`` in all. ``admit`` returns the tokens to close for a new one
    (the oldest of its IP, else the oldest of all), so newcomers always get their turn."""

    def __init__(self, total: int = MAX_PENDING_HANDSHAKES, per_ip: int = 8):
        self.total, self.per_ip = total, per_ip
        self._pending: OrderedDict[object, str] = OrderedDict()  # token -> source IP
        self._per_ip: Counter[str] = Counter()
        self.evicted = 0

    def admit(self, token, ip: str) -> list:
        evict = []
        if self._per_ip[ip] >= self.per_ip:
            evict.append(next(t for t, source in self._pending.items() if source == ip))
        elif len(self._pending) >= self.total:
            evict.append(next(iter(self._pending)))
        for old in evict:
            self.done(old)
        self.evicted += len(evict)
        self._pending[token] = ip
        self._per_ip[ip] += 1
        return evict

    def done(self, token) -> None:
        ip = self._pending.pop(token, None)
        if ip is not None:
            self._per_ip[ip] -= 1
            if self._per_ip[ip] <= 0:
                del self._per_ip[ip]

    def __len__(self) -> int:
        return len(self._pending)


def retry_delay(failures: int) -> float:
    """How long a caller parks a peer's lanes after ``failures`` failed lanes in a row."""
    return min(RETRY_AFTER, RETRY_FIRST * 2.0 ** min(failures - 1, 32))


def wait_after_ticket(ticket_seconds: float, limit: float) -> float:
    """How much longer a bulk call waits for a new lane once its ticket came back after
    ``ticket_seconds`` (about one round trip): the dial and the handshakes take three or
    four more, and on a long path a lost SYN adds a second (its first retransmission), so
    the first call there does not go over libp2p; at most ``limit``."""
    return min(limit, 6.0 * ticket_seconds + min(1.0, 20.0 * ticket_seconds))


#: what a caller's reuse time of a lane stays below the callee's idle timeout by (besides
#: two round trips): the callee's timer starts before the caller's and the next call's first
#: bytes take a one-way delay to arrive
LANE_REUSE_MARGIN = 2.0
#: seconds of reuse time a lane earns per second it took to open (a callee that does not say
#: how long it keeps idle lanes)
LANE_REUSE_PER_OPEN_SECOND = 10.0


def lane_reuse_window(idle_timeout: float) -> float:
    """How long a caller reuses an idle lane the callee keeps for ``idle_timeout`` seconds,
    at most (besides two round trips): what the callee's ``LaneBook`` counts as still in use."""
    return max(0.0, idle_timeout - LANE_REUSE_MARGIN)


def lane_reuse_time(
    open_seconds: float,
    rtt: float,
    base: float,
    callee_idle: float,
    granted_idle: float | None = None,
) -> float:
    """How long a caller may reuse an idle lane that took ``open_seconds`` to open (ticket,
    dials, handshakes) on a path of ``rtt`` seconds.

    A callee that said how long it keeps this lane idle (``granted_idle``, the ticket's
    ``idle_timeout``): up to ``LANE_REUSE_MARGIN + 2 rtt`` before that, so a lane outlives the
    gaps between slow rounds. An older callee keeps idle streams for ``callee_idle``: then
    ``base`` (what callers reuse any stream for) plus ``LANE_REUSE_PER_OPEN_SECOND`` per
    second of opening, never closer than ``LANE_REUSE_MARGIN + 2 rtt`` to ``callee_idle``,
    and never below ``base``."""
    if granted_idle is not None:
        return max(0.0, lane_reuse_window(granted_idle) - 2.0 * max(0.0, rtt))
    wanted = base + LANE_REUSE_PER_OPEN_SECOND * max(0.0, open_seconds)
    limit = callee_idle - LANE_REUSE_MARGIN - 2.0 * max(0.0, rtt)
    return max(base, min(wanted, limit))


def first_lane_wait(path_rtt: float | None, open_wait: float, limit: float) -> float:
    """How long a bulk call to a peer no lane has opened to yet waits for one before it goes
    over libp2p, on a path whose libp2p connection has a kernel RTT of ``path_rtt`` seconds
    (None: unknown): ``open_wait`` plus the ticket's round trips (stream, request, answer: about
    four) and, on a long path, room for one retransmission, which a lossy path often needs; the
    ticket's arrival extends it (``wait_after_ticket``). At most ``limit``."""
    if path_rtt is None or path_rtt <= 0:
        return open_wait
    return min(limit, open_wait + 4.0 * path_rtt + min(1.0, 20.0 * path_rtt))
