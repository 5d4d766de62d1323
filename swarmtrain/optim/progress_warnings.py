"""The warnings of a progress core: conditions worth a log line, each reported once (sans-IO).

:class:`ImplausibleProgress` (a peer's record was ignored or its samples capped, once per
peer), :class:`ClockSkewDetected` (a record's report time is far in our future, or a gossiped
one, which travels in milliseconds, far in our past), :class:`LonePeer` (no other peer for
``lone_peer_timeout`` seconds), :class:`TargetNotReached` (an epoch lasted ``stall_factor``
times the duration its first ETA promised, without reaching the target).
"""

from __future__ import annotations

from .progress_types import (
    ClockSkewDetected,
    GlobalProgress,
    ImplausibleProgress,
    LocalProgress,
    LonePeer,
    ProgressConfig,
    ProgressWarning,
    TargetNotReached,
)

__all__ = ["ProgressWarnings"]


class ProgressWarnings:
    """Warnings decided and not returned yet (see the module docstring)."""

    def __init__(self, config: ProgressConfig):
        self.config = config
        self._pending: list[ProgressWarning] = []
        self._implausible_warned: set[bytes] = set()
        self._skew_warned: set[bytes] = set()
        self._alone_since: float | None = None
        self._lone_warned = False
        self._stall_warned_epoch = -1

    def implausible(self, key: bytes, warning: ImplausibleProgress) -> None:
        """The record under ``key`` was ignored or its samples capped (reported once a key)."""
        if key not in self._implausible_warned:
            self._implausible_warned.add(key)
            self._pending.append(warning)

    def check_clock(self, progress: LocalProgress, now: float, gossiped: bool) -> None:
        """Compare a record's report time with ``now`` (``gossiped``: it came over gossip)."""
        offset = progress.time - now
        # a gossiped record left its owner at most gossip_period after its report time
        if gossiped and offset < 0:
            offset = min(0.0, offset + self.config.gossip_period)
        elif offset < 0:
            return  # a record from the DHT may be old: its age says nothing about clocks
        if abs(offset) <= self.config.max_clock_skew:
            return
        if progress.peer_id not in self._skew_warned:
            self._skew_warned.add(progress.peer_id)
            self._pending.append(ClockSkewDetected(progress.peer_id, offset))

    def on_others_seen(self) -> None:
        """Another peer's record is live: this peer is not alone (warn again once it is)."""
        self._alone_since, self._lone_warned = None, False

    def on_nobody_seen(self, now: float) -> None:
        """A fetch found no other peer: alone since the first such fetch."""
        if self._alone_since is None:
            self._alone_since = now

    def take(
        self,
        now: float,
        progress: GlobalProgress,
        epoch_started_at: float,
        expected_duration: float | None,
    ) -> list[ProgressWarning]:
        """Warnings not returned before; ``progress`` is the swarm's, its epoch began at
        ``epoch_started_at`` and its first ETA promised ``expected_duration`` (None: none)."""
        found, self._pending = self._pending, []
        alone_since = self._alone_since
        if (
            alone_since is not None
            and not self._lone_warned
            and now - alone_since >= self.config.lone_peer_timeout
        ):
            self._lone_warned = True
            found.append(LonePeer(progress.epoch, now - alone_since))
        expected = expected_duration
        waited = now - epoch_started_at
        if (
            expected is not None
            and self._stall_warned_epoch != progress.epoch
            and progress.samples_accumulated < progress.target_batch_size
            and waited > self.config.stall_factor * max(expected, self.config.min_refresh_period)
            and waited > self.config.min_stall_time
        ):
            self._stall_warned_epoch = progress.epoch
            found.append(
                TargetNotReached(
                    progress.epoch,
                    progress.samples_accumulated,
                    progress.target_batch_size,
                    waited,
                    expected,
                )
            )
        return found
