"""An optimizer's ``state_dict`` as (DHT-serializable metadata, tensors), and back.

``dump_optimizer_state`` replaces each tensor in the state dict by ``{"__tensor__": index}`` and
each tuple by ``{"__tuple__": [...]}``, so the metadata travels as msgpack (see
``swarmtrain.dht.serialization``) and ``load_optimizer_state`` rebuilds the exact structure
for ``optimizer.load_state_dict`` (which checks the parameter groups and moves the statistics to
the parameters' devices). Used by ``TrainingStateAverager`` and ``DiLoCoOptimizer`` for state
sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmtrain.dht import serialize

__all__ = [
    "TENSOR_KEY",
    "check_optimizer_state_serializable",
    "decode_tensors",
    "encode_tensors",
    "dump_optimizer_state",
    "initialize_optimizer_state_",
    "load_optimizer_state",
]

_TENSOR, _TUPLE = "__tensor__", "__tuple__"
TENSOR_KEY = _TENSOR  #: the key of a tensor reference in the metadata


def encode_tensors(value: Any, tensors: list[torch.Tensor], *, copy: bool = True) -> Any:
    """``value`` with each tensor appended to ``tensors`` (as a detached CPU copy if ``copy``)
    and replaced by ``{"__tensor__": index}``, each tuple by ``{"__tuple__": [...]}``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().to("cpu", copy=True) if copy else value)
        return {_TENSOR: len(tensors) - 1}
    if isinstance(value, dict):
        return {key: encode_tensors(item, tensors, copy=copy) for key, item in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [encode_tensors(item, tensors, copy=copy) for item in value]}
    if isinstance(value, list):
        return [encode_tensors(item, tensors, copy=copy) for item in value]
    return value


def decode_tensors(value: Any, tensors: Sequence[torch.Tensor], *, first: int = 0) -> Any:
    """The inverse of :func:`encode_tensors`; references must fall in ``tensors[first:]``.

    :raises ValueError: a malformed or out-of-range tensor reference
    """
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            index = value[_TENSOR]
            if isinstance(index, bool) or not isinstance(index, int):
                raise ValueError(f"bad tensor reference {value!r} in the metadata")
            if not first <= index < len(tensors):
                raise ValueError(f"tensor reference {index} out of range ({len(tensors)} tensors)")
            return tensors[index]
        if set(value) == {_TUPLE} and isinstance(value[_TUPLE], list):
            return tuple(decode_tensors(item, tensors, first=first) for item in value[_TUPLE])
        return {key: decode_tensors(item, tensors, first=first) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_tensors(item, tensors, first=first) for item in value]
    return value


def dump_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[Any, list[torch.Tensor]]:
    """``(metadata, tensors)``: the tensors are detached CPU copies."""
    tensors: list[torch.Tensor] = []
    with torch.no_grad():
        metadata = encode_tensors(optimizer.state_dict(), tensors)
    return metadata, tensors


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, metadata: Any, tensors: Sequence[torch.Tensor]
) -> None:
    """Load what :func:`dump_optimizer_state` produced (on another peer) into ``optimizer``.

    :raises ValueError: the metadata is malformed or names a tensor that is not there (the
      optimizer is unchanged); ``load_state_dict``'s own errors for another optimizer layout
    """
    state_dict = decode_tensors(metadata, tensors)
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("optimizer metadata is not an optimizer state dict")
    optimizer.load_state_dict(state_dict)


def check_optimizer_state_serializable(optimizer: torch.optim.Optimizer) -> None:
    """Raise now (not when a newcomer asks) if the state dict cannot travel as metadata."""
    metadata, _ = dump_optimizer_state(optimizer)
    try:
        serialize(metadata, max_size=None, max_elements=None)
    except ValueError as e:
        raise TypeError(f"the optimizer's state dict cannot be shared with peers: {e}") from None


@torch.no_grad()
def initialize_optimizer_state_(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's statistics with one step on zero gradients. The parameters are
    restored afterwards (a step on zero gradients still applies e.g. AdamW's weight decay)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [(p.grad, p.detach().clone()) for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    try:
        optimizer.step()
    finally:
        for param, (grad, value) in zip(params, saved, strict=True):
            param.copy_(value)
            param.grad = grad
