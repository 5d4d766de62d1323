"""When a progress core hands out this peer's record, for the DHT and for gossip (sans-IO).

A report, an announcement or a change of the partners it lists marks the record for both
channels. Storing: at once after such a change, else every ``metadata_expiration / 2`` (the
record must not expire while the peer runs). Gossip: only after a change, at once for a new
epoch, else at most every ``gossip_period``. Only an active peer's record is handed out (the
caller says whether it is active); once one was, the peer has a record to take back when it
leaves (:attr:`PublishSchedule.has_published`).
"""

from __future__ import annotations

import math

__all__ = ["PublishSchedule"]


class PublishSchedule:
    """When to store and gossip this peer's record (see the module docstring).

    :param store_period: seconds between stores without a change
    :param gossip_period: the shortest time between two gossiped records of one epoch
    """

    def __init__(self, store_period: float, gossip_period: float):
        self._store_period = store_period
        self._gossip_period = gossip_period
        self._store_pending = self._gossip_pending = self._epoch_changed = False
        self._last_store_time = self._last_gossip_time = -math.inf
        self._has_published = False

    @property
    def has_published(self) -> bool:
        """Whether a record was handed out for storing or gossip (then say goodbye)."""
        return self._has_published

    def on_changed(self, *, new_epoch: bool = False) -> None:
        """The record changed (``new_epoch``: this peer entered another epoch): store and
        gossip it."""
        if new_epoch:
            self._epoch_changed = True
        self._store_pending = self._gossip_pending = True

    def next_store_time(self, now: float) -> float:
        """When to call :meth:`take_store` (at once after a change)."""
        if self._store_pending:
            return now
        return self._last_store_time + self._store_period

    def take_store(self, now: float, active: bool) -> bool:
        """Whether to store the record now (only an ``active`` peer's)."""
        self._store_pending = False
        self._last_store_time = now
        if not active:
            return False
        self._has_published = True
        return True

    def next_gossip_time(self, now: float) -> float | None:
        """When to call :meth:`take_gossip`; None if there is nothing to say."""
        if not self._gossip_pending:
            return None
        if self._epoch_changed:
            return now
        return max(now, self._last_gossip_time + self._gossip_period)

    def take_gossip(self, now: float, active: bool) -> bool:
        """Whether to gossip the record now (only a changed one, of an ``active`` peer)."""
        pending = self._gossip_pending
        self._gossip_pending = self._epoch_changed = False
        self._last_gossip_time = now
        if not (pending and active):
            return False
        self._has_published = True
        return True
