"""Resource limits of a ``P2P`` host against peers that declare much and send little.

Sans-IO: ``ResourceLimits`` holds the settings (``P2PConfig.limits``), ``ByteBudget`` counts
the bytes a host's inbound calls hold in buffers they allocated (payloads and attachments
still being received), ``PeerCounter`` counts per-peer things (calls, lanes, tickets).
Memory follows the bytes that arrived: a frame that declares N bytes allocates at most
``INITIAL_ALLOCATION`` at first and grows as its bytes come (framing.py), so a declaration
alone costs nothing; these limits bound what arrived bytes can pin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from swarmtrain.p2p.errors import ResourceLimitError

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
    :param max_lanes_per_peer: data lanes one peer may hold open to us (plus unredeemed
      tickets); past it the peer's bulk calls go over libp2p.
    :param max_tickets_per_peer: unredeemed lane tickets one peer may hold (its oldest is
      dropped for a new one).
    :param max_pending_handshakes_per_ip: lane connections from one IP that have not shown a
      ticket yet (its oldest is closed for a new one); 64 over all IPs, oldest closed first.
    """

    max_inbound_calls_per_peer: int = 256
    max_bytes_in_flight: int = 1024 * 1024 * 1024
    max_lanes_per_peer: int = 16
    max_tickets_per_peer: int = 4
    max_pending_handshakes_per_ip: int = 8

    def __post_init__(self):
        for name in (
            "max_inbound_calls_per_peer",
            "max_bytes_in_flight",
            "max_lanes_per_peer",
            "max_tickets_per_peer",
            "max_pending_handshakes_per_ip",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ResourceLimits.{name} must be a positive int, got {value!r}")


class ByteBudget:
    """Bytes held in receive buffers, against a limit (one per host, shared by its calls)."""

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError("a byte budget must be positive")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.refused = 0

    def reserve(self, count: int) -> None:
        """Take ``count`` bytes, or raise ``ResourceLimitError`` (taking nothing)."""
        if self.used + count > self.limit:
            self.refused += 1
            raise ResourceLimitError(
                f"the callee's budget of bytes in flight is used up ({self.used} of "
                f"{self.limit} bytes held by incomplete messages; {count} more wanted)"
            )
        self.used += count
        self.peak = max(self.peak, self.used)

    def release(self, count: int) -> None:
        self.used -= count
        if self.used < 0:
            raise RuntimeError("released more bytes than were reserved")


class PeerCounter:
    """How many of something each peer holds, against a per-peer limit."""

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
