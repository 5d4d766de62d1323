"""``SwarmHealth``: warnings for the ways collaborative training typically goes wrong.

A plain object, no I/O: the optimizer feeds it observations and gets back (and, by default,
logs) warnings, each saying what is wrong and what to do. A warning of one kind is given at
most once per ``repeat_interval`` seconds.

=========================  =================================================================
kind                       raised when
=========================  =================================================================
``model_mismatch``         averaging failed because every peer found averages other tensors
                           (``FailureReason.SCHEMA_MISMATCH``) ``max_schema_mismatches`` times
                           in a row
``state_download_failed``  ``max_state_download_failures`` state downloads failed in a row
=========================  =================================================================

The progress tracker reports the other failure modes itself (``swarmtrain.optim.progress_core``:
``TargetNotReached``, ``LonePeer``, ``ClockSkewDetected``). Times are seconds of one monotonic
clock (``clock``, default ``time.monotonic``; every method takes ``now`` to override it).

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
    max_schema_mismatches: int = 2  #: failed rounds in a row
    max_state_download_failures: int = 3  #: failed downloads in a row

    def __post_init__(self) -> None:
        _check_positive("repeat_interval", self.repeat_interval)
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
        # failures in a row
        self._schema_mismatches = 0
        self._download_failures = 0

    # ------------------------------------------------------------------ observations

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
