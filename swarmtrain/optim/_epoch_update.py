"""The epoch machinery of ``Optimizer`` (a mixin): accumulate a batch, end an epoch.

The decisions are :class:`~swarmtrain.optim.epoch_core.EpochCore`'s (a sans-IO core, where the
table of modes is); this shell does what it decides. :meth:`EpochUpdates._update_global_epoch`
runs, in the trainer's thread, in this order: begin the gradient round (load the accumulators,
trigger the pre-scheduled group), wait for the last epoch's background work, then either wait
for the round here or hand the wait to the state averager's worker (``delay_grad_averaging``),
step the optimizer (in the background with ``delay_optimizer_step``), average the state, move
the tracker to the new epoch. See ``swarmtrain.optim.optimizer`` for the semantics; the
attributes used here are set by ``Optimizer.__init__``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.finite import first_non_finite
from swarmtrain.optim.epoch_core import (
    AuxiliaryCatchUp,
    BatchCheck,
    EpochAdvanced,
    EpochCore,
    FinishEpoch,
    RoundPlan,
    RoundWait,
    SkipBatch,
)

if TYPE_CHECKING:
    from swarmtrain.optim.progress_tracker_blocking import ProgressTracker
    from swarmtrain.optim.state_averager import TrainingStateAverager

__all__ = ["EpochUpdates", "scaler_method"]

logger = logging.getLogger("swarmtrain.optim.optimizer")


def scaler_method(grad_scaler: Any, name: str) -> Callable[..., Any]:
    method = getattr(grad_scaler, name, None)
    if not callable(method):
        raise TypeError(
            f"grad_scaler must be a swarmtrain.optim.GradScaler (a {type(grad_scaler).__name__} "
            f"has no {name}()): a plain torch GradScaler unscales at the wrong time"
        )
    return method


class EpochUpdates:
    """``Optimizer``'s epoch steps (see the module docstring)."""

    # set by Optimizer.__init__
    run_id: str
    auxiliary: bool
    client_mode: bool
    use_local_updates: bool
    reuse_grad_buffers: bool
    offload_optimizer: bool
    delay_optimizer_step: bool
    delay_grad_averaging: bool
    delay_state_averaging: bool
    average_state_every: int
    averaging_timeout: float
    status_loglevel: int
    local_samples_accumulated: float
    last_epoch_samples: float
    grad_averager: Any
    _epoch_core: EpochCore
    _rounds: Any
    _gradients_consumed: Any
    _grad_buffers_match: bool

    if TYPE_CHECKING:  # Optimizer's properties and methods that the epoch steps use

        @property
        def optimizer(self) -> torch.optim.Optimizer: ...

        @property
        def main_parameters(self) -> tuple[torch.Tensor, ...]: ...

        @property
        def local_epoch(self) -> int: ...

        @property
        def _state_averager(self) -> TrainingStateAverager: ...

        @property
        def _tracker(self) -> ProgressTracker: ...

        def _load_state(self, timeout: float | None, min_epoch: int | None = None) -> bool: ...

    @property
    def skipped_batches(self) -> int:
        """Batches dropped for non-finite gradients."""
        return self._epoch_core.statistics().batches_skipped

    def _accumulate(self, batch_size: int, grad_scaler: Any) -> bool:
        """Take this batch into account (an optimizer step with ``use_local_updates``);
        False if it was dropped for non-finite gradients."""
        check = self._epoch_core.batch_check(grad_scaler is not None)
        finite = True
        if check is BatchCheck.UNSCALE:
            finite = scaler_method(grad_scaler, "unscale_swarm_grads_")(self.main_parameters)
        elif check is BatchCheck.CHECK_FINITE:
            grads = [p.grad for p in self.main_parameters if p.grad is not None]
            finite = first_non_finite(grads) is None
        decision = self._epoch_core.on_batch(check, bool(finite))
        if isinstance(decision, SkipBatch):
            self._skip_batch(decision)
            return False
        if decision.local_step:
            self._state_averager.step(
                optimizer_step=True, delay_optimizer_step=decision.delay_optimizer_step
            )
        else:
            assert self.grad_averager is not None
            self.grad_averager.accumulate_grads_(batch_size)
        self.local_samples_accumulated += batch_size
        self._tracker.report_local_progress(self.local_epoch, int(self.local_samples_accumulated))
        return True

    def _skip_batch(self, decision: SkipBatch) -> None:
        """Drop a batch whose gradients are non-finite: NaN or inf would otherwise reach this
        peer's optimizer (peers never send them: ``swarmtrain.averaging.finite``). With
        ``reuse_grad_buffers`` the ``.grad`` buffers hold the whole epoch's sum, which is lost:
        the accumulators start over."""
        if decision.reset_accumulators:
            assert self.grad_averager is not None
            self.grad_averager.reset_accumulated_grads_()
            self.local_samples_accumulated = 0.0
        if decision.clear_grads:
            for param in self.main_parameters:
                param.grad = None
        if not decision.warn:
            logger.debug("%s: non-finite gradients: skipping this batch", self.run_id)
            return
        logger.warning(
            "%s: this batch's gradients hold NaN or inf: the batch is dropped (%d so far%s)",
            self.run_id,
            self.skipped_batches,
            "; the epoch's accumulated gradients too" if self.reuse_grad_buffers else "",
        )

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        """End this epoch as the epoch core decides (see the module docstring)."""
        tracker, core = self._tracker, self._epoch_core
        with tracker.pause_updates():
            plan = core.begin_epoch_end(
                self.local_epoch, tracker.global_progress, grad_scaler is not None
            )
            averaged, wait_for_trigger = None, None
            if plan.tag_along:  # this epoch's round is over: do not disrupt the next one
                assert self._rounds is not None
                self._rounds.tag_along()
            elif plan.begin_round:
                averaged, wait_for_trigger = self._run_gradient_round(plan, grad_scaler)
            decision = core.on_round_result(averaged, self._state_averager.averaging_in_progress)
            if isinstance(decision, AuxiliaryCatchUp):
                self._auxiliary_catch_up(decision.load_state)
                return
            gathered = self._finish_epoch(decision, wait_for_trigger)
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

    def _finish_epoch(
        self, decision: FinishEpoch, wait_for_trigger: Callable[[], Any] | None
    ) -> Collection[Any] | None:
        """The optimizer step and the state round ``decision`` asks for; the epochs of the
        state round's group if it averaged here."""
        state_averager = self._state_averager
        if decision.state_round_skipped:  # as hivemind: the next epoch's round will run
            logger.log(
                self.status_loglevel,
                "%s: skipping state averaging: the last round is still running",
                self.run_id,
            )
        averaging_opts = None
        if decision.average_state:
            averaging_opts = {"timeout": self.averaging_timeout}
            if decision.state_round_weight is not None:  # receive the average, do not pull
                averaging_opts["weight"] = decision.state_round_weight
        optimizer_step = decision.optimizer_step
        if decision.step_with_averaged_now:
            assert self.grad_averager is not None
            with self.grad_averager.use_averaged_gradients():
                state_averager.step(increment_epoch=True, optimizer_step=True)
            optimizer_step = False
        try:
            gathered = state_averager.step(
                increment_epoch=decision.increment_in_state_step,
                optimizer_step=optimizer_step,
                wait_for_trigger=wait_for_trigger if optimizer_step else None,
                delay_optimizer_step=decision.delay_optimizer_step and optimizer_step,
                averaging_round=decision.average_state,
                delay_averaging=decision.delay_state_averaging,
                averaging_opts=averaging_opts,
            )
        except BaseException:
            self._gradients_consumed.set()  # nothing will consume them
            raise
        return gathered.values() if gathered else None

    def _advance_epoch(self, advanced: EpochAdvanced) -> None:
        """Move to ``advanced.epoch`` (maybe the state group's): reset the samples, tell the
        tracker, serve the state at that priority."""
        state_averager = self._state_averager
        if advanced.adopted_from is not None:
            logger.log(
                self.status_loglevel,
                "%s: the state round's group was in epoch %d: moving there from epoch %d",
                self.run_id,
                advanced.epoch,
                advanced.adopted_from,
            )
            state_averager.local_epoch = advanced.epoch
        self.last_epoch_samples = self.local_samples_accumulated
        self.local_samples_accumulated = 0.0
        self._tracker.update_epoch(advanced.epoch)
        if advanced.serve_state:
            state_averager.state_sharing_priority = advanced.epoch

    def _run_gradient_round(
        self, plan: RoundPlan, grad_scaler: Any
    ) -> tuple[bool | None, Callable[[], Any] | None]:
        """Start the round ``plan`` describes and wait for it here or hand the wait to the
        worker thread: (whether it averaged, None if not known here; the worker's trigger)."""
        assert self._rounds is not None
        if plan.wait_gradients_consumed:  # the optimizer took the last round's result
            self._wait_gradients_consumed()
        weight = self._gradient_weight(plan, grad_scaler)
        control = self._rounds.begin(weight, plan.others_seen, plan.epoch, plan.num_peers_present)
        args = (control, plan.others_seen, plan.epoch)
        averaged = None
        wait_for_trigger: Callable[[], Any] | None = None
        if plan.wait is RoundWait.IN_WORKER:
            wait_for_trigger = partial(self._finish_gradients, *args)
        elif plan.wait is RoundWait.HERE_CONSUME_IN_WORKER:  # load them in the worker thread
            averaged = self._await_gradients(*args)
            wait_for_trigger = self._consume_gradients
        else:
            averaged = self._finish_gradients(*args)
        if wait_for_trigger is not None:
            self._gradients_consumed.clear()
        return averaged, wait_for_trigger

    def _gradient_weight(self, plan: RoundPlan, grad_scaler: Any) -> float | None:
        """This peer's weight in the gradient round (None: the samples it accumulated)."""
        if plan.unscale_before_round:
            assert self.grad_averager is not None
            if not scaler_method(grad_scaler, "unscale_swarm_grads_")(self.main_parameters):
                logger.log(
                    self.status_loglevel,
                    "%s: non-finite gradients: this peer contributes weight 0 this epoch",
                    self.run_id,
                )
                self.grad_averager.reset_accumulated_grads_()
                return 0.0
        return plan.weight

    def _wait_gradients_consumed(self) -> None:
        if not self._gradients_consumed.wait(self.averaging_timeout):
            logger.warning(
                "%s: the last gradient round did not finish in %.0f s (averaging_timeout)",
                self.run_id,
                self.averaging_timeout,
            )

    def _await_gradients(self, control: StepControl | None, others: bool, epoch: int) -> bool:
        """Wait for the gradient round: whether the group averaged (for an auxiliary peer:
        this epoch's gradients). Else the averaged buffers hold the local mean gradient."""
        assert self._rounds is not None
        gathered = self._rounds.finish(control, others, epoch)
        averaged = self._epoch_core.round_averaged(
            epoch, None if gathered is None else gathered.values()
        )
        if gathered is not None and not averaged:
            logger.log(self.status_loglevel, "%s: the group was in another epoch", self.run_id)
        if averaged and gathered is not None:
            self._note_round_partners(gathered, epoch)
        return averaged

    def _note_round_partners(self, gathered: Mapping[Any, Any], epoch: int) -> None:
        """Tell the tracker who averaged with this peer in a round of ``epoch``: the members
        that sent their parts and returned our deltas (``gathered.failed`` did not). Only such
        partners vote for epochs ahead of ours (``swarmtrain.optim.progress_core``). Runs in
        the trainer's thread or the state averager's worker."""
        failed: Collection[Any] = getattr(gathered, "failed", frozenset())
        partners = [peer for peer in gathered if peer not in failed]
        try:
            self._tracker.on_round_partners(partners, epoch)
        except Exception as e:  # shut down meanwhile: nobody needs the partners any more
            logger.debug("%s: round partners not recorded: %r", self.run_id, e)

    def _consume_gradients(self) -> None:
        """With ``offload_optimizer``, put the averaged buffers into the optimizer's ``.grad``;
        runs in the state averager's worker thread with ``delay_optimizer_step``."""
        try:
            if self.offload_optimizer:
                self._load_averaged_gradients_into_optimizer()
        finally:
            self._gradients_consumed.set()

    def _finish_gradients(self, control: StepControl | None, others: bool, epoch: int) -> bool:
        """:meth:`_await_gradients`, then :meth:`_consume_gradients`."""
        try:
            return self._await_gradients(control, others, epoch)
        finally:
            self._consume_gradients()

    def _auxiliary_catch_up(self, load_state: bool) -> None:
        """An auxiliary peer that missed this epoch's gradients loads the state instead (if
        ``load_state``: others are seen; once the swarm left this epoch, the state after its
        step: ``EpochCore.auxiliary_catch_up_epoch``), else moves to the next epoch on its own.
        If the load fails while donors exist it stays in this epoch
        (``EpochCore.after_failed_auxiliary_catch_up``): its next step tries again once the
        back-off allows."""
        assert self.grad_averager is not None
        self.grad_averager.notify_used_averaged_gradients()
        core, no_donor = self._epoch_core, True
        if load_state:
            if not core.catch_up_due(time.monotonic()):
                return  # the last try failed: wait for the back-off, in this epoch
            least = core.auxiliary_catch_up_epoch(self.local_epoch, self._tracker.global_epoch)
            if self._load_state(self.averaging_timeout, min_epoch=least):
                return
            failure = self._state_averager.state_download_failure
            no_donor = failure is not None and not failure.donors
        enter = core.after_failed_auxiliary_catch_up(
            self.local_epoch, no_donor, now=time.monotonic()
        )
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
        self._state_averager.step(increment_epoch=True)
        self._tracker.update_epoch(self.local_epoch)

    @torch.no_grad()
    def _load_averaged_gradients_into_optimizer(self) -> None:
        assert self.grad_averager is not None
        opt_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self._grad_buffers_match:
            with self.grad_averager.get_tensors() as averaged:
                self._copy_grads(opt_params, averaged)
            self.grad_averager.notify_used_averaged_gradients()
        else:  # the averager rebuilds the gradients itself (trainer's thread only)
            with self.grad_averager.use_averaged_gradients():
                self._copy_grads(opt_params, [p.grad for p in self.main_parameters])

    @staticmethod
    def _copy_grads(targets: Sequence[torch.Tensor], grads: Sequence[Any]) -> None:
        for target, grad in zip(targets, grads, strict=True):
            if grad is None:
                continue
            if target.grad is None or target.grad.shape != target.shape:
                target.grad = torch.zeros_like(target)
            target.grad.copy_(grad)
