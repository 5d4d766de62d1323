"""The epoch end of ``AsyncOptimizer`` (a mixin): what :class:`EpochCore` decides, awaited.

The decisions are :class:`~swarmtrain.optim.epoch_core.EpochCore`'s (a sans-IO core, where the
table of modes is); this shell does what it decides, in this order: begin the
gradient round (or tag along), wait for it here or hand it to a delayed job
(``swarmtrain.optim._async_delayed``), step the optimizer (in a worker thread, or in the job
with ``delay_optimizer_step``), average the state (here, or in a job with
``delay_state_averaging``), move the tracker to the new epoch. Every touch of tensors guarded by
a ``threading`` lock runs in ``trio.to_thread``, or in place when it is small CPU work
(``swarmtrain.optim._torch_work``: a thread hop costs more than the work). The attributes used
here are set by ``AsyncOptimizer``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
from swarmtrain.optim._async_delayed import DelayedUpdates
from swarmtrain.optim._async_gradient_rounds import AsyncGradientRounds
from swarmtrain.optim._torch_work import TorchWork
from swarmtrain.optim.epoch_core import (
    AuxiliaryCatchUp,
    EpochAdvanced,
    EpochCore,
    FinishEpoch,
    RoundPlan,
    RoundWait,
)
from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.optim.grad_scaler import scaler_method
from swarmtrain.optim.progress_tracker import AsyncProgressTracker
from swarmtrain.optim.state_averager import TrainingStateAverager

__all__ = ["AsyncEpochUpdates"]

logger = logging.getLogger("swarmtrain.optim.optimizer")

T = TypeVar("T")


@dataclass(frozen=True)
class _PendingGradients:
    """A gradient round whose gradients a delayed job uses (and waits for, if ``wait``)."""

    control: StepControl | None
    others_seen: bool
    epoch: int
    wait: bool


class AsyncEpochUpdates:
    """``AsyncOptimizer``'s epoch ends (see the module docstring)."""

    # set by AsyncOptimizer.__init__ / create
    run_id: str
    status_loglevel: int
    averaging_timeout: float
    local_samples_accumulated: float
    last_epoch_samples: float
    state_rounds_averaged: int
    _epoch_core: EpochCore
    _state: TrainingStateAverager
    _grads: GradientAverager | None
    _grad_buffers_match: bool
    _torch: TorchWork  #: runs the torch work (small CPU work in place: ``_torch_work``)
    _rounds: AsyncGradientRounds | None
    _state_service: AsyncDecentralizedAverager | None
    _delayed: DelayedUpdates | None

    if TYPE_CHECKING:  # AsyncOptimizer's properties and methods that the epoch end uses

        @property
        def optimizer(self) -> torch.optim.Optimizer: ...

        @property
        def main_parameters(self) -> tuple[torch.Tensor, ...]: ...

        @property
        def local_epoch(self) -> int: ...

        @property
        def state_averaging_in_progress(self) -> bool: ...

        @property
        def _tracker(self) -> AsyncProgressTracker: ...

        async def _load_state_from_peers(
            self, seconds: float | None, min_epoch: int | None = None
        ) -> bool: ...

    async def _torch_work(self, fn: Callable[..., T], *args: Any) -> T:
        """Torch work under the state averager's locks: in place or in a worker thread."""
        return await self._torch.run(fn, *args)

    @staticmethod
    def _now() -> float:
        """The clock of the catch-up back-off (monotonic; also read outside the loop)."""
        return time.monotonic()

    async def _end_epoch(self, grad_scaler: Any) -> None:
        """End this epoch as the epoch core decides (the module docstring's order)."""
        tracker, core = self._tracker, self._epoch_core
        with tracker.pause_updates():
            plan = core.begin_epoch_end(
                self.local_epoch, tracker.global_progress, grad_scaler is not None
            )
            averaged, pending = None, None
            if plan.tag_along:  # this epoch's round is over: do not disrupt the next one
                assert self._rounds is not None
                await self._rounds.tag_along()
            elif plan.begin_round:
                averaged, pending = await self._gradient_round(plan, grad_scaler)
            decision = core.on_round_result(averaged, self.state_averaging_in_progress)
            if isinstance(decision, AuxiliaryCatchUp):
                await self._auxiliary_catch_up(decision.load_state)
                return
            gathered = await self._finish_epoch(decision, pending)
            swarm_epoch = tracker.global_epoch
            self._advance_epoch(core.on_epoch_finished(self.local_epoch, gathered, swarm_epoch))
        if grad_scaler is not None:
            grad_scaler.on_swarm_epoch_end_()
        logger.log(
            self.status_loglevel,
            "%s: epoch %d (%s state averaging)",
            self.run_id,
            self.local_epoch,
            "with" if decision.average_state else "no",
        )

    async def _gradient_round(
        self, plan: RoundPlan, grad_scaler: Any
    ) -> tuple[bool | None, _PendingGradients | None]:
        """Run the round ``plan`` describes and wait for it here, or leave the wait (and the
        gradients' use) to a delayed job: (whether it averaged, None if not known here; what
        the job does with the gradients)."""
        rounds, grads = self._rounds, self._grads
        assert rounds is not None and grads is not None
        if plan.wait_gradients_consumed:  # the last job took the averaged buffers' content
            await self._delayed_updates().wait_gradients_consumed(self.averaging_timeout)
        weight = plan.weight
        if plan.unscale_before_round:
            params = self.main_parameters
            unscale = scaler_method(grad_scaler, "unscale_swarm_grads_")
            if not await self._torch_work(unscale, params):
                logger.log(
                    self.status_loglevel,
                    "%s: non-finite gradients: this peer contributes weight 0 this epoch",
                    self.run_id,
                )
                await self._torch_work(grads.reset_accumulated_grads_)
                weight = 0.0
        control = await rounds.begin(weight, plan.others_seen, plan.epoch, plan.num_peers_present)
        if plan.wait is RoundWait.IN_WORKER:
            return None, _PendingGradients(control, plan.others_seen, plan.epoch, wait=True)
        averaged = await self._await_gradients(control, plan.others_seen, plan.epoch)
        if plan.wait is RoundWait.HERE_CONSUME_IN_WORKER:
            return averaged, _PendingGradients(control, plan.others_seen, plan.epoch, wait=False)
        return averaged, None

    async def _await_gradients(
        self, control: StepControl | None, others: bool, epoch: int, peers_moved_on: bool = False
    ) -> bool:
        """Wait for the gradient round: whether the group averaged (for an auxiliary peer: this
        epoch's gradients). Else the averaged buffers hold the local mean gradient.
        ``peers_moved_on``: see :meth:`AsyncGradientRounds.finish`."""
        assert self._rounds is not None
        gathered = await self._rounds.finish(control, others, epoch, peers_moved_on=peers_moved_on)
        averaged = self._epoch_core.round_averaged(
            epoch, None if gathered is None else gathered.values()
        )
        if gathered is not None and not averaged:
            logger.log(self.status_loglevel, "%s: the group was in another epoch", self.run_id)
        if averaged and gathered is not None:
            self._note_round_partners(gathered, epoch)
        return averaged

    def _note_round_partners(self, gathered: Mapping[Any, Any], epoch: int) -> None:
        """Tell the tracker who averaged with this peer in a round of ``epoch`` (the members
        that did their part: not in ``gathered.failed``); only such partners vote for epochs
        ahead of ours."""
        failed: Collection[Any] = getattr(gathered, "failed", frozenset())
        partners = [peer for peer in gathered if peer not in failed]
        try:
            self._tracker.on_round_partners(partners, epoch)
        except Exception as e:  # closed meanwhile: nobody needs the partners any more
            logger.debug("%s: round partners not recorded: %r", self.run_id, e)

    async def _finish_epoch(
        self, decision: FinishEpoch, pending: _PendingGradients | None
    ) -> list[Any] | None:
        """The optimizer step and the state round ``decision`` asks for; the epochs of the
        state round's group if it averaged here."""
        state, grads = self._state, self._grads
        if decision.state_round_skipped:  # as hivemind: the next epoch's round will run
            logger.log(
                self.status_loglevel,
                "%s: skipping state averaging: the last round is still running",
                self.run_id,
            )
        if decision.delay_optimizer_step:
            self._delay_step_and_round(decision, pending)
            return None
        if decision.optimizer_step:
            assert grads is not None
            if decision.step_with_averaged_now:

                def step() -> None:
                    with grads.use_averaged_gradients():
                        state.step(increment_epoch=True, optimizer_step=True)

            else:  # offload_optimizer: the averaged buffers go to the optimizer's copies

                def step() -> None:
                    self._load_averaged_gradients_into_optimizer()
                    state.step(increment_epoch=True, optimizer_step=True)

            await self._torch_work(step)
        else:
            state.local_epoch += 1
        if not decision.average_state:
            return None
        gathered = await self._state_round(decision)
        return None if gathered is None else list(gathered.values())

    def _delay_step_and_round(
        self, decision: FinishEpoch, pending: _PendingGradients | None
    ) -> None:
        """``delay_optimizer_step``: move to the next epoch now; queue a job that (waits for
        the round and) loads the averaged gradients, steps the optimizer and runs the state
        round, whose matchmaking starts now (``TrainingStateAverager.step``'s order)."""
        state, service = self._state, self._state_service
        assert service is not None
        state.local_epoch += 1
        control = None
        if decision.average_state:
            control = service.start_step(
                gather=state.local_epoch,
                weight=decision.state_round_weight,
                timeout=self.averaging_timeout,
                require_trigger=True,
            )
        gradients = None
        if pending is not None and pending.wait:
            gradients = partial(
                self._await_gradients,
                pending.control,
                pending.others_seen,
                pending.epoch,
                peers_moved_on=True,
            )
        self._delayed_updates().start(
            gradients=gradients,
            consume=self._load_averaged_gradients_into_optimizer,
            optimizer_step=True,
            state_round=control,
        )

    def _delayed_updates(self) -> DelayedUpdates:
        if self._delayed is None:
            raise RuntimeError("this Optimizer is not running: use `async with Optimizer.create`")
        return self._delayed

    def _load_averaged_gradients_into_optimizer(self) -> None:
        """(Worker thread) the averaged gradients into the optimizer's CPU copies' ``.grad``."""
        grads = self._grads
        assert grads is not None
        opt_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not self._grad_buffers_match:  # the averager rebuilds the gradients (PowerSGD)
            with torch.no_grad(), grads.use_averaged_gradients():
                self._copy_grads(opt_params, [p.grad for p in self.main_parameters])
            return
        with torch.no_grad(), grads.get_tensors() as averaged:
            self._copy_grads(opt_params, averaged)
        grads.notify_used_averaged_gradients()

    @staticmethod
    def _copy_grads(targets: Sequence[torch.Tensor], grads: Sequence[Any]) -> None:
        for target, grad in zip(targets, grads, strict=True):
            if grad is None:
                continue
            if target.grad is None or target.grad.shape != target.shape:
                target.grad = torch.zeros_like(target)
            target.grad.copy_(grad)

    async def _state_round(self, decision: FinishEpoch) -> dict | None:
        """Average the training state as of now: waited for here, or (delayed) in a task of
        this optimizer whose result a later step applies."""
        delayed = self._delayed_updates()
        await delayed.apply_finished()  # before its buffers are loaded again
        control = await self._begin_state_round(decision.state_round_weight, self.averaging_timeout)
        if decision.delay_state_averaging:
            delayed.start(state_round=control, inputs_loaded=True)
            return None
        return await self._finish_state_round(control)

    async def _begin_state_round(self, weight: float | None, round_timeout: float) -> StepControl:
        """Start a state round gathering our epoch, load the state as of now into it, let it
        run."""
        service, state = self._state_service, self._state
        assert service is not None
        control = service.start_step(
            gather=state.local_epoch, weight=weight, timeout=round_timeout, require_trigger=True
        )
        try:
            await self._torch_work(state._load_round_inputs, control)
        except BaseException:
            control.cancel()
            raise
        control.allow_allreduce()
        return control

    async def _finish_state_round(self, control: StepControl) -> dict | None:
        """Wait for a state round and apply its result: the gathered data, None if it failed."""
        gathered = await self._wait_state_round(control)
        if gathered is not None:
            await self._torch_work(self._state._apply_round)
        return gathered

    async def _wait_state_round(self, control: StepControl) -> dict | None:
        try:
            gathered = await control.wait_result()
        except Exception as e:
            control.cancel()
            logger.log(self.status_loglevel, "%s: state averaging failed: %r", self.run_id, e)
            return None
        except BaseException:
            control.cancel()
            raise
        self.state_rounds_averaged += 1
        self._note_round_partners(gathered, self._state.local_epoch)
        logger.log(
            self.status_loglevel,
            "%s: averaged the training state with %d peers",
            self.run_id,
            len(gathered),
        )
        return dict(gathered)

    async def _auxiliary_catch_up(self, load_state: bool) -> None:
        """An auxiliary peer that missed this epoch's gradients loads the state instead (if
        ``load_state``: others are seen; once the swarm left this epoch, the state after its
        step: ``EpochCore.auxiliary_catch_up_epoch``), else moves to the next epoch on its own.
        If the load fails while donors exist it stays in this epoch
        (``EpochCore.after_failed_auxiliary_catch_up``): its next step tries again once the
        back-off allows (``Optimizer._auxiliary_catch_up``'s rule)."""
        assert self._grads is not None and self._state_service is not None
        self._grads.notify_used_averaged_gradients()
        core, no_donor = self._epoch_core, True
        if load_state:
            if not core.catch_up_due(self._now()):
                return  # the last try failed: wait for the back-off, in this epoch
            least = core.auxiliary_catch_up_epoch(self.local_epoch, self._tracker.global_epoch)
            if await self._load_state_from_peers(self.averaging_timeout, least):
                return
            failure = self._state_service.state_download_failure
            no_donor = failure is not None and not failure.donors
        enter = core.after_failed_auxiliary_catch_up(self.local_epoch, no_donor, now=self._now())
        if enter is None:
            logger.warning(
                "%s: this auxiliary peer missed epoch %d's gradients and could not load the "
                "state after it: staying in epoch %d, next try in %.0f s",
                self.run_id,
                self.local_epoch,
                self.local_epoch,
                core.retry_in,
            )
            return
        self._state.local_epoch += 1
        self._tracker.update_epoch(self.local_epoch)

    def _advance_epoch(self, advanced: EpochAdvanced) -> None:
        if advanced.adopted_from is not None:
            logger.log(
                self.status_loglevel,
                "%s: the state round's group was in epoch %d: moving there from epoch %d",
                self.run_id,
                advanced.epoch,
                advanced.adopted_from,
            )
            self._state.local_epoch = advanced.epoch
        self.last_epoch_samples = self.local_samples_accumulated
        self.local_samples_accumulated = 0.0
        self._tracker.update_epoch(advanced.epoch)
        if advanced.serve_state:
            assert self._state_service is not None
            self._state_service.state_sharing_priority = advanced.epoch
