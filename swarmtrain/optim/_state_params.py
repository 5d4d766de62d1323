"""Checks and copies of the tensors a ``TrainingStateAverager`` is built from (pure torch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any

import torch

__all__ = [
    "LRScheduler",
    "OptimizerFactory",
    "ParamGroups",
    "Parameters",
    "SchedulerFactory",
    "check_params",
    "check_reusable",
    "host_copy",
]

Parameters = Iterable[torch.Tensor]
ParamGroups = Iterable[dict[str, Any]]
LRScheduler = torch.optim.lr_scheduler.LRScheduler
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]


def check_params(
    optimizer: Any, params: Any, parameter_names: Sequence[Any] | None
) -> tuple[tuple[dict[str, Any], ...], tuple[torch.Tensor, ...], tuple[Any, ...]]:
    """(param groups, flat parameters, names) from ``params`` or the optimizer's groups."""
    if params is None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("pass params=... when optimizer is a factory")
        params = optimizer.param_groups
    groups = tuple(params)
    if groups and all(isinstance(p, torch.Tensor) for p in groups):
        groups = ({"params": list(groups)},)
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("params must be tensors or param groups (dicts with 'params')")
    groups = tuple(  # copies: the caller's dicts stay as they were
        {
            **g,
            "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]),
        }
        for g in groups
    )
    for group in groups:
        if not all(isinstance(p, torch.Tensor) for p in group["params"]):
            raise TypeError("every entry of a param group's 'params' must be a tensor")
    parameters = tuple(chain.from_iterable(group["params"] for group in groups))
    if not parameters:
        raise ValueError("TrainingStateAverager needs at least one parameter")
    if len({id(p) for p in parameters}) != len(parameters):
        raise ValueError("params contain duplicate parameters")
    for i, param in enumerate(parameters):
        if not param.dtype.is_floating_point:
            raise TypeError(f"parameter {i} has dtype {param.dtype}: it cannot be averaged")
    names = tuple(range(len(parameters))) if parameter_names is None else tuple(parameter_names)
    if len(names) != len(parameters):
        raise ValueError(f"got {len(names)} parameter names for {len(parameters)} parameters")
    return groups, parameters, names


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU fp32 copy (fp64 stays fp64) for averaging."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.detach().to(device="cpu", dtype=dtype, copy=True)


def check_reusable(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ValueError(f"reuse_tensors needs CPU tensors, but {what} is on {tensor.device}")
    return tensor.detach()
