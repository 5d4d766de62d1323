"""Which peers a DHT node does not call for a while (sans-IO): bans of misbehaving peers and
shorter backoffs of unresponsive ones, both growing exponentially."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .storage import TimedStorage

__all__ = ["DEFAULT_MAX_BACKOFF_TIME", "Blacklist", "BlacklistStatistics"]

PeerT = TypeVar("PeerT", bound=Hashable)

#: longest backoff (seconds) of a peer that only failed to answer in time
DEFAULT_MAX_BACKOFF_TIME = 30.0


@dataclass(frozen=True)
class BlacklistStatistics:
    """Snapshot of a :class:`Blacklist`."""

    num_tracked_peers: int  #: peers banned recently (misbehaviour)
    num_banned_peers: int  #: peers banned now
    num_backed_off_peers: int = 0  #: unresponsive peers not to be called now


class _ExponentialHold(Generic[PeerT]):
    """``base * rate ** (n - 1)`` seconds (at most ``cap``) after a peer's n-th failure; a
    failure while the peer is held does not count; a quiet period as long as the last hold
    forgets the peer."""

    def __init__(self, base: float, rate: float, cap: float):
        self.base, self.rate, self.cap = base, rate, cap
        self._records: TimedStorage[PeerT, tuple[int, float]] = TimedStorage()  # failures, until

    def register(self, peer: PeerT, now: float) -> float:
        if self.base == 0:
            return now
        entry = self._records.get(peer, now)
        failures, until = entry.value if entry is not None else (0, now)
        if until > now:
            return until
        duration = min(self.base * self.rate ** min(failures, 64), self.cap)
        until = now + duration
        self._records.pop(peer)
        self._records.store(peer, (failures + 1, until), until + duration, now)
        return until

    def forget(self, peer: PeerT) -> None:
        self._records.pop(peer)

    def is_held(self, peer: PeerT, now: float) -> bool:
        entry = self._records.get(peer, now)
        return entry is not None and entry.value[1] > now

    def counts(self, now: float) -> tuple[int, int]:
        items = self._records.items(now)
        return len(items), sum(1 for _, entry in items if entry.value[1] > now)


class Blacklist(Generic[PeerT]):
    """Two kinds of hold on a peer, each ``blacklist_time * backoff_rate ** (failures - 1)``
    seconds long, failures reported during a hold not counted:

    - a **ban** (:meth:`register_failure`) for misbehaviour (a wrong node id, a malformed
      answer), at most ``max_ban_time``; an answer does not lift it, a quiet period as long as
      the last ban forgets the peer;
    - a **backoff** (:meth:`register_unresponsive`) for a network failure (a timeout, a refused
      dial, a reset), at most ``max_backoff_time``; any answer or request from the peer lifts
      it (:meth:`register_success`). The caller decides whether a backed-off peer is skipped
      (the DHT asks it anyway when it has nobody else).

    ``blacklist_time=0`` disables both.
    """

    def __init__(
        self,
        blacklist_time: float = 5.0,
        backoff_rate: float = 2.0,
        max_ban_time: float = 3600.0,
        max_backoff_time: float = DEFAULT_MAX_BACKOFF_TIME,
    ):
        if (
            blacklist_time < 0
            or backoff_rate < 1
            or max_ban_time < blacklist_time
            or max_backoff_time < 0
        ):
            raise ValueError(
                "need blacklist_time >= 0, backoff_rate >= 1, max_ban_time >= blacklist_time and "
                f"max_backoff_time >= 0, got {blacklist_time}, {backoff_rate}, {max_ban_time}, "
                f"{max_backoff_time}"
            )
        self.blacklist_time, self.backoff_rate = blacklist_time, backoff_rate
        self.max_ban_time, self.max_backoff_time = max_ban_time, max_backoff_time
        self._bans: _ExponentialHold[PeerT] = _ExponentialHold(
            blacklist_time, backoff_rate, max_ban_time
        )
        self._backoffs: _ExponentialHold[PeerT] = _ExponentialHold(
            min(blacklist_time, max_backoff_time), backoff_rate, max_backoff_time
        )

    def register_failure(self, peer: PeerT, now: float) -> float:
        """Ban ``peer`` for misbehaving; returns the DHT time the ban ends."""
        return self._bans.register(peer, now)

    def register_unresponsive(self, peer: PeerT, now: float) -> float:
        """Back off from ``peer`` after a network failure; returns when the backoff ends."""
        return self._backoffs.register(peer, now)

    def register_success(self, peer: PeerT) -> None:
        """``peer`` answered (or called us): forget its network failures (not its bans)."""
        self._backoffs.forget(peer)

    def is_banned(self, peer: PeerT, now: float) -> bool:
        """Whether ``peer`` is banned (must not be called) at time ``now``."""
        return self._bans.is_held(peer, now)

    def is_backed_off(self, peer: PeerT, now: float) -> bool:
        """Whether ``peer`` failed to answer recently and should be skipped at ``now`` if
        another peer can be asked instead."""
        return self._backoffs.is_held(peer, now)

    def statistics(self, now: float) -> BlacklistStatistics:
        """How many peers were banned recently, are banned, and are backed off at ``now``."""
        tracked, banned = self._bans.counts(now)
        return BlacklistStatistics(
            num_tracked_peers=tracked,
            num_banned_peers=banned,
            num_backed_off_peers=self._backoffs.counts(now)[1],
        )
