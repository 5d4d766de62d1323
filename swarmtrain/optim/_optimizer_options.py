"""Checks of ``Optimizer``'s keywords that depend on each other (before anything starts)."""

from __future__ import annotations

import math
from typing import Any

import torch

from swarmtrain.averaging.averager_config import check_declaration_linger

__all__ = [
    "averager_options",
    "check_keywords",
    "check_positive",
    "grad_averager_options",
    "resolve_modes",
    "state_averager_options",
]

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


def check_keywords(
    *,
    run_id: Any,
    target_batch_size: Any,
    batch_size_per_step: Any,
    matchmaking_time: Any,
    averaging_timeout: Any,
    allreduce_timeout: Any,
    next_chunk_timeout: Any,
    load_state_timeout: Any,
    average_state_every: Any,
    averager_opts: Any,
    tracker_opts: Any,
    declaration_linger: Any = 0.0,
) -> None:
    """The checks of ``Optimizer``'s (and ``AsyncOptimizer``'s) keywords that stand alone."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("run_id must be a non-empty string")
    if "." in run_id or "::" in run_id:
        raise ValueError(
            f"run_id must not contain '.' or '::' (they separate the parts of the run's DHT "
            f"keys and RPC names), got {run_id!r}"
        )
    if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int):
        raise TypeError(f"target_batch_size must be an int, got {target_batch_size!r}")
    check_positive("target_batch_size", target_batch_size)
    check_positive("batch_size_per_step", batch_size_per_step, allow_none=True)
    check_positive("matchmaking_time", matchmaking_time)
    check_positive("averaging_timeout", averaging_timeout)
    check_positive("allreduce_timeout", allreduce_timeout, allow_none=True)
    check_positive("next_chunk_timeout", next_chunk_timeout, allow_none=True)
    check_positive("load_state_timeout", load_state_timeout)
    check_declaration_linger(declaration_linger)
    if (
        isinstance(average_state_every, bool)
        or not isinstance(average_state_every, int)
        or average_state_every < 1
    ):
        raise ValueError(f"average_state_every must be an int >= 1, got {average_state_every}")
    for name, opts in (("averager_opts", averager_opts), ("tracker_opts", tracker_opts)):
        if opts is not None and not isinstance(opts, dict):
            raise TypeError(f"{name} must be a dict of keywords")
    if tracker_opts and "client_mode" in tracker_opts:
        raise ValueError("pass client_mode to the Optimizer, not in tracker_opts")


def averager_options(
    *,
    matchmaking_time: float,
    averaging_timeout: float,
    allreduce_timeout: float | None,
    next_chunk_timeout: float | None,
    averager_opts: dict[str, Any] | None,
    declaration_linger: float | None = None,
) -> dict[str, Any]:
    """``AveragerConfig`` keywords shared by the gradient and the state averager
    (``averager_opts`` override the others)."""
    common: dict[str, Any] = {
        "min_matchmaking_time": matchmaking_time,
        "matchmaking_time_keyword": "matchmaking_time",  # messages name our keyword
        "request_timeout": min(3.0, matchmaking_time / 2),
        "allreduce_timeout": averaging_timeout
        if allreduce_timeout is None
        else float(allreduce_timeout),
    }
    if next_chunk_timeout is not None:
        common["next_chunk_timeout"] = float(next_chunk_timeout)
    if declaration_linger is not None:
        common["declaration_linger"] = float(declaration_linger)
    common.update(averager_opts or {})
    return common


def state_averager_options(
    common: dict[str, Any],
    *,
    state_averaging_compression: Any,
    load_state_compression: Any,
    use_local_updates: bool,
    aggregation: str,
) -> dict[str, Any]:
    """The state averager's ``AveragerConfig`` keywords: ``common`` plus its codecs (state
    downloads default to ``state_averaging_compression``) and, with ``use_local_updates``
    (the state round is the only one), ``aggregation``."""
    state_opts = dict(common)
    if state_averaging_compression is not None:
        state_opts.setdefault("compression", state_averaging_compression)
    if load_state_compression is None:
        load_state_compression = state_averaging_compression
    if load_state_compression is not None:
        state_opts.setdefault("state_compression", load_state_compression)
    if use_local_updates:
        state_opts.setdefault("aggregation", aggregation)
    return state_opts


def grad_averager_options(
    common: dict[str, Any], *, aggregation: str, grad_compression: Any
) -> dict[str, Any]:
    """The gradient averager's keywords: ``common``, ``aggregation`` and its codec (auxiliary
    peers average with weight 0 to get the result, so no ``auxiliary`` mode here)."""
    grad_opts = {"aggregation": aggregation, **common}
    grad_opts.pop("auxiliary", None)
    if grad_compression is not None:
        grad_opts.setdefault("compression", grad_compression)
    return grad_opts
