"""An optimizer's ``state_dict`` as (DHT-serializable metadata, tensors), and back.

``dump_optimizer_state`` replaces each tensor in the state dict by ``{"__tensor__": index}`` and
each tuple by ``{"__tuple__": [...]}``, so the metadata travels as msgpack (see
``swarmtrain.dht.serialization``) and ``load_optimizer_state`` rebuilds the exact structure
for ``optimizer.load_state_dict`` (which checks the parameter groups and moves the statistics to
the parameters' devices). Used by ``TrainingStateAverager`` for state sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmtrain.dht import serialize

__all__ = [
    "check_optimizer_state_serializable",
    "dump_optimizer_state",
    "initialize_optimizer_state_",
    "load_optimizer_state",
]

_TENSOR, _TUPLE = "__tensor__", "__tuple__"


def dump_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[Any, list[torch.Tensor]]:
    """``(metadata, tensors)``: the tensors are detached CPU copies."""
    tensors: list[torch.Tensor] = []

    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().to("cpu", copy=True))
            return {_TENSOR: len(tensors) - 1}
        if isinstance(value, dict):
            return {key: encode(item) for key, item in value.items()}
        if isinstance(value, tuple):
            return {_TUPLE: [encode(item) for item in value]}
        if isinstance(value, list):
            return [encode(item) for item in value]
        return value

    with torch.no_grad():
        metadata = encode(optimizer.state_dict())
    return metadata, tensors


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, metadata: Any, tensors: Sequence[torch.Tensor]
) -> None:
    """Load what :func:`dump_optimizer_state` produced (on another peer) into ``optimizer``.

    :raises ValueError: the metadata is malformed or names a tensor that is not there (the
      optimizer is unchanged); ``load_state_dict``'s own errors for another optimizer layout
    """

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                index = value[_TENSOR]
                if isinstance(index, bool) or not isinstance(index, int):
                    raise ValueError(f"bad tensor index {index!r} in optimizer metadata")
                if not 0 <= index < len(tensors):
                    raise ValueError(f"optimizer metadata names tensor {index} of {len(tensors)}")
                return tensors[index]
            if set(value) == {_TUPLE} and isinstance(value[_TUPLE], list):
                return tuple(decode(item) for item in value[_TUPLE])
            return {key: decode(item) for key, item in value.items()}
        if isinstance(value, list):
            return [decode(item) for item in value]
        return value

    state_dict = decode(metadata)
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("optimizer metadata is not an optimizer state dict")
    optimizer.load_state_dict(state_dict)


def check_optimizer_state_serializable(optimizer: torch.optim.Optimizer) -> None:
    """Raise now (not when a newcomer asks) if the state dict cannot travel as metadata."""
    metadata, _ = dump_optimizer_state(optimizer)
    try:
        serialize(metadata, max_size=None)
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
