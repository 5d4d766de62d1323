"""A peer's recent failures and warnings, for its metrics record (no I/O, no clock).

:class:`RecentFailures` keeps the newest :data:`~swarmtrain.monitor.metrics.MAX_FAILURES`.
:func:`failure_from_log_record` recognises the warnings that swarmtrain's training components
log (:class:`~swarmtrain.optim.SwarmHealth`'s ``HealthWarning`` and the progress tracker's
``ClockSkewDetected``, ``LonePeer``, ``TargetNotReached``, ``ImplausibleProgress``) for one run,
without importing them (the monitor stays torch-free): :class:`FailureLogHandler` feeds them to a
publisher (``AsyncMetricsPublisher.create(..., capture_warnings=True)``, the default).

The handler sits on the ``swarmtrain.optim`` logger, so it sees the warnings of every component
of its run in this process: run one peer per process (the usual case) for per-peer lists.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable

from .metrics import MAX_FAILURES, RecentFailure

__all__ = ["FailureLogHandler", "RecentFailures", "failure_from_log_record"]

#: the progress tracker's warning classes and their kinds
_PROGRESS_WARNING_KINDS = {
    "ClockSkewDetected": "clock_skew_detected",
    "LonePeer": "lone_peer",
    "TargetNotReached": "target_not_reached",
    "ImplausibleProgress": "implausible_progress",
}
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
#: the loggers whose warnings are captured (children of it included)
CAPTURED_LOGGER = "swarmtrain.optim"


class RecentFailures:
    """The newest ``limit`` failures, oldest first; adding one more drops the oldest."""

    def __init__(self, limit: int = MAX_FAILURES):
        if not 1 <= limit <= MAX_FAILURES:
            raise ValueError(f"limit must be in [1, {MAX_FAILURES}]")
        self._items: deque[RecentFailure] = deque(maxlen=limit)

    def add(self, kind: str, text: str, time: float) -> RecentFailure:
        """Record a failure (``text`` cut to fit, control characters replaced); raises
        ``ValueError`` on a malformed ``kind``."""
        failure = RecentFailure.from_text(kind, text, time)
        self._items.append(failure)
        return failure

    def items(self) -> tuple[RecentFailure, ...]:
        return tuple(self._items)


def failure_from_log_record(record: logging.LogRecord, run_id: str) -> tuple[str, str] | None:
    """(kind, message) of a logged swarmtrain warning about ``run_id``, or None for any other
    record. Both components log ``"<run_id>: <warning>"``: the run id prefix is dropped."""
    if record.levelno < logging.WARNING or not isinstance(record.args, tuple):
        return None
    kind = None
    for arg in record.args:
        arg_kind = getattr(arg, "kind", None)
        module = type(arg).__module__
        if not module.startswith("swarmtrain.optim"):
            continue
        if type(arg).__name__ == "HealthWarning" and isinstance(arg_kind, str):
            kind = arg_kind
        elif type(arg).__name__ in _PROGRESS_WARNING_KINDS:
            kind = _PROGRESS_WARNING_KINDS[type(arg).__name__]
    if kind is None or not _KIND_RE.match(kind):
        return None
    try:
        text = record.getMessage()
    except (TypeError, ValueError):
        return None
    prefix = f"{run_id}: "
    if not text.startswith(prefix):
        return None  # another run's warning
    return kind, text[len(prefix) :]


class FailureLogHandler(logging.Handler):
    """Calls ``on_failure(kind, message)`` for each warning about ``run_id`` logged under
    :data:`CAPTURED_LOGGER`. ``install()`` adds it there, ``uninstall()`` removes it."""

    def __init__(self, run_id: str, on_failure: Callable[[str, str], None]):
        super().__init__(logging.WARNING)
        self.run_id, self.on_failure = run_id, on_failure

    def emit(self, record: logging.LogRecord) -> None:
        found = failure_from_log_record(record, self.run_id)
        if found is not None:
            try:
                self.on_failure(*found)
            except Exception:
                self.handleError(record)

    def install(self) -> None:
        logging.getLogger(CAPTURED_LOGGER).addHandler(self)

    def uninstall(self) -> None:
        logging.getLogger(CAPTURED_LOGGER).removeHandler(self)
