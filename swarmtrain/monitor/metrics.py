"""Training metrics that each peer publishes in the DHT: the record, its schema, the rate bound.

Each trainer stores one :class:`LocalMetrics` record under ``{run_id}_metrics`` with subkey =
its peer id (``PeerID.to_bytes()``), signed with its libp2p identity key
(:class:`~swarmtrain.dht.PeerRecordValidator`, key pattern
:data:`~swarmtrain.dht.owned_keys.METRICS_KEY_PATTERN`): a peer can write (or overwrite) only
the record under its own peer id. :class:`MetricsSchema` is the pydantic schema every publishing
node enforces (finite numbers, bounded strings and maps). A record's ``peer_id`` field must name
its subkey's peer: readers drop records that name another peer.

A record also carries the peer's recent failures and warnings (:class:`RecentFailure`: the
:class:`~swarmtrain.optim.SwarmHealth` kinds and the progress tracker's warnings, see
:data:`FAILURE_KINDS`): at most :data:`MAX_FAILURES`, each a ``kind`` made of lowercase letters,
digits and ``_`` (at most :data:`MAX_KIND_LENGTH`), a ``message`` of at most
:data:`MAX_FAILURE_MESSAGE` characters without control characters, and a finite ``time``. The
schema refuses anything larger; a message is plain text that readers must escape (the
dashboard renders it as a text node).

This module does no I/O: :class:`PublishSchedule` decides when the next record may go out
(at most one store per ``min_interval`` seconds, the latest report wins). The publisher is in
:mod:`swarmtrain.monitor.publisher`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

import pydantic

from swarmtrain.dht import MAX_PEER_ID_BYTES

__all__ = [
    "FAILURE_KINDS",
    "MAX_EXTRA_METRICS",
    "MAX_FAILURES",
    "MAX_FAILURE_MESSAGE",
    "REACHABILITIES",
    "ROLES",
    "LocalMetrics",
    "MetricsSchema",
    "PublishSchedule",
    "RecentFailure",
    "metrics_key",
    "parse_metrics",
]

ROLES = ("node", "client", "aux")  #: a full DHT node, a client-mode peer, an auxiliary peer
REACHABILITIES = ("public", "private", "relayed", "unknown")
MAX_EXTRA_METRICS = 16  #: named extra values (accuracy, grad norm, ...) per record
MAX_NAME_LENGTH = 64  #: characters of a peer id, a version, an extra metric's name
MAX_ABS_VALUE = 1e30  #: bound on every float (a loss of 1e300 is a bug, not a measurement)
MAX_FAILURES = 8  #: recent failures and warnings per record (the newest are kept)
MAX_FAILURE_MESSAGE = 256  #: characters of one failure's message
MAX_KIND_LENGTH = 32  #: characters of a failure's kind
KIND_PATTERN = r"^[a-z][a-z0-9_]*$"
_NO_CONTROL_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"  # no control characters (C0, DEL, C1)
#: the kinds swarmtrain reports: ``SwarmHealth``'s and the progress tracker's warnings (a
#: record may carry other kinds that match :data:`KIND_PATTERN`, from newer versions)
FAILURE_KINDS = (
    "model_mismatch",
    "state_download_failed",
    "clock_skew_detected",
    "lone_peer",
    "target_not_reached",
    "implausible_progress",
)


def metrics_key(run_id: str) -> str:
    """The DHT key holding a run's metrics: ``f"{run_id}_metrics"``."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("run_id must be a non-empty string")
    return f"{run_id}_metrics"


