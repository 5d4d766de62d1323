"""Weighted reduction of one peer's slice over all senders (pure bookkeeping, no network)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from swarmtrain.averaging.partition import accumulator_dtype, as_numpy, scaled_sum
from swarmtrain.averaging.robust_aggregation import centered_clip, check_aggregation


class TensorPartReducer:
    """Weighted averaging of one peer's slice over all senders (pure bookkeeping).

    :param part_numels: number of values in each part of the slice
    :param part_dtypes: dtype of each part (sums are kept in float32, or float64 for float64)
    :param num_senders: number of senders; each contributes every part once, or is banned
    :param aggregation: ``"mean"`` (sums as parts arrive) or ``"centered_clip"`` (keeps every
      sender's copy of a part until it is complete, at most ``num_senders`` x part size, then
      aggregates with :func:`~swarmtrain.averaging.robust_aggregation.centered_clip`)
    :param clip_tau: CenteredClip's radius (None: adaptive, see ``centered_clip``)
    :param clip_iterations: CenteredClip's number of iterations

    A part is *complete* when every sender that is not banned contributed it. Its result is the
    weighted mean (or CenteredClip) of the contributions, or None when their total weight is
    zero (then every sender keeps its own values: no NaN). Contributions made before a sender
    was banned stay in.
    """

    def __init__(
        self,
        part_numels: Sequence[int],
        part_dtypes: Sequence[torch.dtype],
        num_senders: int,
        *,
        aggregation: str = "mean",
        clip_tau: float | None = None,
        clip_iterations: int = 5,
    ):
        if len(part_numels) != len(part_dtypes):
            raise ValueError("part_numels and part_dtypes have different lengths")
        if num_senders < 0:
            raise ValueError("num_senders must be non-negative")
        check_aggregation(aggregation, clip_tau, clip_iterations)
        self.aggregation = aggregation
        self.clip_tau = clip_tau
        self.clip_iterations = clip_iterations
        # centered_clip: per part, each sender's contribution (a copy) and weight
        self._kept: list[dict[int, tuple[torch.Tensor, float]]] = [
            {} for _ in range(len(part_numels))
        ]
        self.part_numels = tuple(int(n) for n in part_numels)
        self.part_dtypes = tuple(part_dtypes)
        self.num_parts = len(self.part_numels)
        self.num_senders = num_senders
        self._sums: list[torch.Tensor | None] = [None] * self.num_parts
        self._weights = [0.0] * self.num_parts
        self._contributed: list[set[int]] = [set() for _ in range(self.num_parts)]
        self._results: dict[int, torch.Tensor | None] = {}
        self._banned: set[int] = set()

    @property
    def banned(self) -> frozenset[int]:
        return frozenset(self._banned)

    def is_banned(self, sender: int) -> bool:
        return sender in self._banned

    def is_complete(self, part_index: int) -> bool:
        return part_index in self._results

    @property
    def num_complete(self) -> int:
        return len(self._results)

    @property
    def finished(self) -> bool:
        return len(self._results) == self.num_parts

    def accumulate(
        self, sender: int, part_index: int, tensor: torch.Tensor, weight: float
    ) -> tuple[int, ...]:
        """Add one sender's part; return the parts this completed (this one, or none).

        :raises ValueError: unknown sender or part, a banned sender, a repeated part, a tensor
          of the wrong size, or a weight that is negative or not finite
        """
        self._check_sender(sender)
        if sender in self._banned:
            raise ValueError(f"sender {sender} is banned")
        if not 0 <= part_index < self.num_parts:
            raise ValueError(f"no part {part_index} (the slice has {self.num_parts})")
        if sender in self._contributed[part_index]:
            raise ValueError(f"sender {sender} already contributed part {part_index}")
        if tensor.numel() != self.part_numels[part_index]:
            raise ValueError(
                f"part {part_index} has {self.part_numels[part_index]} values, got {tensor.numel()}"
            )
        weight = float(weight)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and non-negative, got {weight}")
        if self.is_complete(part_index):  # every active sender already contributed it
            raise ValueError(f"part {part_index} is already complete")
        dtype = accumulator_dtype(self.part_dtypes[part_index])
        if self.aggregation == "mean":
            self._sums[part_index] = scaled_sum(self._sums[part_index], tensor, weight, dtype)
        else:  # a copy: the caller may reuse the tensor's buffer once this returns
            kept = tensor.detach().reshape(-1).to(dtype, copy=True)
            self._kept[part_index][sender] = kept, weight
        self._weights[part_index] += weight
        self._contributed[part_index].add(sender)
        return self._complete_ready((part_index,))

    def ban(self, sender: int) -> tuple[int, ...]:
        """Stop waiting for ``sender``; return the parts that became complete."""
        self._check_sender(sender)
        if sender in self._banned:
            return ()
        self._banned.add(sender)
        return self._complete_ready(range(self.num_parts))

    def result(self, part_index: int) -> torch.Tensor | None:
        """The weighted mean of a complete part (float32/float64), or None for zero weight."""
        if part_index not in self._results:
            raise ValueError(f"part {part_index} is not complete")
        return self._results[part_index]

    def _complete_ready(self, candidates) -> tuple[int, ...]:
        active = set(range(self.num_senders)) - self._banned
        completed = []
        for k in candidates:
            if k in self._results or not active <= self._contributed[k]:
                continue
            if self.aggregation == "mean":
                total, weight = self._sums[k], self._weights[k]
                self._results[k] = (
                    _divide(total, weight) if total is not None and weight > 0 else None
                )
                self._sums[k] = None
            else:
                self._results[k] = self._clipped(k)
            completed.append(k)
        return tuple(completed)

    def _clipped(self, part_index: int) -> torch.Tensor | None:
        kept, self._kept[part_index] = self._kept[part_index], {}
        if not self._weights[part_index] > 0:
            return None
        rows = [t for t, _ in kept.values()]
        weights = torch.tensor([w for _, w in kept.values()], dtype=torch.float64)
        return centered_clip(torch.stack(rows), weights, self.clip_tau, self.clip_iterations)

    def _check_sender(self, sender: int) -> None:
        if not 0 <= sender < self.num_senders:
            raise ValueError(f"no sender {sender} (there are {self.num_senders})")


def _divide(total: torch.Tensor, weight: float) -> torch.Tensor:
    total_np = as_numpy(total)
    if total_np is None:
        return total.div_(weight)
    np.divide(total_np, weight, out=total_np)
    return total
