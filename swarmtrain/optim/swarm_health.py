"""``SwarmHealth``: warnings for the ways collaborative training typically goes wrong.

A plain object, no I/O: the optimizer feeds it observations and gets back (and, by default,
logs) warnings, each saying what is wrong and what to do. A warning of one kind is given at
most once per ``repeat_interval`` seconds.

=========================  =================================================================
kind                       raised when
=========================  =================================================================
``target_not_reached``     the swarm's epoch has not advanced for ``stall_factor`` times the
                           expected epoch time (its ETA when the epoch began; at least
                           ``min_stall_time``), or its sample count has not grown for
                           ``stuck_time`` below the target
``lone_peer``              no other peer was seen for ``lone_peer_timeout`` seconds
``clock_skew``             a peer's clock is more than ``max_clock_skew`` off ours
``model_mismatch``         averaging failed because every peer found averages other tensors
                           (``FailureReason.SCHEMA_MISMATCH``) ``max_schema_mismatches`` times
                           in a row
``state_download_failed``  ``max_state_download_failures`` state downloads failed in a row
=========================  =================================================================

Times are seconds of one monotonic clock (``clock``, default ``time.monotonic``; every method
takes ``now`` to override it), except peer times for clock skew, which are DHT times
(wall-clock seconds, like ``get_dht_time()`` and the ``time`` of progress records).

:func:`model_fingerprint` summarizes a model's parameters (shapes and dtypes, what averaging
compares) so that logs of two peers show at a glance whether they train the same model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarmtrain.averaging import FailureReason, MatchmakingError

__all__ = [
    "HealthConfig",
    "HealthWarning",
    "SwarmHealth",
    "describe_parameters",
    "model_fingerprint",
]

logger = logging.getLogger(__name__)

TARGET_NOT_REACHED = "target_not_reached"
LONE_PEER = "lone_peer"
CLOCK_SKEW = "clock_skew"
MODEL_MISMATCH = "model_mismatch"
STATE_DOWNLOAD_FAILED = "state_download_failed"


def _tensors(parameters: Any) -> list[torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        return list(parameters.parameters())
    tensors = []
    for i, item in enumerate(parameters):
        if isinstance(item, tuple) and len(item) == 2:  # named_parameters()
            item = item[1]
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"parameters[{i}] is a {type(item).__name__}, not a tensor")
        tensors.append(item)
    return tensors


def model_fingerprint(parameters: Any) -> str:
    """A short hex digest of the parameters' shapes and dtypes, in order (a module, tensors or
    ``named_parameters()``). Equal models give equal fingerprints on every peer."""
    digest = hashlib.sha256(b"swarmtrain/model-fingerprint/v1")
    for tensor in _tensors(parameters):
        digest.update(repr((tuple(tensor.shape), str(tensor.dtype))).encode())
    return digest.hexdigest()[:12]


def describe_parameters(parameters: Any) -> str:
    """``"<n> tensors, <m> values, fingerprint <hex>"``, for logs and error messages."""
    tensors = _tensors(parameters)
    values = sum(t.numel() for t in tensors)
    return f"{len(tensors)} tensors, {values} values, fingerprint {model_fingerprint(tensors)}"


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of :class:`SwarmHealth` (seconds unless said otherwise)."""

    repeat_interval: float = 600.0
    stall_factor: float = 3.0
    min_stall_time: float = 60.0
    stuck_time: float = 120.0
    lone_peer_timeout: float = 60.0
    max_clock_skew: float = 10.0
    max_schema_mismatches: int = 2  #: failed rounds in a row
    max_state_download_failures: int = 3  #: failed downloads in a row

    def __post_init__(self) -> None:
        for name in (
            "repeat_interval",
            "stall_factor",
            "min_stall_time",
            "stuck_time",
            "lone_peer_timeout",
            "max_clock_skew",
        ):
            _check_positive(name, getattr(self, name))
        for name in ("max_schema_mismatches", "max_state_download_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class HealthWarning:
    """One warning: ``kind`` (see the module docstring) and a message saying what to do."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


class SwarmHealth:
    """Turns observations into warnings (see the module docstring).

    :param run_id: named in the messages
    :param parameters: this peer's model (for the fingerprint in mismatch messages), optional
    :param clock: the monotonic clock used when a method gets no ``now``
    :param log: log each warning given (``logger.warning``)
    """

    def __init__(
        self,
        run_id: str,
        config: HealthConfig | None = None,
        *,
        parameters: Any = None,
        clock: Callable[[], float] = time.monotonic,
        log: bool = True,
    ):
        self.run_id = run_id
        self.config = config or HealthConfig()
        self.model = describe_parameters(parameters) if parameters is not None else None
        self.clock = clock
        self.log = log
        self._last_given: dict[str, float] = {}
        self.given: list[HealthWarning] = []  #: every warning given so far
        # progress
        self._epoch: int | None = None
        self._epoch_since = 0.0
        self._expected: float | None = None
        self._samples = -1
        self._samples_since = 0.0
        self._alone_since: float | None = None
        # failures in a row
        self._schema_mismatches = 0
        self._download_failures = 0

    # ------------------------------------------------------------------ observations

    def observe_progress(
        self,
        *,
        global_epoch: int,
        samples_accumulated: int,
        target_batch_size: int,
        num_peers: int,
        eta: float | None = None,
        now: float | None = None,
    ) -> list[HealthWarning]:
        """The swarm's progress as the tracker sees it: its epoch, the samples accumulated
        toward ``target_batch_size``, the peers seen (this one included) and the seconds until
        the expected end of the epoch (``eta``; None or inf if unknown)."""
        now = self._now(now)
        found: list[HealthWarning] = []
        if global_epoch != self._epoch:
            self._epoch, self._epoch_since, self._expected = global_epoch, now, None
            self._samples, self._samples_since = samples_accumulated, now
        if self._expected is None and eta is not None and math.isfinite(eta) and eta >= 0:
            self._expected = now - self._epoch_since + eta
        if samples_accumulated != self._samples:
            self._samples, self._samples_since = samples_accumulated, now
        waited = now - self._epoch_since
        stalled = self._expected is not None and waited >= max(
            self.config.stall_factor * self._expected, self.config.min_stall_time
        )
        stuck = (
            samples_accumulated < target_batch_size
            and now - self._samples_since >= self.config.stuck_time
        )
        if stalled or stuck:
            expected = f"; it was expected to take {self._expected:.0f} s" if self._expected else ""
            found += self._give(
                TARGET_NOT_REACHED,
                f"{self.run_id}: epoch {global_epoch} has accumulated {samples_accumulated} of "
                f"target_batch_size={target_batch_size} samples in {waited:.0f} s{expected} "
                f"(samples unchanged for {now - self._samples_since:.0f} s). Check that all "
                "peers use the same run_id and target_batch_size and are still training, and "
                "that target_batch_size suits the swarm's speed (lower it for a small swarm)",
                now,
            )
        if num_peers > 1:
            self._alone_since = None
        elif self._alone_since is None:
            self._alone_since = now
        elif now - self._alone_since >= self.config.lone_peer_timeout:
            found += self._give(
                LONE_PEER,
                f"{self.run_id}: no other peer seen for {now - self._alone_since:.0f} s: this "
                "peer trains alone. Check initial_peers (the addresses a running peer prints), "
                "that the run_id is the same on every peer, and that peers can reach each other "
                "(firewalls; peers behind NAT need client_mode=True and a reachable peer)",
                now,
            )
        return found

    def observe_peer_time(
        self,
        peer: object,
        peer_time: float,
        dht_now: float,
        *,
        max_age: float = math.inf,
        now: float | None = None,
    ) -> list[HealthWarning]:
        """A time a peer reported (DHT time), received at our DHT time ``dht_now``; it left the
        peer at most ``max_age`` seconds ago (a gossiped record: the gossip period; a DHT
        record: inf, so only a time in our future shows a skew)."""
        offset = peer_time - dht_now
        if offset < 0:
            offset = min(0.0, offset + max_age)
        if abs(offset) <= self.config.max_clock_skew:
            return []
        side = "ahead of" if offset > 0 else "behind"
        return self._give(
            CLOCK_SKEW,
            f"{self.run_id}: peer {peer}'s clock is {abs(offset):.1f} s {side} ours (more than "
            f"max_clock_skew={self.config.max_clock_skew} s): epoch estimates and averaging "
            "schedules will be off. Synchronize the clocks of all peers with NTP (e.g. "
            "`timedatectl set-ntp true` or chrony)",
            self._now(now),
        )

    def observe_averaging_failure(
        self, error: BaseException, now: float | None = None
    ) -> list[HealthWarning]:
        """An averaging round (gradients or state) failed with ``error``."""
        if not (
            isinstance(error, MatchmakingError) and error.reason == FailureReason.SCHEMA_MISMATCH
        ):
            return []
        self._schema_mismatches += 1
        if self._schema_mismatches < self.config.max_schema_mismatches:
            return []
        ours = f" (this peer: {self.model})" if self.model else ""
        return self._give(
            MODEL_MISMATCH,
            f"{self.run_id}: {self._schema_mismatches} averaging rounds in a row found only "
            f"peers that average different tensors ({error.detail}). Every peer of a run must "
            f"build the same model with the same parameter shapes and dtypes{ours}, and use "
            "the same averaging options (average_opt_statistics, extra_tensors, PowerSGD "
            "rank, part_size_bytes). Compare the fingerprints in the peers' logs, or give "
            "this model another run_id",
            self._now(now),
        )

    def observe_averaging_success(self) -> None:
        """An averaging round found a group (resets the mismatch count)."""
        self._schema_mismatches = 0

    def observe_state_download(
        self, ok: bool, detail: str = "", now: float | None = None
    ) -> list[HealthWarning]:
        """A state download from peers succeeded (``ok``) or failed (``detail``: why)."""
        if ok:
            self._download_failures = 0
            return []
        self._download_failures += 1
        if self._download_failures < self.config.max_state_download_failures:
            return []
        why = f" (last: {detail})" if detail else ""
        return self._give(
            STATE_DOWNLOAD_FAILED,
            f"{self.run_id}: {self._download_failures} state downloads from peers failed in "
            f"a row{why}, so this peer trains from stale parameters. Check that some peer "
            "serves state (not every peer in client_mode or auxiliary), that peers can reach "
            "it, and raise load_state_timeout for a large model or a slow link",
            self._now(now),
        )

    # ------------------------------------------------------------------ internals

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def _give(self, kind: str, message: str, now: float) -> list[HealthWarning]:
        last = self._last_given.get(kind)
        if last is not None and now - last < self.config.repeat_interval:
            return []
        self._last_given[kind] = now
        warning = HealthWarning(kind, message)
        self.given.append(warning)
        if self.log:
            logger.warning("%s", warning)
        return [warning]
