"""The torch side of a ``TrainingStateAverager``: its tensors, their copies, and the phases
of a step that touch them (an optimizer step, loading a round's inputs, applying its result).

Every method here is synchronous and takes the locks it needs (``lock_optimizer``, then the
averager's ``lock_averaged_tensors``): the trio implementation
(``swarmtrain.optim.async_state_averager``) and the Optimizer's delayed jobs call them through
``trio.to_thread``, never on the event loop. Methods ending in ``_`` expect ``lock_optimizer``
held by the caller.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.async_averager import TensorLock
from swarmtrain.optim._state_params import LRScheduler
from swarmtrain.optim.state_step_core import StateAveragerTraits, StatePhases

__all__ = ["StateTensors"]

#: the module of the public class: its log messages keep the name users filter on
logger = logging.getLogger("swarmtrain.optim.state_averager")

_LATE_SCHEDULER_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


class StateTensors:
    """Base of ``TrainingStateAverager``: the torch side (see the module docstring). The
    attributes below are set by ``TrainingStateAverager.__init__``."""

    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    main_parameters: tuple[torch.Tensor, ...]
    parameter_names: tuple[Any, ...]
    opt_keys_for_averaging: tuple[str, ...]
    extra_tensors: tuple[torch.Tensor, ...]
    local_epoch: int
    lock_optimizer: threading.Lock
    lock_averaged_tensors: TensorLock
    _averaged_tensors: tuple[torch.Tensor, ...]
    _old_tensors: list[torch.Tensor] | None
    offload_optimizer: bool
    custom_gradients: bool
    reuse_tensors: bool
    delta_rule_averaging: bool
    sync_epoch_when_averaging: bool
    status_loglevel: int
    #: called with each successful round's gathered data and this peer's epoch then (the
    #: Optimizer tells its tracker who averaged with it)
    round_observer: Callable[[dict, int], None] | None

    def _opt_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _local_tensors(self) -> Iterator[torch.Tensor]:
        """The trainer's tensors, in the order of the averaged ones."""
        opt_params = self._opt_params()
        yield from opt_params
        for key in self.opt_keys_for_averaging:
            for param in opt_params:
                yield self.optimizer.state[param][key]
        yield from self.extra_tensors

    def _update_scheduler(self) -> None:
        """Step the scheduler until it reaches ``local_epoch`` (fast-forwarding is intended)."""
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LATE_SCHEDULER_WARNING)
            while self.scheduler._step_count <= self.local_epoch:
                self.scheduler.step()

    # ------------------------------------------------------------ copies (lock_optimizer held)

    @torch.no_grad()
    def _load_local_grads_into_optimizer_(self) -> None:
        for main, copy in zip(self.main_parameters, self._opt_params(), strict=True):
            if main.grad is None:
                continue
            if copy.grad is None:
                copy.grad = torch.empty_like(copy)
            copy.grad.copy_(main.grad)

    @torch.no_grad()
    def _apply_optimizer_parameters_(self) -> None:
        for main, copy in zip(self.main_parameters, self._opt_params(), strict=True):
            main.copy_(copy)

    @torch.no_grad()
    def _copy_local_into_averaged(self, averaged: Sequence[torch.Tensor]) -> None:
        local = list(self._local_tensors())
        for local_tensor, averaged_tensor in zip(local, averaged, strict=True):
            averaged_tensor.copy_(local_tensor)
        if self.delta_rule_averaging:
            self._old_tensors = [t.clone() for t in averaged]

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        with self.lock_averaged_tensors:
            averaged = self._averaged_tensors
            local = list(self._local_tensors())
            if not self.delta_rule_averaging or self._old_tensors is None:
                for local_tensor, averaged_tensor in zip(local, averaged, strict=True):
                    local_tensor.copy_(averaged_tensor)
            else:
                for local_tensor, new, old in zip(local, averaged, self._old_tensors, strict=True):
                    local_tensor.add_(new.sub(old).to(local_tensor.device, local_tensor.dtype))
            self._old_tensors = None

    def _optimizer_phase(
        self,
        wait_for_trigger: Callable[[], Any] | None,
        optimizer_step: bool,
        zero_grad: bool,
        set_to_none: bool = True,
    ) -> None:
        if wait_for_trigger is not None:
            wait_for_trigger()
        with self.lock_optimizer:
            if optimizer_step:
                with self.lock_averaged_tensors if self.reuse_tensors else nullcontext():
                    self.optimizer.step()
            if zero_grad:
                self.optimizer.zero_grad(set_to_none=set_to_none)
                if self.offload_optimizer:
                    for param in self.main_parameters:
                        if set_to_none:
                            param.grad = None
                        elif param.grad is not None:
                            param.grad.zero_()
            self._update_scheduler()

    def _load_round_inputs(self, control: StepControl) -> None:
        """Copy the local tensors into the averaged ones (unless those are the local ones)."""
        if self.reuse_tensors:
            return
        try:
            with self.lock_optimizer, self.lock_averaged_tensors:
                self._copy_local_into_averaged(self._averaged_tensors)
        except BaseException:
            control.cancel()
            raise

    def _apply_round(self) -> None:
        with self.lock_optimizer:
            if not self.reuse_tensors:
                self._apply_averaging_results_()
            if self.offload_optimizer:
                self._apply_optimizer_parameters_()

    def _step_in_place(
        self,
        phases: StatePhases,
        wait_for_trigger: Callable[[], Any] | None,
        optimizer_step: bool,
        zero_grad: bool,
        set_to_none: bool,
    ) -> None:
        """The phases of a ``step`` with no round and nothing delayed, in the caller's thread
        (a ``TrainingStateAverager`` that was not started: e.g. the Optimizer's torch side)."""
        if phases.prepare_round or phases.optimizer_in_worker:
            raise RuntimeError("the averager is not running: start it to average or delay steps")
        if phases.increment_epoch:
            self.local_epoch += 1
        if not phases.work:
            return
        if phases.load_local_grads:
            self._load_local_grads()
        self._optimizer_phase(wait_for_trigger, optimizer_step, zero_grad, set_to_none)
        if phases.apply_parameters:
            self._apply_optimizer_parameters()

    def _load_local_grads(self) -> None:
        with self.lock_optimizer:
            self._load_local_grads_into_optimizer_()

    def _apply_optimizer_parameters(self) -> None:
        with self.lock_optimizer:
            self._apply_optimizer_parameters_()

    def _round_finished(self, gathered: dict) -> None:
        """After a successful round: tell ``round_observer``; with
        ``sync_epoch_when_averaging``, take the group's highest epoch."""
        logger.log(self.status_loglevel, "averaged the training state with %d peers", len(gathered))
        if self.round_observer is not None:
            self.round_observer(gathered, self.local_epoch)
        if self.sync_epoch_when_averaging:
            epochs = [
                e for e in gathered.values() if isinstance(e, int) and not isinstance(e, bool)
            ]
            if epochs and max(epochs) > self.local_epoch:
                logger.log(self.status_loglevel, "a peer has a newer epoch (%d)", max(epochs))
                with self.lock_optimizer:
                    self.local_epoch = max(epochs)
                    self._update_scheduler()

    @property
    def _traits(self) -> StateAveragerTraits:
        return StateAveragerTraits(
            offload_optimizer=self.offload_optimizer,
            delta_rule_averaging=self.delta_rule_averaging,
            reuse_tensors=self.reuse_tensors,
            custom_gradients=self.custom_gradients,
        )
