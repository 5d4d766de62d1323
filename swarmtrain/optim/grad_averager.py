"""``GradientAverager``: accumulate local gradients, average them with peers (hivemind's API).

Three sets of buffers:

1. the model's gradients, ``param.grad`` (written by autograd, on the model's device);
2. accumulators, where ``accumulate_grads_(batch_size)`` adds each batch's gradients (on
   ``accumulate_grads_on``, default the parameters' device) — or, with
   ``reuse_grad_buffers=True``, the ``.grad`` buffers themselves (less memory; then never call
   ``zero_grad`` or clip gradients between ``reset_accumulated_grads_`` calls);
3. the averaged gradients, CPU tensors that the averager averages with the group.

A round, in plain code::

    averager = GradientAverager(model.parameters(), dht=dht, prefix="run_grad_averager")
    for batch in batches:
        model(batch).loss.backward()
        averager.accumulate_grads_(batch_size=len(batch))
        model.zero_grad()
        if time_to_average():
            averager.step()                          # weight = samples accumulated
            with averager.use_averaged_gradients():  # .grad = the group's mean gradient
                opt.step()
            averager.reset_accumulated_grads_()

``schedule_step(scheduled_time=t)`` starts matchmaking ahead of time (the group is assembled
while we still compute); pass its ``StepControl`` to ``step(control=...)``, which loads the
accumulators and lets all-reduce begin.

What is averaged: each peer's *mean* gradient over the samples it accumulated, weighted by that
number of samples, so the result is the mean gradient over all samples of the group. Without
``reuse_grad_buffers`` each batch is weighted by its size (hivemind weights batches of
different sizes by ``batch_size / first_batch_size`` and then divides by the number of batches,
which is the same only when all batches have one size). With ``reuse_grad_buffers`` the ``.grad``
buffers hold the *sum* of the batches' gradients, so the local mean divides by the number of
batches (exact for equal batch sizes). A peer with no samples contributes weight 0; if the whole
group has weight 0 everyone keeps their own (zero) gradients, never NaN.

If a step fails (no group, all-reduce error), the averaged buffers hold the local mean gradient,
so ``use_averaged_gradients()`` still gives a usable (local) update. Gradients with NaN or inf
are never sent: the step takes part with zeros of weight 0 (the others average without us at
once) and raises ``NonFiniteError``; the buffers keep the local (non-finite) mean.

Resource handling: like ``DecentralizedAverager`` (``shutdown()`` stops it; the DHT is the
caller's). Do not call ``step`` inside ``use_averaged_gradients()``: that block holds the lock of
the averaged tensors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from swarmtrain.averaging import DecentralizedAverager, StepControl
from swarmtrain.compression import CompressionInfo, NoCompression, TensorRole
from swarmtrain.optim._tensor_infos import tag_compression

__all__ = ["GradientAverager"]

logger = logging.getLogger(__name__)


def _check_batch_size(batch_size: Any) -> float:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, float)):
        raise TypeError(f"batch_size must be a number, got {batch_size!r}")
    if not math.isfinite(batch_size) or batch_size <= 0:
        raise ValueError(f"batch_size must be positive and finite, got {batch_size}")
    return batch_size


def _check_averaged_grads(
    averaged_grads: Sequence[torch.Tensor], parameters: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    averaged_grads = tuple(averaged_grads)
    if len(averaged_grads) != len(parameters):
        raise ValueError(
            f"averaged_grads has {len(averaged_grads)} tensors for {len(parameters)} parameters"
        )
    for i, (grad, param) in enumerate(zip(averaged_grads, parameters, strict=True)):
        if not isinstance(grad, torch.Tensor) or grad.shape != param.shape:
            shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(
                f"averaged_grads[{i}] has shape {shape}, its parameter {tuple(param.shape)}"
            )
    return averaged_grads


# Per-step tensor work (accumulating, zeroing) in fused calls: ``torch._foreach_*`` runs a list
# of tensors in one call (one kernel launch per group on an accelerator, no Python per tensor on
# CPU: ~1.4x faster than a loop for a 0.1M-value model, the same for a 12M-value one, whose
# cost is memory traffic; ``benchmarks/benchmark_step_costs.py``). Lists that mix devices,
# dtypes or layouts take the per-tensor loop.


def _same_kind(*tensor_lists: Sequence[torch.Tensor]) -> bool:
    """Whether all tensors are dense and share the first one's device and dtype (what the
    foreach ops need)."""
    if not tensor_lists[0]:
        return False
    first = tensor_lists[0][0]
    device, dtype, dense = first.device, first.dtype, torch.strided
    return all(
        t.device == device and t.dtype == dtype and t.layout == dense
        for ts in tensor_lists
        for t in ts
    )


def _add_(
    accumulators: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, ...],
    alpha: float,
    fused: bool,
):
    """``accumulator += alpha * grad`` for each pair (grads converted to the accumulator's
    device and dtype); ``fused``: all of one device and dtype."""
    if fused:
        torch._foreach_add_(accumulators, grads, alpha=alpha)
        return
    for grad, accumulator in zip(grads, accumulators, strict=True):
        accumulator.add_(grad.to(accumulator.device, accumulator.dtype), alpha=alpha)


#: from this size on a tensor is scaled into its buffer in one pass over the memory (1.5x
#: faster for a 12M-value model); smaller ones copy and scale in place (faster per call)
ONE_PASS_MIN_VALUES = 1 << 16


def _scaled_copy_(out: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], scale: float):
    """``out[i] = tensors[i] * scale``, written into ``out``'s buffers."""
    for target, tensor in zip(out, tensors, strict=True):
        if scale == 1.0:
            target.copy_(tensor)
        elif (
            tensor.numel() >= ONE_PASS_MIN_VALUES
            and target.device == tensor.device
            and target.dtype == tensor.dtype
        ):
            torch.mul(tensor, scale, out=target)
        else:
            target.copy_(tensor).mul_(scale)


