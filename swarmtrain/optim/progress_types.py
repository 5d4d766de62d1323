"""The values of progress tracking: a tracker's settings (:class:`ProgressConfig`), this peer's
speed (:class:`PerformanceEMA`), a peer's published record (:class:`LocalProgress`), the swarm's
progress as a peer sees it (:class:`GlobalProgress`) and the warnings
:class:`~swarmtrain.optim.progress_core.ProgressCore` returns. Plain data with validation; the
rules that combine them are in :mod:`swarmtrain.optim.progress_core`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

from .progress_votes import MAX_LISTED_PARTNERS, MAX_PEER_ID_BYTES, MIN_KNOWN_RATE

__all__ = [
    "EPS",
    "ClockSkewDetected",
    "GlobalProgress",
    "ImplausibleProgress",
    "LocalProgress",
    "LonePeer",
    "PerformanceEMA",
    "ProgressConfig",
    "ProgressWarning",
    "TargetNotReached",
    "describe_eta",
    "short_peer_id",
]

EPS = 1e-20  #: samples/s of a peer that has not measured its speed yet (never zero: we divide)


def short_peer_id(peer_id: bytes) -> str:
    """The tail of a peer id's hex, for messages (an Ed25519 peer id's head is a constant)."""
    return peer_id.hex()[-16:]


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be non-negative and finite, got {value!r}")


@dataclass(frozen=True)
class ProgressConfig:
    """Validated settings of a progress tracker (hivemind's names and defaults).

    :param target_batch_size: samples the swarm accumulates per epoch
    :param min_refresh_period: fetch the swarm's progress from the DHT at most this often (s)
    :param max_refresh_period: ... and at least this often, while other peers are seen (s)
    :param default_refresh_period: fetch this often while no other peer is seen (s)
    :param expected_drift_peers: assume this many peers may join before the epoch ends
    :param expected_drift_rate: ... or this fraction of the swarm, whichever is more
    :param performance_ema_alpha: smoothing of this peer's samples/s (1: only the last report)
    :param metadata_expiration: a progress record lives this long in the DHT (s); it is
      re-published every half of it
    :param gossip_period: publish progress over gossip at most this often (s); epoch changes
      and departures are published at once
    :param max_clock_skew: report peers whose clock seems off by more than this (s)
    :param stall_factor: report an epoch that lasts this many times its first ETA
    :param min_stall_time: ... and at least this long (s; short epochs jitter a lot)
    :param lone_peer_timeout: report having seen no other peer for this long (s)
    :param quorum_fraction: the global epoch is the highest that more than this fraction of the
      voting peers is at or beyond (see the module docstring)
    :param max_rate_factor: a peer's samples count at most at this multiple of the swarm's
      reference speed (heterogeneous swarms need room: a peer faster than this is undercounted)
    :param probe_timeout: the owner of a record ahead of us that cannot be dialled within this
      long is taken for gone: its record is ignored until it stores a newer one (s; see
      :mod:`swarmtrain.optim.progress_liveness`)
    :param probe_retry_period: dial such an owner again no sooner than this (s)
    :param partner_window: a peer that averaged with this one in a round of epoch ``e`` is a
      partner (its votes for epochs ahead of ours count) while our epoch is at most
      ``e + partner_window`` (see :mod:`swarmtrain.optim.progress_votes`)
    :param trusted_peers: peer ids (bytes) whose records vote on the epoch and vouch for
      samples like a partner's, also before this peer has partners (the organisers' peers: a
      newcomer then follows them, not a majority of free identities)
    """

    target_batch_size: int
    min_refresh_period: float = 0.5
    max_refresh_period: float = 10.0
    default_refresh_period: float = 3.0
    expected_drift_peers: float = 3.0
    expected_drift_rate: float = 0.2
    performance_ema_alpha: float = 0.1
    metadata_expiration: float = 60.0
    gossip_period: float = 0.5
    max_clock_skew: float = 10.0
    stall_factor: float = 3.0
    min_stall_time: float = 30.0
    lone_peer_timeout: float = 30.0
    quorum_fraction: float = 0.5
    max_rate_factor: float = 8.0
    probe_timeout: float = 3.0
    probe_retry_period: float = 10.0
    partner_window: int = 4
    trusted_peers: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        if (
            isinstance(self.target_batch_size, bool)
            or not isinstance(self.target_batch_size, int)
            or self.target_batch_size < 1
        ):
            raise ValueError(
                f"target_batch_size must be a positive integer, got {self.target_batch_size!r}"
            )
        for name in (
            "min_refresh_period",
            "max_refresh_period",
            "default_refresh_period",
            "metadata_expiration",
            "max_clock_skew",
            "lone_peer_timeout",
            "probe_timeout",
            "probe_retry_period",
        ):
            _check_positive(name, getattr(self, name))
        for name in (
            "expected_drift_peers",
            "expected_drift_rate",
            "gossip_period",
            "min_stall_time",
        ):
            _check_non_negative(name, getattr(self, name))
        if self.min_refresh_period > self.max_refresh_period:
            raise ValueError(
                f"min_refresh_period ({self.min_refresh_period}) must not exceed "
                f"max_refresh_period ({self.max_refresh_period})"
            )
        _check_positive("performance_ema_alpha", self.performance_ema_alpha)
        if self.performance_ema_alpha > 1:
            raise ValueError("performance_ema_alpha must be in (0, 1]")
        _check_positive("stall_factor", self.stall_factor)
        if self.stall_factor < 1:
            raise ValueError("stall_factor must be at least 1")
        _check_non_negative("quorum_fraction", self.quorum_fraction)
        if self.quorum_fraction >= 1:
            raise ValueError("quorum_fraction must be in [0, 1)")
        _check_positive("max_rate_factor", self.max_rate_factor)
        if self.max_rate_factor < 1:
            raise ValueError("max_rate_factor must be at least 1")
        window = self.partner_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"partner_window must be a non-negative integer, got {window!r}")
        if isinstance(self.trusted_peers, (str, bytes)):
            raise TypeError("trusted_peers must be a collection of peer ids, not one")
        trusted = frozenset(self.trusted_peers)
        for peer_id in trusted:
            if not isinstance(peer_id, bytes) or not peer_id:
                raise TypeError(f"trusted_peers must be peer ids as bytes, got {peer_id!r}")
        object.__setattr__(self, "trusted_peers", trusted)


class PerformanceEMA:
    """Samples per second, as a bias-corrected exponential moving average of seconds per sample.

    ``now`` is any clock in seconds. While paused (e.g. while averaging), time does not count:
    ``resume`` continues the interval that was running when ``pause`` was called.
    """

    def __init__(self, alpha: float = 0.1, *, now: float, eps: float = EPS):
        _check_positive("alpha", alpha)
        if alpha > 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha, self.eps = alpha, eps
        self.num_updates = 0
        self.samples_per_second = eps
        self._seconds_per_sample = 0.0
        self._timestamp = now
        self._paused_elapsed: float | None = None

    @property
    def paused(self) -> bool:
        return self._paused_elapsed is not None

    def update(self, task_size: float, now: float) -> float:
        """Count ``task_size`` samples done since the previous update (or timer reset)."""
        if not task_size > 0:
            raise ValueError(f"task_size must be positive, got {task_size!r}")
        if self._paused_elapsed is not None:
            interval, self._paused_elapsed = self._paused_elapsed, 0.0
        else:
            interval = max(0.0, now - self._timestamp)
        self._timestamp = now
        alpha = self.alpha
        self._seconds_per_sample = (
            alpha * interval / task_size + (1 - alpha) * self._seconds_per_sample
        )
        self.num_updates += 1
        unbiased = self._seconds_per_sample / (1 - (1 - alpha) ** self.num_updates)
        self.samples_per_second = 1 / max(unbiased, self.eps)
        return self.samples_per_second

    def reset_timer(self, now: float) -> None:
        """Start the next interval now (the work since the last update is not counted)."""
        self._timestamp = now
        if self._paused_elapsed is not None:
            self._paused_elapsed = 0.0

    def pause(self, now: float) -> None:
        if self._paused_elapsed is None:
            self._paused_elapsed = max(0.0, now - self._timestamp)

    def resume(self, now: float) -> None:
        if self._paused_elapsed is not None:
            self._timestamp = now - self._paused_elapsed
            self._paused_elapsed = None


@dataclass(frozen=True)
class LocalProgress:
    """One peer's progress, as published (hivemind's ``LocalTrainingProgress``)."""

    peer_id: bytes
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float  #: DHT time of the report the samples were counted at
    client_mode: bool
    #: peer ids of its round partners (most recent first; at most ``MAX_LISTED_PARTNERS``): it
    #: vouches for their samples (see :mod:`swarmtrain.optim.progress_votes`); records written
    #: before this field existed vouch for nobody
    partners: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, bytes):
            raise TypeError("peer_id must be bytes")
        for name in ("epoch", "samples_accumulated"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        _check_non_negative("samples_per_second", self.samples_per_second)
        if isinstance(self.time, bool) or not isinstance(self.time, (int, float)):
            raise TypeError("time must be a number")
        if not math.isfinite(self.time):
            raise ValueError("time must be finite")
        if not isinstance(self.client_mode, bool):
            raise TypeError("client_mode must be a bool")
        partners = self.partners
        if not isinstance(partners, tuple) or len(partners) > MAX_LISTED_PARTNERS:
            raise ValueError(f"partners must be a tuple of at most {MAX_LISTED_PARTNERS} peer ids")
        for peer_id in partners:
            if not isinstance(peer_id, bytes) or not 0 < len(peer_id) <= MAX_PEER_ID_BYTES:
                raise ValueError(f"partners must be peer ids (bytes), got {peer_id!r}")

    def to_dict(self) -> dict[str, object]:
        """The DHT value (floats stay floats, so strict schemas accept them)."""
        return {
            "peer_id": self.peer_id,
            "epoch": self.epoch,
            "samples_accumulated": self.samples_accumulated,
            "samples_per_second": float(self.samples_per_second),
            "time": float(self.time),
            "client_mode": self.client_mode,
            # only when there are partners: peers that predate the field read the rest
            **({"partners": list(self.partners)} if self.partners else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LocalProgress:
        """Inverse of :meth:`to_dict`; raises ``TypeError``/``ValueError``/``KeyError``."""
        return cls(
            peer_id=data["peer_id"],  # type: ignore[arg-type]
            epoch=data["epoch"],  # type: ignore[arg-type]
            samples_accumulated=data["samples_accumulated"],  # type: ignore[arg-type]
            samples_per_second=data["samples_per_second"],  # type: ignore[arg-type]
            time=data["time"],  # type: ignore[arg-type]
            client_mode=data["client_mode"],  # type: ignore[arg-type]
            partners=tuple(data.get("partners", ())),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm's progress toward its next epoch, as this peer sees it (a snapshot)."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int  #: active peers seen, this one included when it is active
    num_clients: int  #: of which in client mode
    eta_next_epoch: float  #: DHT time at which the swarm should reach the target
    next_fetch_time: float  #: DHT time of the next DHT fetch
    samples_per_second: float = 0.0  #: the swarm's reported speed in this epoch (0: unknown)
    #: no other peer is seen and this one reached the target: the epoch ends (alone) only after
    #: a DHT fetch that ended since then finds nobody either (one fetch per lone epoch)
    confirming_alone: bool = False


def describe_eta(progress: GlobalProgress, now: float) -> str:
    """``"1.50 s"`` until ``progress`` reaches its target, for logs; ``"unknown"`` while no peer
    has reported its speed (the ETA is then a huge placeholder, not an estimate)."""
    if progress.samples_accumulated < progress.target_batch_size and (
        progress.samples_per_second < MIN_KNOWN_RATE
    ):
        return "unknown (no speed reported yet)"
    return f"{max(0.0, progress.eta_next_epoch - now):.2f} s"


@dataclass(frozen=True)
class ClockSkewDetected:
    """A peer's records carry times ``offset`` seconds off our clock (positive: ahead)."""

    peer_id: bytes
    offset: float

    def __str__(self) -> str:
        side = "ahead of" if self.offset > 0 else "behind"
        return (
            f"peer {short_peer_id(self.peer_id)}'s clock seems {abs(self.offset):.1f} s {side} "
            "ours: progress and ETA estimates will be off (synchronize clocks with NTP)"
        )


