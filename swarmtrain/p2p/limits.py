"""Resource limits of a ``P2P`` host against peers that declare much and send little.

Sans-IO: ``ResourceLimits`` holds the settings (``P2PConfig.limits``), ``ByteBudget`` counts
the bytes a host's inbound calls hold in buffers they allocated (payloads and attachments
still being received), in all and per peer, ``PeerCounter`` counts per-peer things (calls).
Lanes have a book of their own (``lane_books.LaneBook``).
Memory follows the bytes that arrived: a frame that declares N bytes allocates at most
``INITIAL_ALLOCATION`` at first and grows as its bytes come (framing.py), so a declaration
alone costs nothing; these limits bound what arrived bytes can pin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from swarmtrain.p2p.errors import ResourceLimitError

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

#: the first buffer of a payload or attachment being received; it doubles as bytes arrive
INITIAL_ALLOCATION = 64 * 1024


@dataclass(frozen=True)
class ResourceLimits:
    """Per-peer and per-host limits on what other peers can make this host hold.

    :param max_inbound_calls_per_peer: RPC streams one peer may have open to us at once
      (calls being served plus idle reused streams; py-libp2p opens at most 256 streams per
      connection, so honest callers stay below the default).
      One more is answered with ``ResourceLimitError`` at once.
    :param max_bytes_in_flight: bytes the host's inbound calls may hold in receive buffers
      (messages and attachments not yet complete), over all peers. A call whose next bytes
      would pass it fails with ``ResourceLimitError``. Must be at least ``max_message_size``.
    :param max_bytes_in_flight_per_peer: the share of ``max_bytes_in_flight`` one peer's calls
      may hold, so that one peer cannot starve the others (its call that would pass it fails
      with ``ResourceLimitError``; other peers' calls go on). None: a quarter of
      ``max_bytes_in_flight``, but at least the host's ``max_message_size`` (one whole message)
      and at most ``max_bytes_in_flight``; ``bytes_in_flight_per_peer`` resolves it.
    :param max_lanes_per_peer: data lanes one peer may hold open to us (plus unredeemed
      tickets); past it the peer's bulk calls go over libp2p.
    :param max_lanes_total: data lanes the host holds open over all peers (each is a file
      descriptor). When they are all open, a new lane takes the place of a stale idle one
      (idle longer than a caller reuses a stream: the oldest of the peer holding the most
      lanes); with none, it is refused and its bulk call goes over libp2p. Capped at half the
      process's soft limit on open files (``ulimit -n``) when that is lower
      (``lanes_within_fd_limit``).
    :param max_tickets_per_peer: unredeemed lane tickets one peer may hold (its oldest is
      dropped for a new one).
    :param max_pending_handshakes_per_ip: lane connections from one IP that have not shown a
      ticket yet (its oldest is closed for a new one); 64 over all IPs, oldest closed first.
    :param max_inbound_connections: libp2p connections other peers may hold to us at once
      (each is a file descriptor plus Noise and yamux state); capped at a quarter of the
      process's soft ``ulimit -n`` when that is lower. Past it a new connection is closed
      before its handshake; our own dials are not counted here.
    :param max_inbound_connections_per_ip: inbound libp2p connections from one source address
      (an IPv6 /64 counts as one), so that identities made on one machine cannot take every
      slot; volunteers behind one NAT share it.
    :param connection_grace_period: once a host holds more than 3/4 of
      ``max_inbound_connections`` connections, those without an open stream that are older
      than this (s) are closed, oldest and least valued first (py-libp2p's pruner, up to 20 a
      second), so that idle identities cannot keep newcomers out; their peers redial when
      they need us.
    """

    max_inbound_calls_per_peer: int = 256
    max_bytes_in_flight: int = 1024 * 1024 * 1024
    max_bytes_in_flight_per_peer: int | None = None
    max_lanes_per_peer: int = 16
    max_lanes_total: int = 512
    max_tickets_per_peer: int = 4
    max_pending_handshakes_per_ip: int = 8
    max_inbound_connections: int = 1024
    max_inbound_connections_per_ip: int = 128
    connection_grace_period: float = 20.0

    def __post_init__(self):
        for name in (
            "max_inbound_calls_per_peer",
            "max_bytes_in_flight",
            "max_bytes_in_flight_per_peer",
            "max_lanes_per_peer",
            "max_lanes_total",
            "max_tickets_per_peer",
            "max_pending_handshakes_per_ip",
            "max_inbound_connections",
            "max_inbound_connections_per_ip",
        ):
            value = getattr(self, name)
            if value is None and name == "max_bytes_in_flight_per_peer":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ResourceLimits.{name} must be a positive int, got {value!r}")
        grace = self.connection_grace_period
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ValueError(
                f"ResourceLimits.connection_grace_period must be a non-negative number of "
                f"seconds, got {grace!r}"
            )
        per_peer = self.max_bytes_in_flight_per_peer
        if per_peer is not None and per_peer > self.max_bytes_in_flight:
            raise ValueError(
                f"ResourceLimits.max_bytes_in_flight_per_peer ({per_peer}) must be at most "
                f"max_bytes_in_flight ({self.max_bytes_in_flight})"
            )

    def bytes_in_flight_per_peer(self, max_message_size: int) -> int:
        """One peer's share of ``max_bytes_in_flight`` on a host whose messages may be
        ``max_message_size`` bytes (see ``max_bytes_in_flight_per_peer``)."""
        if self.max_bytes_in_flight_per_peer is not None:
            return self.max_bytes_in_flight_per_peer
        share = max(self.max_bytes_in_flight // 4, max_message_size)
        return min(share, self.max_bytes_in_flight)


def fd_soft_limit() -> int | None:
    """The process's soft limit on open files (None: unlimited or unknown)."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def lanes_within_fd_limit(max_lanes_total: int, fd_soft_limit: int | None) -> int:
    """The host-wide lane cap for a process that may open ``fd_soft_limit`` files (None or
    negative: unlimited): ``max_lanes_total``, or half the soft limit when that is lower, so
    lanes leave room for libp2p connections, handshakes on the lane port and files."""
    if fd_soft_limit is None or fd_soft_limit < 0:
        return max_lanes_total
    return max(1, min(max_lanes_total, fd_soft_limit // 2))


class ByteBudget:
    """Bytes held in receive buffers, against a limit (one per host, shared by its calls),
    and against ``per_peer_limit`` for the bytes of each peer's calls (default: the limit).
    ``for_peer(peer)`` is what one call's decoder charges."""

    def __init__(self, limit: int, per_peer_limit: int | None = None):
        if limit <= 0:
            raise ValueError("a byte budget must be positive")
        if per_peer_limit is not None and per_peer_limit <= 0:
            raise ValueError("a per-peer byte budget must be positive")
        self.limit = limit
        self.per_peer_limit = limit if per_peer_limit is None else min(per_peer_limit, limit)
        self.used = 0
        self.peak = 0
        self.refused = 0
        self.refused_per_peer = 0  # (counted in ``refused`` too)
        self._per_peer: dict[Hashable, int] = {}

    def reserve(self, count: int, peer: Hashable | None = None) -> None:
        """Take ``count`` bytes (for ``peer``'s call), or raise ``ResourceLimitError``
        (taking nothing)."""
        held = self._per_peer.get(peer, 0) if peer is not None else 0
        if peer is not None and held + count > self.per_peer_limit:
            self.refused += 1
            self.refused_per_peer += 1
            raise ResourceLimitError(
                f"this peer's share of the callee's bytes in flight is used up ({held} of "
                f"{self.per_peer_limit} bytes held by its incomplete messages; {count} more "
                "wanted): finish or close its other calls first"
            )
        if self.used + count > self.limit:
            self.refused += 1
            raise ResourceLimitError(
                f"the callee's budget of bytes in flight is used up ({self.used} of "
                f"{self.limit} bytes held by incomplete messages; {count} more wanted)"
            )
        self.used += count
        self.peak = max(self.peak, self.used)
        if peer is not None:
            self._per_peer[peer] = held + count

    def release(self, count: int, peer: Hashable | None = None) -> None:
        self.used -= count
        if self.used < 0:
            raise RuntimeError("released more bytes than were reserved")
        if peer is not None:
            held = self._per_peer.get(peer, 0) - count
            if held < 0:
                raise RuntimeError("released more bytes than were reserved for this peer")
            if held:
                self._per_peer[peer] = held
            else:
                del self._per_peer[peer]

    def used_by(self, peer: Hashable) -> int:
        """Bytes held by ``peer``'s calls."""
        return self._per_peer.get(peer, 0)

    def for_peer(self, peer: Hashable) -> PeerBytes:
        """The charges of one call of ``peer`` (what ``FrameDecoder`` takes as its budget)."""
        return PeerBytes(self, peer)


class PeerBytes:
    """A ``ByteBudget`` seen by one peer's call: ``reserve``/``release`` charge the host's
    total and that peer's share together."""

    __slots__ = ("budget", "peer")

    def __init__(self, budget: ByteBudget, peer: Hashable):
        self.budget, self.peer = budget, peer

    def reserve(self, count: int) -> None:
        self.budget.reserve(count, self.peer)

    def release(self, count: int) -> None:
        self.budget.release(count, self.peer)


class PeerCounter:
    """How many of something each peer holds (e.g. concurrent calls), against a per-peer
    limit."""

    def __init__(self, limit: int, what: str):
        self.limit, self.what = limit, what
        self._counts: Counter[Hashable] = Counter()
        self.refused = 0

    def acquire(self, peer: Hashable) -> None:
        """Count one more for ``peer``, or raise ``ResourceLimitError``."""
        if self._counts[peer] >= self.limit:
            self.refused += 1
            raise ResourceLimitError(f"too many {self.what} from one peer (limit {self.limit})")
        self._counts[peer] += 1

    def release(self, peer: Hashable) -> None:
        self._counts[peer] -= 1
        if self._counts[peer] <= 0:
            del self._counts[peer]

    def count(self, peer: Hashable) -> int:
        return self._counts.get(peer, 0)

    def total(self) -> int:
        return sum(self._counts.values())