def _check_float(name: str, value: Any, *, non_negative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > MAX_ABS_VALUE:
        raise ValueError(f"{name} must be finite and at most {MAX_ABS_VALUE:g} in size: {value}")
    if non_negative and value < 0:
        raise ValueError(f"{name} must not be negative: {value}")
    return value


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < 2**63:
        raise ValueError(f"{name} must be in [0, 2**63): {value}")
    return value


def _check_name(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{name} must be at most {MAX_NAME_LENGTH} characters")
    return value


_KIND_RE = re.compile(KIND_PATTERN)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclasses.dataclass(frozen=True)
class RecentFailure:
    """One failure or warning a peer saw (validated on construction: ``ValueError`` /
    ``TypeError`` on a malformed kind, an oversized message or control characters in it)."""

    kind: str  #: e.g. ``"model_mismatch"`` (see :data:`FAILURE_KINDS`)
    message: str  #: plain text, at most :data:`MAX_FAILURE_MESSAGE` characters
    time: float  #: DHT time it was seen

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not isinstance(self.message, str):
            raise TypeError("a failure's kind and message must be strings")
        if len(self.kind) > MAX_KIND_LENGTH or not _KIND_RE.match(self.kind):
            raise ValueError(
                f"a failure's kind must match {KIND_PATTERN} (at most {MAX_KIND_LENGTH} "
                f"characters): {self.kind[: MAX_KIND_LENGTH + 1]!r}"
            )
        if len(self.message) > MAX_FAILURE_MESSAGE:
            raise ValueError(
                f"a failure's message must be at most {MAX_FAILURE_MESSAGE} characters"
            )
        if _CONTROL_RE.search(self.message):
            raise ValueError("a failure's message must not contain control characters")
        object.__setattr__(self, "time", _check_float("failure time", self.time))

    @classmethod
    def from_text(cls, kind: str, text: str, time: float) -> RecentFailure:
        """A failure with ``text`` made to fit: control characters become spaces, and a text
        longer than :data:`MAX_FAILURE_MESSAGE` is cut (ending with ``…``)."""
        message = _CONTROL_RE.sub(" ", str(text))
        if len(message) > MAX_FAILURE_MESSAGE:
            message = message[: MAX_FAILURE_MESSAGE - 1] + "…"
        return cls(kind, message, time)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "time": self.time}


@dataclasses.dataclass(frozen=True)
class LocalMetrics:
    """One peer's latest training metrics (validated on construction: ``ValueError`` /
    ``TypeError`` on a non-finite number, an unknown role, an oversized string or map)."""

    peer_id: str  #: base58 libp2p peer id, as claimed by the record's owner
    time: float  #: DHT time of publication
    role: str = "node"  #: one of :data:`ROLES`
    reachability: str = "unknown"  #: one of :data:`REACHABILITIES`
    version: str = ""  #: the publisher's swarmtrain version
    step: int = 0  #: local optimizer steps (or batches) so far
    epoch: int = 0
    loss: float | None = None
    samples_per_second: float = 0.0
    extra: Mapping[str, float] = dataclasses.field(default_factory=dict)
    failures: tuple[RecentFailure, ...] = ()  #: recent failures and warnings, oldest first

    def __post_init__(self) -> None:
        _check_name("peer_id", self.peer_id)
        _check_float("time", self.time)
        _check_name("version", self.version)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.reachability not in REACHABILITIES:
            raise ValueError(
                f"reachability must be one of {REACHABILITIES}, got {self.reachability!r}"
            )
        _check_int("step", self.step)
        _check_int("epoch", self.epoch)
        if self.loss is not None:
            object.__setattr__(self, "loss", _check_float("loss", self.loss))
        object.__setattr__(
            self,
            "samples_per_second",
            _check_float("samples_per_second", self.samples_per_second, non_negative=True),
        )
        object.__setattr__(self, "time", float(self.time))
        if not isinstance(self.extra, Mapping):
            raise TypeError("extra must be a mapping of names to numbers")
        if len(self.extra) > MAX_EXTRA_METRICS:
            raise ValueError(f"at most {MAX_EXTRA_METRICS} extra metrics")
        extra = {
            _check_name("extra metric name", k): _check_float(f"extra[{k!r}]", v)
            for k, v in self.extra.items()
        }
        object.__setattr__(self, "extra", extra)
        failures = tuple(
            item if isinstance(item, RecentFailure) else RecentFailure(**item)
            for item in self.failures
        )
        if len(failures) > MAX_FAILURES:
            raise ValueError(f"at most {MAX_FAILURES} recent failures")
        object.__setattr__(self, "failures", failures)

    def to_dict(self) -> dict[str, Any]:
        """The record's DHT value (a plain dict: msgpack has no dataclasses)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "extra": dict(self.extra),
            "failures": [failure.to_dict() for failure in self.failures],
        }


_Name = Annotated[str, pydantic.Field(max_length=MAX_NAME_LENGTH)]
_Float = Annotated[float, pydantic.Field(ge=-MAX_ABS_VALUE, le=MAX_ABS_VALUE, allow_inf_nan=False)]
_Count = Annotated[int, pydantic.Field(ge=0, lt=2**63)]
_PeerIdBytes = Annotated[bytes, pydantic.Field(min_length=1, max_length=MAX_PEER_ID_BYTES)]


class RecentFailureSchema(pydantic.BaseModel):
    """One :class:`RecentFailure` (strict; a kind of safe characters, a short plain message)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    kind: Annotated[str, pydantic.Field(max_length=MAX_KIND_LENGTH, pattern=KIND_PATTERN)]
    message: Annotated[
        str, pydantic.Field(max_length=MAX_FAILURE_MESSAGE, pattern=_NO_CONTROL_PATTERN)
    ]
    time: _Float


class LocalMetricsSchema(pydantic.BaseModel):
    """The DHT value of one :class:`LocalMetrics` (strict: no coercion, no extra fields)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    peer_id: _Name
    time: _Float
    role: Annotated[str, pydantic.Field(pattern="^(" + "|".join(ROLES) + ")$")]
    reachability: Annotated[str, pydantic.Field(pattern="^(" + "|".join(REACHABILITIES) + ")$")]
    version: _Name
    step: _Count
    epoch: _Count
    loss: _Float | None
    samples_per_second: Annotated[_Float, pydantic.Field(ge=0.0)]
    extra: Annotated[dict[_Name, _Float], pydantic.Field(max_length=MAX_EXTRA_METRICS)]
    #: absent in records of versions before it
    failures: Annotated[list[RecentFailureSchema], pydantic.Field(max_length=MAX_FAILURES)] = []


class MetricsSchema(pydantic.BaseModel):
    """``{run_id}_metrics``: ``{peer id: record}`` (``SchemaValidator(prefix=run_id)``; the
    subkeys are owned by :class:`~swarmtrain.dht.PeerRecordValidator`)."""

    metrics: dict[_PeerIdBytes, LocalMetricsSchema]


def parse_metrics(value: Any) -> LocalMetrics | None:
    """A DHT value as ``LocalMetrics``, or None if it does not match the schema."""
    try:
        checked = LocalMetricsSchema.model_validate(value, strict=True)
        fields = checked.model_dump()
        fields["failures"] = tuple(RecentFailure(**item) for item in fields["failures"])
        return LocalMetrics(**fields)
    except (pydantic.ValidationError, TypeError, ValueError):
        return None


class PublishSchedule:
    """When to store the next record: the latest offered one, at most once per ``min_interval``.

    Pure (the caller passes ``now``). ``offer`` replaces any record not yet taken, so a trainer
    that reports every step costs the DHT one store per ``min_interval``. A record is also
    re-stored every ``refresh_interval`` (before it expires) when nothing new was offered.
    """

    def __init__(self, min_interval: float, refresh_interval: float):
        if not (math.isfinite(min_interval) and min_interval > 0):
            raise ValueError("min_interval must be positive")
        if not (math.isfinite(refresh_interval) and refresh_interval >= min_interval):
            raise ValueError("refresh_interval must be at least min_interval")
        self.min_interval, self.refresh_interval = min_interval, refresh_interval
        self._pending: LocalMetrics | None = None
        self._last: LocalMetrics | None = None
        self._last_store_time = -math.inf

    @property
    def last_stored(self) -> LocalMetrics | None:
        return self._last

    def offer(self, metrics: LocalMetrics) -> None:
        self._pending = metrics

    def next_store_time(self) -> float:
        """When :meth:`take` will return a record (``inf``: nothing to store)."""
        if self._pending is not None:
            return self._last_store_time + self.min_interval
        if self._last is not None:
            return self._last_store_time + self.refresh_interval
        return math.inf

    def take(self, now: float) -> LocalMetrics | None:
        """The record to store now, stamped with ``now``, or None if none is due."""
        if now < self.next_store_time():
            return None
        record = self._pending if self._pending is not None else self._last
        if record is None:  # next_store_time() was inf
            return None
        record = dataclasses.replace(record, time=now)
        self._pending, self._last, self._last_store_time = None, record, now
        return record