@dataclass(frozen=True)
class LonePeer:
    """No other peer was seen for ``alone_for`` seconds."""

    epoch: int
    alone_for: float

    def __str__(self) -> str:
        return (
            f"no other peers found for {self.alone_for:.0f} s (epoch {self.epoch}); check "
            "initial_peers and the run id if you expected company"
        )


@dataclass(frozen=True)
class TargetNotReached:
    """Epoch ``epoch`` lasted ``waited`` s without reaching the target; its first ETA said
    ``expected`` s."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    waited: float
    expected: float

    def __str__(self) -> str:
        return (
            f"epoch {self.epoch} has accumulated {self.samples_accumulated} of "
            f"{self.target_batch_size} samples in {self.waited:.1f} s; the first estimate was "
            f"{self.expected:.1f} s (peers out of sync, or reporting progress to another run?)"
        )


@dataclass(frozen=True)
class ImplausibleProgress:
    """A peer's record claims more than the swarm vouches for: ``epoch`` more than one ahead of
    the swarm's ``swarm_epoch`` (the record is ignored), or ``samples`` far beyond the
    ``allowed`` its speed allows (they count only up to it)."""

    peer_id: bytes  #: the peer whose signed record it is
    key: bytes  #: the record's subkey (the same peer id)
    epoch: int
    samples: int
    swarm_epoch: int
    allowed: int | None = None  #: None: the epoch was implausible

    def __str__(self) -> str:
        who = f"peer {short_peer_id(self.peer_id)}"
        if self.allowed is None:
            return (
                f"ignoring the progress of {who}: it claims epoch {self.epoch} while the swarm "
                f"vouches for epoch {self.swarm_epoch} (a faulty or malicious peer?)"
            )
        return (
            f"counting at most {self.allowed} of the {self.samples} samples {who} claims for "
            f"epoch {self.epoch}: more than its speed allows (a faulty or malicious peer?)"
        )


ProgressWarning = Union[ClockSkewDetected, ImplausibleProgress, LonePeer, TargetNotReached]
