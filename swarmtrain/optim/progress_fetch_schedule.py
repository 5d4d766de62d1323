"""When the progress core fetches the swarm's progress from the DHT (sans-IO).

The next fetch comes after ``default_refresh_period`` when we see no other peer, else after
``eta * n / max(n + expected_drift_peers, n * (1 + expected_drift_rate))`` clipped to
``[min_refresh_period, max_refresh_period]`` (:func:`fetch_period`): the more peers may join
before the epoch ends, the sooner we look again. The period runs from the end of the last
fetch, or from the start of one still out: up to ``MAX_FETCHES_IN_FLIGHT`` fetches may run at
once, so a read that is slow (a loaded peer, a relayed path, an RPC timing out) does not hold
the next one back, and a record stored meanwhile is seen within about two periods and two
typical reads, not behind the slow read (reads faster than the period run one at a time)
(:meth:`FetchSchedule.due`, :meth:`FetchSchedule.start`). A fetch that ends makes the ones
begun before it obsolete (what they would bring is older): they stop counting and the tracker
stops them (:meth:`FetchSchedule.running`), so slow reads never fill the slots for long.
Gossip and local reports can only bring the next fetch earlier (never before the last fetch,
its end or the start of one still out, plus the period computed now), so a steady flow of
gossip never postpones the DHT fallback. A failed fetch counts as begun, ended and answered
when it failed (the caller sets the retry time).

Nothing here reads a clock: every method that depends on time takes ``now``.
"""

from __future__ import annotations

import itertools
import math

from .progress_types import ProgressConfig

__all__ = ["MAX_FETCHES_IN_FLIGHT", "FetchSchedule", "fetch_period"]

#: DHT fetches of the swarm's progress that may run at once (the next one starts on schedule
#: while a slow one is still out; see the module docstring)
MAX_FETCHES_IN_FLIGHT = 2


def fetch_period(config: ProgressConfig, eta: float, num_peers: int, alone: bool) -> float:
    """Seconds from one fetch to the next (see the module docstring): ``eta`` is the seconds
    left in the epoch, ``num_peers`` the peers counted in it, ``alone``: no other peer."""
    if alone:
        return config.default_refresh_period
    expected_max = max(
        num_peers + config.expected_drift_peers,
        num_peers * (1 + config.expected_drift_rate),
    )
    return min(
        max(eta * num_peers / expected_max, config.min_refresh_period),
        config.max_refresh_period,
    )


class FetchSchedule:
    """The fetches running, when the last ones began and ended, and when the next is due.

    :param now: creation time: the first fetch is due then (until :meth:`reschedule`)
    """

    def __init__(self, now: float):
        self.next_time = now  #: when the next fetch is due (set by :meth:`reschedule`)
        self._last_end: float | None = None
        self._last_started: float | None = None  # of the last fetch begun
        self._last_result_began: float | None = None  # when the newest result's fetch began
        self._running: dict[int, float] = {}  # fetches running: number -> start
        self._numbers = itertools.count()

    @property
    def last_end(self) -> float | None:
        """When the last fetch (or failed attempt) ended; None before the first."""
        return self._last_end

    @property
    def in_flight(self) -> int:
        """Fetches started (:meth:`start`) and not ended yet."""
        return len(self._running)

    def running(self, fetch: int) -> bool:
        """Whether fetch ``fetch`` (from :meth:`start`) still counts. False once it ended, or
        once a fetch begun after it ended first (it is obsolete then: stop it)."""
        return fetch in self._running

    def due(self, now: float) -> bool:
        """Whether to start a fetch now: its time came and fewer than
        ``MAX_FETCHES_IN_FLIGHT`` are running."""
        return self.next_start(now) <= now

    def next_start(self, now: float) -> float:
        """When the next fetch may start (inf while ``MAX_FETCHES_IN_FLIGHT`` run: then the end
        of one of them comes first)."""
        if len(self._running) >= MAX_FETCHES_IN_FLIGHT:
            return math.inf
        return self.next_time

    def no_result_since(self, since: float) -> bool:
        """Whether no fetch begun at or after ``since`` brought a result (or failed) yet."""
        began = self._last_result_began
        return began is None or began < since

    def start(self, now: float) -> int:
        """A fetch starts now; returns its number, for :meth:`end` or :meth:`fail`. Then
        :meth:`reschedule` with ``started``."""
        number = next(self._numbers)
        self._running[number] = now
        self._last_started = now
        return number

    def end(self, fetch: int | None, now: float) -> None:
        """``fetch`` ended with a result: it and every fetch begun before it stop counting
        (what they would bring is older than what it brought; :meth:`running` tells the
        caller). Without a number it counts as begun at ``now``; an obsolete one (its result
        came anyway) says nothing about when it began. Then :meth:`reschedule` with
        ``fetched``."""
        if fetch is None:
            began: float | None = now
        else:
            began = self._running.pop(fetch, None)
            if began is not None:
                for number in [n for n, at in self._running.items() if at <= began]:
                    del self._running[number]
        if began is not None and (
            self._last_result_began is None or began > self._last_result_began
        ):
            self._last_result_began = began
        self._last_end = now

    def fail(self, fetch: int | None, now: float) -> None:
        """Fetch ``fetch`` failed: an attempt begun, ended and answered now (gossip must not
        bring the retry forward, and it ends a confirmation alone). Then :meth:`reschedule`
        with the retry time as ``at``."""
        if fetch is not None:
            self._running.pop(fetch, None)
        self._last_end = self._last_started = self._last_result_began = now

    def reschedule(
        self,
        now: float,
        period: float,
        *,
        fetched: bool = False,
        started: bool = False,
        at: float | None = None,
        confirm_since: float | None = None,
    ) -> float:
        """Set and return :attr:`next_time`: ``at`` if given; else now when this peer is alone
        at its target since ``confirm_since`` and no fetch began since; else a ``period`` after
        a fetch that just ``started`` or was ``fetched``; else only ever earlier, never before
        the last fetch (start or end) plus ``period``."""
        last_started = self._last_started
        if (
            confirm_since is not None
            and at is None
            and (last_started is None or last_started < confirm_since)
        ):
            at = now
        # A period after the last fetch ended, as before; and a period after a fetch began
        # while it is still out (a slow read does not push the next one back: that one starts
        # beside it, see due).
        ends = [t for t in (self._last_end, last_started) if t is not None]
        anchor = max(ends) if ends else None
        if at is None:
            if fetched or started:
                at = now + period
            elif anchor is None:
                at = self.next_time
            else:  # only ever earlier, and never before the last fetch (start or end) + period
                at = min(self.next_time, anchor + period)
        self.next_time = at
        return at
