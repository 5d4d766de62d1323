"""What a donor's optimizer and scheduler state must look like for a newcomer to load it.

The donor's state must have exactly the structure of ours: the same keys, the same types (an
int is not a float), the same tensors (shape and dtype; references to tensors, each used once).
Hyperparameters (the optimizer's ``param_groups``) must equal ours, except the ones schedulers
change, which must stay within :data:`HYPERPARAMETER_BOUNDS`' bounds:

- ``lr``: in ``[0, LR_TOLERANCE x`` our initial lr``]``, where our initial lr is the largest of
  the group's ``lr``, ``initial_lr`` and ``max_lr`` when this peer built its optimizer;
- ``momentum`` and each of ``betas``: in ``[0, 1]``.

An optimizer that creates its state lazily (DiLoCo's outer optimizer: momentum buffers appear at
its first step) may meet a donor that holds entries we do not have yet: with ``stepped`` (see
:func:`stepped_state`), each such entry must look like the one a step creates for that
parameter (same keys, tensors of its shape and dtype); entries we hold must look like ours.

The scheduler's progress counters (``last_epoch``, ``_step_count``) must not run ahead of the
donor's epoch by more than two steps, its ``_last_lr`` obeys the lr bound, and every other field
(``base_lrs``, ``gamma``, ...) must equal ours. Epochs are capped by :func:`check_epoch`.
Pure functions: they raise ``StateRejected`` and never touch the optimizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch

from swarmtrain.averaging.state_checks import RejectReason, StateRejected, TensorSpec
from swarmtrain.optim._optimizer_state import TENSOR_KEY, encode_tensors

__all__ = [
    "EPOCH_LIMIT",
    "EPOCH_MARGIN",
    "LR_TOLERANCE",
    "check_epoch",
    "check_scheduler_state",
    "initial_lrs",
    "optimizer_state_specs",
    "stepped_state",
]

#: no donor's epoch (or DiLoCo step) is taken beyond this, vouched for or not
EPOCH_LIMIT = 2**31 - 1
#: a donor may be this many epochs ahead of the epoch the swarm's progress vouches for
EPOCH_MARGIN = 2
#: a donor's lr may be up to this many times our initial lr
LR_TOLERANCE = 10.0
_UNIT = (0.0, 1.0)
_ANY = (-math.inf, math.inf)
#: scheduler fields that differ between honest peers (progress, not configuration)
_SCHEDULER_PROGRESS = {"best", "num_bad_epochs", "cooldown_counter", "_is_initial"}
_SCHEDULER_FLAGS = {"_get_lr_called_within_step"}


def initial_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """Per param group, the largest of ``lr``, ``initial_lr``, ``max_lr`` (0 if none)."""
    result = []
    for group in optimizer.param_groups:
        values = [group.get(key) for key in ("lr", "initial_lr", "max_lr")]
        numbers = [float(v) for v in values if _is_number(v) and math.isfinite(v)]
        result.append(max(numbers, default=0.0))
    return result


def check_epoch(epoch: Any, local_epoch: int, vouched: int | None, what: str = "epoch") -> int:
    """``epoch`` if it is an int in ``[local_epoch, vouched + EPOCH_MARGIN]`` (``vouched``: the
    swarm's epoch; None: not known, then only :data:`EPOCH_LIMIT` bounds it)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise StateRejected(RejectReason.METADATA, f"{what} {epoch!r:.40} is not an integer")
    if epoch < local_epoch:
        raise StateRejected(RejectReason.BEHIND, f"{what} {epoch} < ours ({local_epoch})")
    limit = EPOCH_LIMIT if vouched is None else min(EPOCH_LIMIT, vouched + EPOCH_MARGIN)
    if epoch > limit:
        source = "the cap" if vouched is None else f"the swarm's {vouched} + {EPOCH_MARGIN}"
        raise StateRejected(RejectReason.EPOCH, f"{what} {epoch} is beyond {source}")
    return epoch


def stepped_state(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> tuple[Any, list[TensorSpec]] | None:
    """The encoded state dict (and its tensors' specs) of an optimizer that ``factory`` builds
    over tensors like ``params``, after one step on zero gradients: what a donor's lazily
    created state must look like. Made on meta tensors (no memory), else on zero CPU tensors
    (a copy of ``params``, once); None if the optimizer cannot step on either."""
    for device in ("meta", "cpu"):
        scratch = [
            torch.zeros(p.shape, dtype=p.dtype, device=device).requires_grad_() for p in params
        ]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimizer = factory(scratch)
                for p in scratch:
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                tensors: list[torch.Tensor] = []
                encoded = encode_tensors(optimizer.state_dict(), tensors, copy=False)
        except Exception:  # e.g. .item() on a meta tensor: try real ones
            continue
        return encoded, [TensorSpec.of(t) for t in tensors]
    return None


def optimizer_state_specs(
    local: Any,
    local_specs: Sequence[TensorSpec],
    donor: Any,
    lr_limits: Sequence[float],
    *,
    first: int = 0,
    stepped: tuple[Any, Sequence[TensorSpec]] | None = None,
) -> list[TensorSpec]:
    """The spec of each of the donor's optimizer tensors (in the donor's order), after checking
    its encoded state dict ``donor`` against ours (``local``, whose references point into
    ``local_specs``); see the module docstring.

    :param lr_limits: the largest lr accepted, per param group
    :param first: the donor's references are ``first, first + 1, ...`` (its tensors before
      them are not the optimizer's)
    :param stepped: for a lazily created state, :func:`stepped_state`: the donor may hold
      per-parameter entries we do not have, shaped like those (None: exactly our entries)
    """
    if not isinstance(donor, dict) or set(donor) != set(local):
        raise StateRejected(RejectReason.METADATA, "the optimizer state has other fields")
    refs: dict[int, TensorSpec] = {}
    for key in local:  # "state": statistics and counters (numbers may differ, types not)
        if key == "state" and stepped is not None:
            _match_lazy_state(local[key], donor[key], local_specs, stepped, refs)
        elif key != "param_groups":
            _match(local[key], donor[key], f"optimizer {key}", local_specs, refs, _ANY)
    groups, theirs = local["param_groups"], donor["param_groups"]
    if not isinstance(theirs, list) or len(theirs) != len(groups):
        raise StateRejected(RejectReason.HYPERPARAMETERS, "another number of param groups")
    for index, (mine, other) in enumerate(zip(groups, theirs, strict=True)):
        if not isinstance(other, dict) or set(other) != set(mine):
            extra = sorted(map(str, set(other) - set(mine))) if isinstance(other, dict) else []
            raise StateRejected(
                RejectReason.HYPERPARAMETERS,
                f"param group {index} has other keys" + (f" (new: {extra[:5]})" if extra else ""),
            )
        for key in mine:
            bounds = _bounds(key, lr_limits[index])
            path = f"param group {index} {key!r}"
            hyper = RejectReason.HYPERPARAMETERS
            _match(mine[key], other[key], path, local_specs, refs, bounds, hyper)
    if set(refs) != set(range(first, first + len(refs))):
        raise StateRejected(RejectReason.METADATA, "optimizer tensor references have gaps")
    return [refs[i] for i in range(first, first + len(refs))]


def _match_lazy_state(
    mine: Any,
    other: Any,
    local_specs: Sequence[TensorSpec],
    stepped: tuple[Any, Sequence[TensorSpec]],
    refs: dict[int, TensorSpec],
) -> None:
    """The donor's per-parameter entries: like ours where we have one, else like a step's."""
    template, template_specs = stepped
    created = template.get("state") if isinstance(template, dict) else None
    if not isinstance(mine, dict) or not isinstance(other, dict):
        raise StateRejected(RejectReason.METADATA, "the optimizer state is not a dict")
    for index, entry in other.items():
        path = f"optimizer state of parameter {index!r:.20}"
        if isinstance(index, bool) or not isinstance(index, int):
            raise StateRejected(RejectReason.METADATA, f"{path}: not a parameter index")
        if index in mine:
            _match(mine[index], entry, path, local_specs, refs, _ANY)
        elif isinstance(created, dict) and index in created:
            _match(created[index], entry, path, template_specs, refs, _ANY)
        else:
            raise StateRejected(
                RejectReason.METADATA, f"{path}: our optimizer keeps no state for it"
            )


def check_scheduler_state(local: Any, donor: Any, epoch: int, lr_limit: float) -> None:
    """A donor's scheduler state (None: it sends none, we keep ours) against ours."""
    if donor is None:
        return
    if not isinstance(local, dict) or not isinstance(donor, dict) or set(donor) != set(local):
        raise StateRejected(RejectReason.METADATA, "the scheduler state has other fields")
    for key, mine in local.items():
        other, path = donor[key], f"scheduler {key!r}"
        if key in ("last_epoch", "_step_count"):
            counter = not isinstance(other, bool) and isinstance(other, int)
            if not counter or not -1 <= other <= epoch + 2:
                raise StateRejected(RejectReason.EPOCH, f"{path} = {other!r:.40} at epoch {epoch}")
        elif key == "_last_lr":
            _match(mine, other, path, (), {}, (0.0, lr_limit))
        elif key in _SCHEDULER_PROGRESS or key in _SCHEDULER_FLAGS:
            _match(mine, other, path, (), {}, _ANY)
        else:
            _match(mine, other, path, (), {}, None, RejectReason.HYPERPARAMETERS)


def _bounds(key: Any, lr_limit: float) -> tuple[float, float] | None:
    if key == "lr":
        return (0.0, lr_limit)
    if key in ("momentum", "betas"):
        return _UNIT
    return None


def _match(
    mine: Any,
    other: Any,
    path: str,
    local_specs: Sequence[TensorSpec],
    refs: dict[int, TensorSpec],
    bounds: tuple[float, float] | None,
    reason: RejectReason = RejectReason.METADATA,
) -> None:
    """Check ``other`` against ``mine`` (see the module docstring); ``bounds``: numbers may
    differ from ours within them (None: they must be equal; ``(-inf, inf)``: any number of the
    same type); collect tensor references into ``refs``; ``reason``: of a mismatch."""
    if isinstance(mine, dict) and set(mine) == {TENSOR_KEY}:
        index = other.get(TENSOR_KEY) if isinstance(other, dict) and len(other) == 1 else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 24:
            raise StateRejected(RejectReason.METADATA, f"{path}: not a tensor reference")
        if index in refs:
            raise StateRejected(RejectReason.METADATA, f"{path}: tensor {index} used twice")
        refs[index] = local_specs[mine[TENSOR_KEY]]
        return
    if type(other) is not type(mine):
        raise StateRejected(
            reason, f"{path} is a {type(other).__name__}, ours a {type(mine).__name__}"
        )
    if isinstance(mine, dict):
        if set(other) != set(mine):
            raise StateRejected(reason, f"{path} has other fields")
        for key in mine:
            _match(mine[key], other[key], f"{path}.{key}", local_specs, refs, bounds, reason)
    elif isinstance(mine, list):
        if len(other) != len(mine):
            raise StateRejected(reason, f"{path} has {len(other)} items")
        for i, (a, b) in enumerate(zip(mine, other, strict=True)):
            _match(a, b, f"{path}[{i}]", local_specs, refs, bounds, reason)
    elif bounds is not None and _is_number(mine):
        low, high = bounds
        if math.isinf(low) and math.isinf(high):
            return
        if not (math.isfinite(other) and low <= other <= high):
            raise StateRejected(
                RejectReason.HYPERPARAMETERS, f"{path} = {other!r} is outside [{low}, {high}]"
            )
    elif other != mine and not (_is_number(mine) and math.isnan(mine) and math.isnan(other)):
        raise StateRejected(
            RejectReason.HYPERPARAMETERS, f"{path} = {other!r:.60}, ours is {mine!r:.60}"
        )


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