def _zero_(tensors: tuple[torch.Tensor, ...], fused: bool) -> None:
    if fused:
        torch._foreach_zero_(tensors)
    else:
        for tensor in tensors:
            tensor.zero_()


class GradientAverager(DecentralizedAverager):
    """Accumulates gradients and averages them with peers; see the module docstring.

    :param parameters: the model's parameters (their ``.grad`` is read, and set to zeros if None)
    :param dht: a running blocking ``DHT``
    :param prefix: the DHT namespace of this averager (e.g. ``f"{run_id}_grad_averager"``)
    :param reuse_grad_buffers: accumulate in ``param.grad`` (see the module docstring)
    :param accumulate_grads_on: device of the accumulators (default: each parameter's device);
      ignored with ``reuse_grad_buffers``
    :param client_mode: default: the DHT's
    :param warn: log a warning when accumulators were not reset after a step, or averaged
      gradients were not used before the next step
    :param grad_extra_tensors: average these buffers instead of copies of the gradients (for
      subclasses such as PowerSGD, which override ``load_accumulators_into_averager_`` and
      ``use_averaged_gradients``)
    :param averaged_grads: buffers to average the gradients in (as in hivemind): one per
      parameter, of its shape (default: new zero tensors on the CPU)
    :param averager_kwargs: ``DecentralizedAverager`` keywords (``AveragerConfig`` fields,
      ``start``); a codec selector given as ``compression`` sees each tensor with role GRADIENT
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        *,
        dht,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: torch.device | str | None = None,
        client_mode: bool | None = None,
        warn: bool = True,
        grad_extra_tensors: Sequence[torch.Tensor] = (),
        averaged_grads: Sequence[torch.Tensor] | None = None,
        **averager_kwargs: Any,
    ):
        self.parameters = tuple(parameters)
        if not self.parameters:
            raise ValueError("GradientAverager needs at least one parameter")
        for i, param in enumerate(self.parameters):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"parameters[{i}] is a {type(param).__name__}, not a tensor")
            if not param.dtype.is_floating_point:
                raise TypeError(f"parameters[{i}] has dtype {param.dtype}: it has no gradient")
        if len({id(p) for p in self.parameters}) != len(self.parameters):
            raise ValueError("parameters contain duplicates")
        if averaged_grads is not None:
            if grad_extra_tensors:
                raise TypeError("give averaged_grads or grad_extra_tensors, not both")
            grad_extra_tensors = _check_averaged_grads(averaged_grads, self.parameters)
        if reuse_grad_buffers and accumulate_grads_on is not None:
            logger.warning("accumulate_grads_on has no effect with reuse_grad_buffers=True")
        self.reuse_grad_buffers = bool(reuse_grad_buffers)
        self.warn = bool(warn)
        self.local_samples_accumulated: float = 0
        self.local_times_accumulated = 0
        self._anchor_batch_size: float | None = None
        self._accumulators_used_in_step = False
        self._new_averaged_grads = False
        self._local_accumulators: tuple[torch.Tensor, ...] | None = None
        with torch.no_grad():
            if not self.reuse_grad_buffers:
                self._local_accumulators = tuple(
                    torch.zeros_like(grad, device=accumulate_grads_on)
                    for grad in self._grads_from_parameters()
                )
            if grad_extra_tensors:
                averaged_grads = tuple(grad_extra_tensors)
            else:
                averaged_grads = tuple(
                    torch.zeros_like(grad, device="cpu") for grad in self._grads_from_parameters()
                )
        # the gradients have their parameters' device and dtype (torch checks each assignment)
        self._fused = _same_kind(self.parameters, self._local_accumulators or ())
        infos = [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.GRADIENT)
            for i, t in enumerate(averaged_grads)
        ]
        compression = averager_kwargs.pop("compression", None) or NoCompression()
        super().__init__(
            averaged_grads,
            dht,
            prefix=prefix,
            client_mode=client_mode,
            compression=tag_compression(compression, infos),
            **averager_kwargs,
        )

    # ------------------------------------------------------------------ buffers

    def _grads_from_parameters(self) -> Iterator[torch.Tensor]:
        """The parameters' ``.grad`` buffers (zeros are created where there is none)."""
        for param in self.parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            yield param.grad

    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        if self.reuse_grad_buffers:
            yield from self._grads_from_parameters()
        else:
            assert self._local_accumulators is not None
            yield from self._local_accumulators

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: float) -> None:
        """Add the current ``.grad`` (the gradient of a mean loss over ``batch_size`` samples)
        to the accumulators; with ``reuse_grad_buffers`` only the counters change."""
        batch_size = _check_batch_size(batch_size)
        if self._accumulators_used_in_step and self.warn:
            logger.warning(
                "[warn=True] gradient accumulators were not reset since the last averaging "
                "round: call reset_accumulated_grads_() after each step (or "
                "step(reset_accumulators=True))"
            )
            self._accumulators_used_in_step = False  # once per round
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size  # scale relative to it: no overflow in fp16
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        if self.reuse_grad_buffers:
            return  # autograd accumulates into .grad
        assert self._local_accumulators is not None
        alpha = batch_size / self._anchor_batch_size
        grads = tuple(self._grads_from_parameters())
        _add_(self._local_accumulators, grads, alpha, self._fused)

    def _local_grad_scale(self) -> float:
        """Multiplier that turns the accumulators into the local mean gradient (0 if empty)."""
        if self.local_times_accumulated == 0:
            return 0.0
        if self.reuse_grad_buffers:
            return 1.0 / self.local_times_accumulated
        assert self._anchor_batch_size is not None
        return self._anchor_batch_size / self.local_samples_accumulated

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """Write the local mean gradient into the averaged buffers."""
        scale = self._local_grad_scale()
        with self.get_tensors() as averaged_grads:
            accumulators = tuple(self._grad_accumulators())
            if len(accumulators) != len(averaged_grads) or any(
                a.shape != b.shape for a, b in zip(accumulators, averaged_grads, strict=True)
            ):
                raise RuntimeError(
                    "the averaged buffers (grad_extra_tensors) do not match the gradients: "
                    "a subclass that averages other tensors must override "
                    "load_accumulators_into_averager_ and use_averaged_gradients"
                )
            _scaled_copy_(averaged_grads, accumulators, scale)

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """Zero the accumulators (``.grad`` with ``reuse_grad_buffers``) and the counters."""
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = 0
        self.local_times_accumulated = 0
        self._anchor_batch_size = None
        _zero_(tuple(self._grad_accumulators()), self._fused)

    # ------------------------------------------------------------------ averaging

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        """Start matchmaking now for an all-reduce at ``scheduled_time`` (DHT time; default now
        + ``min_matchmaking_time``); pass the control to :meth:`step`, which fixes the weight and
        lets all-reduce begin. Keywords: ``DecentralizedAverager.step``'s (``gather``,
        ``timeout``, ``allow_retries``), except ``weight``. A control serves one step."""
        if kwargs.get("weight") is not None:
            raise ValueError("schedule_step cannot set the weight: step() sets it")
        kwargs.pop("weight", None)
        return super().step(
            scheduled_time=scheduled_time, wait=False, require_trigger=True, **kwargs
        )

    def step(  # type: ignore[override]
        self,
        weight: float | None = None,
        reset_accumulators: bool = True,
        control: StepControl | None = None,
        timeout: float | None = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Average the accumulated gradients with a group (see the module docstring).

        :param weight: our weight (default: the number of samples accumulated)
        :param reset_accumulators: zero the accumulators once they are loaded for averaging
        :param control: a control from :meth:`schedule_step` (else matchmaking starts now)
        :param timeout: for a new control, give up matchmaking after this long (the step then
          fails soon after); with ``control``, how long to wait for its result before
          cancelling it
        :param wait: return the gathered data ``{peer_id: gather}``; else the ``StepControl``
        :param kwargs: ``schedule_step`` keywords, for a new control only
        :raises MatchmakingError, AveragingError: the step failed (the averaged buffers then hold
          the local mean gradient)
        """
        result_timeout = timeout
        if control is None:
            control = self.schedule_step(timeout=timeout, **kwargs)
            result_timeout = None  # the step ends by itself, soon after its deadline
        elif kwargs:
            raise ValueError(f"a pre-scheduled step ignores {sorted(kwargs)}: pass them earlier")
        if control.triggered:
            raise ValueError("this StepControl was already used by a step")
        if self._new_averaged_grads and self.warn:
            logger.warning(
                "[warn=True] a new averaging round starts, but the last round's averaged "
                "gradients were not used (use_averaged_gradients or notify_used_averaged_gradients)"
            )
        try:
            self.load_accumulators_into_averager_()
            self._accumulators_used_in_step = True
            self._new_averaged_grads = True
            control.weight = self.local_samples_accumulated if weight is None else weight
        except BaseException:
            control.cancel()
            raise
        if reset_accumulators:
            self.reset_accumulated_grads_()
        control.allow_allreduce()
        if not wait:
            return control
        try:
            return control.result(result_timeout)
        except BaseException:
            control.cancel()  # Ctrl-C or a timeout: do not leave it running
            raise

    @contextmanager
    def use_averaged_gradients(self) -> Iterator[Sequence[torch.Tensor]]:
        """Within the block, ``param.grad`` is the averaged gradient (the averaged buffer itself
        where device and dtype match, else a copy on the parameter's device); the previous
        ``.grad`` tensors are put back afterwards. Yields the averaged buffers."""
        self._new_averaged_grads = False
        with self.get_tensors() as averaged_grads:
            if len(averaged_grads) != len(self.parameters):
                raise RuntimeError("the averaged buffers are not one gradient per parameter")
            old_grads = [param.grad for param in self.parameters]
            try:
                with torch.no_grad():
                    for param, averaged in zip(self.parameters, averaged_grads, strict=True):
                        if averaged.device == param.device and averaged.dtype == param.dtype:
                            param.grad = averaged
                        else:
                            param.grad = averaged.to(param.device, param.dtype)
                yield averaged_grads
            finally:
                for param, old_grad in zip(self.parameters, old_grads, strict=True):
                    param.grad = old_grad

    def notify_used_averaged_gradients(self) -> None:
        """Say that the last round's averaged gradients were used (without the context)."""
        self._new_averaged_grads = False
