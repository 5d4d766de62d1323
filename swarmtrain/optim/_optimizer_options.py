"""Checks of ``Optimizer``'s keywords that depend on each other (before anything starts)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_positive", "resolve_modes"]

_FACTORY_EXAMPLE = (
    "Optimizer(..., optimizer=lambda params: torch.optim.Adam(params), params=model.parameters())"
)


def check_positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    """``value`` is a positive finite number (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")


def resolve_modes(
    *,
    optimizer: Any,
    use_local_updates: bool,
    auxiliary: bool,
    client_mode: bool,
    batch_size_per_step: Any,
    reuse_grad_buffers: bool,
    offload_optimizer: bool | None,
    delay_optimizer_step: bool | None,
    delay_grad_averaging: bool,
    delay_state_averaging: bool,
    grad_averager_factory: Any,
) -> tuple[bool, bool]:
    """``(offload_optimizer, delay_optimizer_step)`` with their defaults filled in; raises
    ``ValueError`` / ``TypeError`` saying what to change for combinations that cannot work.

    Defaults (hivemind's): ``delay_optimizer_step`` follows ``delay_grad_averaging``;
    ``offload_optimizer`` is on when the optimizer is a factory and gradients are averaged, or
    when the optimizer step is delayed (the background step needs the CPU copies).
    """
    is_factory = not isinstance(optimizer, torch.optim.Optimizer)
    if delay_optimizer_step is None:
        delay_optimizer_step = bool(delay_grad_averaging)
    if offload_optimizer is None:
        offload_optimizer = delay_optimizer_step or (is_factory and not use_local_updates)
    if auxiliary:
        if client_mode:
            raise ValueError("an auxiliary peer must accept connections: it cannot be a client")
        if use_local_updates:
            raise ValueError("an auxiliary peer does not train: use_local_updates makes no sense")
        if batch_size_per_step is not None:
            raise ValueError("an auxiliary peer has no batches: do not pass batch_size_per_step")
        if reuse_grad_buffers:
            raise ValueError("an auxiliary peer has no gradients: do not pass reuse_grad_buffers")
    if use_local_updates:
        for name, value in (
            ("reuse_grad_buffers", reuse_grad_buffers),
            ("delay_grad_averaging", delay_grad_averaging),
            ("grad_averager_factory", grad_averager_factory is not None),
        ):
            if value:
                raise ValueError(
                    f"use_local_updates=True averages no gradients: {name} cannot be used with it"
                )
    if grad_averager_factory is not None and not callable(grad_averager_factory):
        raise TypeError("grad_averager_factory must be callable (like GradientAverager)")
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError(
            "delay_grad_averaging=True needs delay_optimizer_step=True: the background optimizer "
            "step is what waits for the gradient round"
        )
    if delay_optimizer_step and not offload_optimizer:
        raise ValueError(
            "delay_optimizer_step needs offload_optimizer=True: the background step runs on CPU "
            "copies of the parameters while the model keeps training"
        )
    if offload_optimizer and not is_factory:
        raise ValueError(
            "offload_optimizer and delayed optimizer steps build the optimizer on CPU copies: "
            f"pass an optimizer factory, e.g. {_FACTORY_EXAMPLE}"
        )
    if delay_optimizer_step and not delay_state_averaging:
        raise ValueError(
            "delay_optimizer_step needs delay_state_averaging=True: the state round runs in the "
            "background after the delayed step"
        )
    return bool(offload_optimizer), bool(delay_optimizer_step)
