"""What a newcomer checks before it uses a donor's state, and the donors it stopped trusting.

A :class:`StateCheck` looks at the donor's decoded metadata as soon as the header arrives and
returns the :class:`TensorSpec` (shape and dtype) every state tensor must have; state sharing
then compares each tensor's wire header with its spec before allocating anything, and the
decoded tensor again (shape, dtype, NaN / inf). Nothing is cast: a float64 tensor where float32
is expected is rejected. A check raises :class:`StateRejected` with a :class:`RejectReason`; it
may return None to take any shapes and dtypes (:func:`any_tensors`; NaN / inf never pass).
:class:`TensorsLike` is the check of a state made of tensors like ours: a plain
``DecentralizedAverager`` whose donors serve their averaged tensors (the default
``get_current_state``) checks them against its own.

:class:`DonorBans` is the small per-process list of donors whose state was rejected: each is
skipped for ``BAN_DURATION`` seconds (default 10 minutes), then tried again. Pure: the caller
passes ``now``.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "BAN_DURATION",
    "DonorBans",
    "RejectReason",
    "StateCheck",
    "StateRejected",
    "TensorSpec",
    "TensorsLike",
    "any_tensors",
]

#: seconds a donor whose state was rejected is skipped by this process's downloads
BAN_DURATION = 600.0
#: most donors remembered at once (the ones that expire soonest are forgotten first)
MAX_BANNED = 1024


class RejectReason(enum.Enum):
    """Why a donor's state was not loaded."""

    METADATA = "malformed metadata"  #: not the structure or types this state has
    TENSOR_COUNT = "wrong number of tensors"
    SHAPE = "wrong tensor shape"
    DTYPE = "wrong tensor dtype"  #: never cast: the donor's state is not what it claims
    NON_FINITE = "NaN or inf values"
    EPOCH = "implausible epoch"  #: beyond what the swarm vouches for, or beyond the cap
    BEHIND = "behind us"  #: an honest but stale donor: not banned
    HYPERPARAMETERS = "hyperparameters differ from ours"


class StateRejected(ValueError):
    """A donor's state failed a check; ``ban``: whether the donor is banned for it."""

    def __init__(self, reason: RejectReason, detail: str, *, ban: bool | None = None):
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail = reason, detail
        self.ban = reason is not RejectReason.BEHIND if ban is None else ban


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype a state tensor must have."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def check(self, index: int, shape: Sequence[int], dtype: torch.dtype | str) -> None:
        """Raise :class:`StateRejected` unless ``shape`` and ``dtype`` are ours."""
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        expected = str(self.dtype).removeprefix("torch.")
        if name != expected:
            raise StateRejected(
                RejectReason.DTYPE, f"state tensor {index} is {name}, expected {expected}"
            )
        if tuple(int(d) for d in shape) != self.shape:
            raise StateRejected(
                RejectReason.SHAPE,
                f"state tensor {index} has shape {tuple(shape)[:8]}, expected {self.shape}",
            )


class StateCheck(Protocol):
    """Checks a donor's metadata; returns the spec of each state tensor, in order (None: any)."""

    def __call__(self, metadata: Any) -> Sequence[TensorSpec] | None: ...


@dataclass(frozen=True)
class TensorsLike:
    """A :class:`StateCheck`: the donor's tensors have exactly these shapes and dtypes (its
    metadata is not looked at). ``TensorsLike.of(tensors)``: like ``tensors``."""

    specs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> TensorsLike:
        return cls(tuple(TensorSpec.of(t) for t in tensors))

    def __call__(self, metadata: Any) -> Sequence[TensorSpec]:
        return self.specs


def any_tensors(metadata: Any) -> None:
    """A :class:`StateCheck` that takes any number, shapes and dtypes of tensors (finite ones)."""
    return None


class DonorBans:
    """Donors whose state was rejected, each until its ban expires (see the module docstring)."""

    def __init__(self, duration: float = BAN_DURATION, max_banned: int = MAX_BANNED):
        if not duration >= 0:
            raise ValueError(f"ban duration must be >= 0, got {duration}")
        self.duration, self.max_banned = float(duration), int(max_banned)
        self._until: dict[Hashable, tuple[float, str]] = {}

    def ban(self, donor: Hashable, reason: str, now: float) -> None:
        self._until[donor] = (now + self.duration, reason)
        if len(self._until) > self.max_banned:
            self.expire(now)
            while len(self._until) > self.max_banned:
                del self._until[min(self._until, key=lambda d: self._until[d][0])]

    def banned(self, donor: Hashable, now: float) -> str | None:
        """Why ``donor`` is banned (None: it is not, or no longer)."""
        entry = self._until.get(donor)
        if entry is None:
            return None
        if entry[0] <= now:
            del self._until[donor]
            return None
        return entry[1]

    def expire(self, now: float) -> None:
        self._until = {d: e for d, e in self._until.items() if e[0] > now}

    def __len__(self) -> int:
        return len(self._until)
