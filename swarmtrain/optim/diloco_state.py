"""What DiLoCo peers hand to a joiner, and the argument checks of ``DiLoCoOptimizer``.

:func:`pack_state` turns an :class:`~swarmtrain.optim.diloco_core.OuterState` and the inner
step count into the ``(metadata, tensors)`` pair that the averager's state sharing sends;
:func:`unpack_state` checks and inverts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from swarmtrain.optim._optimizer_state import decode_tensors, encode_tensors
from swarmtrain.optim.diloco_core import OuterState

__all__ = ["STATE_FORMAT", "pack_state", "unpack_state"]

#: version tag of the state that peers download from each other
STATE_FORMAT = "swarmtrain.diloco/1"


def pack_state(
    outer: OuterState, inner_step: int, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``(metadata, tensors)`` that carry ``outer`` (parameters, optimizer state, step) and the
    inner step count; the metadata holds the optimizer state's structure, with each tensor
    replaced by a reference (``_optimizer_state.encode_tensors``)."""
    state = outer.state_dict()  # already copies: no second copy here
    tensors: list[torch.Tensor] = list(state["params"])
    optimizer = encode_tensors(state["optimizer"], tensors, copy=False)
    metadata = {
        "format": STATE_FORMAT,
        "num_params": len(state["params"]),
        "outer_step": state["outer_step"],
        "inner_step": inner_step,
        "optimizer": optimizer,
        **(extra or {}),
    }
    return metadata, tensors


def unpack_state(metadata: Any, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int]:
    """The inverse of :func:`pack_state`: ``(OuterState state dict, inner step)``.

    :raises ValueError: not a state of this format, or references to missing tensors
    """
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} state: {str(metadata)[:200]}")
    num_params, inner_step = metadata.get("num_params"), metadata.get("inner_step")
    for name, value in (("num_params", num_params), ("inner_step", inner_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if num_params > len(tensors):
        raise ValueError(f"state announces {num_params} parameters, carries {len(tensors)} tensors")

    state = {
        "params": list(tensors[:num_params]),
        "optimizer": decode_tensors(metadata.get("optimizer"), tensors, first=num_params),
        "outer_step": metadata.get("outer_step"),
    }
    return state, inner_step


def check_positive(name: str, value: object, *, allow_none: bool = False) -> None:
    """A finite number > 0 (or None if allowed), else TypeError / ValueError."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """An int >= 1 (or None if allowed), else TypeError / ValueError."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")


def flatten_params(params: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of ``params`` (tensors, or param-group dicts), in order, each once."""
    result: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if id(p) not in seen:
                seen.add(id(p))
                result.append(p)
    if not result:
        raise ValueError("DiLoCoOptimizer got an empty parameter list")
    return result
