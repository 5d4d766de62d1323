"""Why an averaging step (or a state download) failed: one exception family for the caller."""

from __future__ import annotations

from swarmtrain.averaging.matchmaking_types import FailureReason

__all__ = ["AllReduceError", "AveragingError", "MatchmakingError", "NonFiniteError"]


class AveragingError(Exception):
    """Base class of the errors ``DecentralizedAverager.step`` raises."""


class MatchmakingError(AveragingError):
    """No group this round. ``reason`` says why (a :class:`FailureReason`: ``TOO_FEW_PEERS``,
    ``SCHEMA_MISMATCH``, ``DEADLINE``, ``CANCELLED``, or, by the end of the first matchmaking
    window, ``NO_LEADER`` for a client that found no peer to lead it and ``AUXILIARY_ONLY`` for
    an auxiliary peer that found no peer with tensors); ``detail`` is for people."""

    def __init__(self, reason: FailureReason, detail: str):
        super().__init__(f"matchmaking failed ({reason.value}): {detail}")
        self.reason = reason
        self.detail = detail


class AllReduceError(AveragingError):
    """A group formed, but no other member took part in the all-reduce (they left, were too
    slow, or rejected us): nothing was averaged. Partial failures do not raise."""


class NonFiniteError(AveragingError):
    """Our own tensors hold NaN or inf: we sent zeros with weight 0 instead, so that no peer's
    average gets them, and kept our own values (the step fails; it is not retried)."""
