"""``GradScaler``: ``torch.amp.GradScaler`` that also drives a ``swarmtrain.Optimizer``.

The training loop is torch's::

    scaler = GradScaler()
    with torch.autocast(device_type, dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(opt)        # a swarmtrain Optimizer: opt.step(grad_scaler=scaler)
    scaler.update()
    opt.zero_grad()

For any other optimizer every method behaves exactly like ``torch.amp.GradScaler``'s.

The contract with the swarm optimizer (what ``Optimizer.step(grad_scaler=...)`` does):

- Deferred mode (:attr:`GradScaler.defer_updates`) follows the optimizer's
  ``reuse_grad_buffers``: ``scaler.step(opt)`` copies it on every step (an optimizer driven
  directly may set the attribute itself).
- Without ``reuse_grad_buffers`` (separate accumulators): the optimizer calls
  :meth:`unscale_swarm_grads_` on its parameters each step; on ``False`` (inf/NaN) it skips the
  batch, else it accumulates the unscaled gradients. ``update()`` changes the scale as torch
  does (back off after an inf, grow after ``growth_interval`` finite steps).
- With ``reuse_grad_buffers`` autograd sums *scaled* gradients into ``.grad`` over the epoch,
  so the scale must not change while they accumulate: ``update()`` holds growth until the
  optimizer calls :meth:`on_swarm_epoch_end_` after its step. At the end of the epoch the
  optimizer calls :meth:`unscale_swarm_grads_` on the accumulated buffers; on ``False`` it
  drops them (e.g. averages with weight 0), and the next ``update()`` backs the scale off (the
  buffers are empty by then). It may also call :meth:`check_swarm_grads_` after each batch
  (no unscaling) and reset the buffers on ``False``, losing less time to a bad batch.
- An inf/NaN seen since the last ``update()`` cancels the growth due at the epoch's end.

``device`` defaults to the device of the first tensor given to :meth:`scale` (the model's).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

__all__ = ["GradScaler", "is_swarm_optimizer", "scaler_method"]


def scaler_method(grad_scaler: Any, name: str) -> Callable[..., Any]:
    """``grad_scaler.<name>``; a TypeError saying what to pass when it has none (a plain
    torch ``GradScaler`` given to a swarm optimizer's ``step``)."""
    method = getattr(grad_scaler, name, None)
    if not callable(method):
        raise TypeError(
            f"grad_scaler must be a swarmtrain.optim.GradScaler (a {type(grad_scaler).__name__} "
            f"has no {name}()): a plain torch GradScaler unscales at the wrong time"
        )
    return method


def is_swarm_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` follows the swarm contract: it has ``main_parameters`` and its
    ``step`` takes ``grad_scaler``."""
    step = getattr(optimizer, "step", None)
    if not hasattr(optimizer, "main_parameters") or step is None:
        return False
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False


def _first_tensor(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        outputs = outputs.values()
    if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
        for item in outputs:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class GradScaler(torch.amp.GradScaler):
    """See the module docstring; arguments as ``torch.amp.GradScaler``'s.

    :param device: ``"cuda"``, ``"cpu"``, ...; None: the device type of the first tensor given
      to :meth:`scale`
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        if device is not None and not isinstance(device, str):
            raise TypeError(f"device must be a device type such as 'cpu' or 'cuda', got {device!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int, got {growth_interval!r}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be at least 1, got {growth_interval}")
        super().__init__(
            device or "cpu", init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._device_from_first_use = device is None
        self._defer_updates = False
        self._swarm_found_inf = False  # an inf/NaN since the last update()
        self._swarm_steps = 0  # swarm steps and checks since the last update()
        self._swarm_mode = False  # a swarm optimizer drives us: update() needs no torch records
        self._growth_pending = False  # deferred: the scale grows at the end of the epoch

    # ------------------------------------------------------------------ torch's API

    def scale(self, outputs: Any) -> Any:
        if self._enabled and self._scale is None and self._device_from_first_use:
            first = _first_tensor(outputs)
            if first is not None:
                self._device = first.device.type
        return super().scale(outputs)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(grad_scaler=self)`` for a swarm optimizer, else torch's step."""
        if is_swarm_optimizer(optimizer):
            if "grad_scaler" in kwargs:
                raise TypeError("step() got grad_scaler twice: the scaler passes itself")
            if not self._enabled:
                return optimizer.step(*args, **kwargs)
            self.defer_updates = bool(getattr(optimizer, "reuse_grad_buffers", False))
            self._mark_swarm_step()
            return optimizer.step(*args, grad_scaler=self, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def unscale_(self, optimizer: Any) -> None:
        if is_swarm_optimizer(optimizer):
            raise RuntimeError(
                "GradScaler.unscale_ does not work with a swarmtrain Optimizer: it unscales the "
                "gradients itself when it accumulates or averages them (to clip gradients, "
                "clip the averaged ones, e.g. in a custom optimizer)"
            )
        super().unscale_(optimizer)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's ``update`` (see the module docstring for steps of a swarm optimizer)."""
        if not self._enabled:
            return
        torch_records = any(
            state["found_inf_per_device"] for state in self._per_optimizer_states.values()
        )
        swarm = self._swarm_steps > 0 or (self._swarm_mode and not torch_records)
        if not swarm or new_scale is not None:
            self._reset_swarm_round()
            if new_scale is not None:
                self._growth_pending = False
            super().update(new_scale)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_inf = self._swarm_found_inf or any(
            bool(found.item())
            for state in self._per_optimizer_states.values()
            for found in state["found_inf_per_device"].values()
        )
        with torch.no_grad():
            if found_inf:
                scale.mul_(self._backoff_factor)
                tracker.zero_()
                self._growth_pending = False
            elif self._growth_pending:
                pass  # already due: it happens at the end of the epoch
            elif int(tracker.item()) + 1 >= self._growth_interval:
                tracker.zero_()
                if self._defer_updates:
                    self._growth_pending = True
                else:
                    self._grow(scale)
            else:
                tracker.add_(1)
        self._reset_swarm_round()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # ------------------------------------------------------------------ swarm optimizer side

    def unscale_swarm_grads_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the ``.grad`` of ``params`` by the current scale, in place; False if any value
        is inf or NaN (then the next :meth:`update` backs the scale off)."""
        return self._check_and_unscale(params, unscale=True)

    def check_swarm_grads_(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether the ``.grad`` of ``params`` is finite (they stay scaled); an inf or NaN is
        recorded like in :meth:`unscale_swarm_grads_`."""
        return self._check_and_unscale(params, unscale=False)

    def on_swarm_epoch_end_(self) -> None:
        """The swarm optimizer finished an epoch (its gradient buffers are empty): apply the
        growth that :meth:`update` deferred."""
        if not self._enabled or self._swarm_found_inf:
            return  # the next update() backs off instead
        if self._growth_pending and self._scale is not None:
            self._grow(self._scale)
        self._growth_pending = False

    @property
    def defer_updates(self) -> bool:
        """Hold scale growth until :meth:`on_swarm_epoch_end_`. Setting it (the swarm optimizer
        does, on each step) also tells :meth:`update` that a swarm optimizer drives the scaler."""
        return self._defer_updates

    @defer_updates.setter
    def defer_updates(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"defer_updates must be a bool, got {value!r}")
        self._defer_updates = value
        self._swarm_mode = True

    @property
    def growth_pending(self) -> bool:
        """Deferred mode: the scale will grow at the next :meth:`on_swarm_epoch_end_`."""
        return self._growth_pending

    # ------------------------------------------------------------------ internals

    def _check_and_unscale(self, params: Iterable[torch.Tensor], *, unscale: bool) -> bool:
        if not self._enabled:
            return True
        if self._scale is None:
            raise RuntimeError(
                "the scale is not set yet: call scaler.scale(loss).backward() before the step"
            )
        self._mark_swarm_step()
        inv_scale = self._scale.double().reciprocal().float() if unscale else None
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for i, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"params[{i}] is a {type(param).__name__}, not a tensor")
            if param.grad is not None:
                groups[param.grad.device, param.grad.dtype].append(param.grad)
        found_any = False
        with torch.no_grad():
            for (device, _), grads in groups.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                one = torch.ones((), dtype=torch.float32, device=device)
                factor = one if inv_scale is None else inv_scale.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, factor)
                found_any = found_any or bool(found.item())
        self._swarm_found_inf = self._swarm_found_inf or found_any
        return not found_any

    def _grow(self, scale: torch.Tensor) -> None:
        grown = scale * self._growth_factor
        if torch.isfinite(grown):
            scale.copy_(grown)

    def _mark_swarm_step(self) -> None:
        self._swarm_mode = True
        self._swarm_steps += 1

    def _reset_swarm_round(self) -> None:
        self._swarm_found_inf = False
        self._swarm_steps = 0
