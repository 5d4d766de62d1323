"""Temporary bans of unresponsive peers, with exponential backoff (sans-IO)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .storage import TimedStorage

__all__ = ["Blacklist", "BlacklistStatistics"]

PeerT = TypeVar("PeerT", bound=Hashable)


@dataclass(frozen=True)
class BlacklistStatistics:
    """Snapshot of a :class:`Blacklist`."""

    num_tracked_peers: int
    num_banned_peers: int


class Blacklist(Generic[PeerT]):
    """Bans a peer for ``blacklist_time * backoff_rate ** (failures - 1)`` seconds after a failure.

    The ban length is capped at ``max_ban_time``. A success forgives the peer at once; so does a
    quiet period as long as the last ban. ``blacklist_time=0`` disables banning.
    """

    def __init__(
        self, blacklist_time: float = 5.0, backoff_rate: float = 2.0, max_ban_time: float = 3600.0
    ):
        if blacklist_time < 0 or backoff_rate < 1 or max_ban_time < blacklist_time:
            raise ValueError(
                "need blacklist_time >= 0, backoff_rate >= 1 and max_ban_time >= blacklist_time, "
                f"got {blacklist_time}, {backoff_rate}, {max_ban_time}"
            )
        self.blacklist_time, self.backoff_rate = blacklist_time, backoff_rate
        self.max_ban_time = max_ban_time
        self._records: TimedStorage[PeerT, tuple[int, float]] = TimedStorage()  # failures, until

    def register_failure(self, peer: PeerT, now: float) -> float:
        """Ban ``peer`` after a failed request; returns the DHT time the ban ends.

        Failures reported while the peer is already banned (concurrent requests) do not extend it.
        """
        if self.blacklist_time == 0:
            return now
        entry = self._records.get(peer, now)
        failures, banned_until = entry.value if entry is not None else (0, now)
        if banned_until > now:
            return banned_until
        exponent = min(failures, 64)
        duration = min(self.blacklist_time * self.backoff_rate**exponent, self.max_ban_time)
        banned_until = now + duration
        self._records.pop(peer)
        self._records.store(peer, (failures + 1, banned_until), banned_until + duration, now)
        return banned_until

    def register_success(self, peer: PeerT) -> None:
        """Forget ``peer``'s failures."""
        self._records.pop(peer)

    def is_banned(self, peer: PeerT, now: float) -> bool:
        """Whether ``peer`` must not be contacted at time ``now``."""
        entry = self._records.get(peer, now)
        return entry is not None and entry.value[1] > now

    def statistics(self, now: float) -> BlacklistStatistics:
        """How many peers have recent failures and how many are banned at ``now``."""
        items = self._records.items(now)
        banned = sum(1 for _, entry in items if entry.value[1] > now)
        return BlacklistStatistics(num_tracked_peers=len(items), num_banned_peers=banned)
