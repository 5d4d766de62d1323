"""The epoch machinery of ``Optimizer`` (a mixin): accumulate a batch, end an epoch.

:meth:`EpochUpdates._update_global_epoch` runs, in the trainer's thread, in this order: begin
the gradient round (load the accumulators, trigger the pre-scheduled group), wait for the last
epoch's background work, then either wait for the round here or hand the wait to the state
averager's worker (``delay_grad_averaging``), step the optimizer (in the background with
``delay_optimizer_step``), average the state, move the tracker to the new epoch. See
``swarmtrain.optim.optimizer`` for the semantics; the attributes used here are set by
``Optimizer.__init__``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.finite import first_non_finite

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
    skipped_batches: int
    grad_averager: Any
    _rounds: Any
    _gradients_consumed: Any

    def _accumulate(self, batch_size: int, grad_scaler: Any) -> bool:
        """Take this batch into account (an optimizer step with ``use_local_updates``);
        False if it was dropped for non-finite gradients."""
        unscale_now = grad_scaler is not None and not self.reuse_grad_buffers
        if unscale_now and not scaler_method(grad_scaler, "unscale_swarm_grads_")(
            self.main_parameters
        ):
            self.skipped_batches += 1
            logger.debug("%s: non-finite gradients: skipping this batch", self.run_id)
            return False
        if grad_scaler is None and not self._gradients_finite():
            return False
        if self.use_local_updates:
            self._state_averager.step(
                optimizer_step=True, delay_optimizer_step=self.delay_optimizer_step
            )
        else:
            assert self.grad_averager is not None
            self.grad_averager.accumulate_grads_(batch_size)
        self.local_samples_accumulated += batch_size
        self._tracker.report_local_progress(self.local_epoch, int(self.local_samples_accumulated))
        return True

    def _others_seen(self, progress: Any = None) -> bool:
        """Whether the tracker sees other peers (an auxiliary peer does not count itself)."""
        if progress is None:
            progress = self._tracker.global_progress
        return progress.num_peers > (0 if self.auxiliary else 1)

    def _peers_present(self, progress: Any = None) -> int:
        """Peers the tracker counts, plus this one if it is auxiliary (it is not counted)."""
        if progress is None:
            progress = self._tracker.global_progress
        return progress.num_peers + (1 if self.auxiliary else 0)

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        tracker, state_averager = self._tracker, self._state_averager
        with tracker.pause_updates():
            others = self._others_seen()
            round_ok, wait_for_trigger, control = True, None, None
            if self.auxiliary and tracker.global_epoch > self.local_epoch:
                assert self._rounds is not None  # this epoch's round is over: do not disrupt
                self._rounds.tag_along()  # the next one
                round_ok = False
            elif self._rounds is not None:
                if self.delay_optimizer_step:  # the optimizer took the last round's result
                    self._wait_gradients_consumed()
                weight = self._gradient_weight(grad_scaler)
                control = self._rounds.begin(
                    weight, others, self.local_epoch, self._peers_present()
                )
            if self._rounds is not None and round_ok:
                epoch = self.local_epoch
                if self.delay_grad_averaging:  # wait for the round in the worker thread
                    wait_for_trigger = partial(self._finish_gradients, control, others, epoch)
                elif self.delay_optimizer_step:  # wait here, load them in the worker thread
                    round_ok = self._await_gradients(control, others, epoch)
                    wait_for_trigger = self._consume_gradients
                else:
                    round_ok = self._finish_gradients(control, others, epoch)
                if wait_for_trigger is not None:
                    self._gradients_consumed.clear()
            if self.auxiliary and not round_ok:
                self._auxiliary_catch_up(others)
                return
            next_epoch = self.local_epoch + 1
            average_state = others and next_epoch % self.average_state_every == 0
            if (
                average_state
                and self.delay_state_averaging
                and state_averager.averaging_in_progress
            ):
                logger.log(
                    self.status_loglevel,
                    "%s: skipping state averaging: the last round is still running",
                    self.run_id,
                )
                average_state = False  # as hivemind does: the next epoch's round will run
            optimizer_step = self.grad_averager is not None and (round_ok or not self.auxiliary)
            averaging_opts = None
            if average_state:
                averaging_opts = {"timeout": self.averaging_timeout}
                if self.auxiliary:
                    averaging_opts["weight"] = 0.0  # receive the average, do not pull it
            increment_epoch = True
            if optimizer_step and not self.offload_optimizer:
                assert self.grad_averager is not None
                with self.grad_averager.use_averaged_gradients():
                    state_averager.step(increment_epoch=True, optimizer_step=True)
                optimizer_step = increment_epoch = False
            elif self.grad_averager is not None and not optimizer_step:
                self.grad_averager.notify_used_averaged_gradients()
            try:
                gathered = state_averager.step(
                    increment_epoch=increment_epoch,
                    optimizer_step=optimizer_step,
                    wait_for_trigger=wait_for_trigger if optimizer_step else None,
                    delay_optimizer_step=self.delay_optimizer_step and optimizer_step,
                    averaging_round=average_state,
                    delay_averaging=self.delay_state_averaging,
                    averaging_opts=averaging_opts,
                )
            except BaseException:
                self._gradients_consumed.set()  # nothing will consume them
                raise
            self._adopt_group_epoch(gathered)
            self.last_epoch_samples = self.local_samples_accumulated
            self.local_samples_accumulated = 0.0
            tracker.update_epoch(self.local_epoch)
            if not self.client_mode:
                state_averager.state_sharing_priority = self.local_epoch
        if grad_scaler is not None:
            grad_scaler.on_swarm_epoch_end_()
        logger.log(
            self.status_loglevel,
            "%s: epoch %d (%s state averaging)",
            self.run_id,
            self.local_epoch,
            "with" if average_state else "no",
        )

    def _adopt_group_epoch(self, gathered: dict | None) -> None:
        """After a state round that averaged here (``delay_state_averaging=False``), this peer
        holds its group's state: if the group was in a later epoch (this peer's gradient round
        failed because the swarm had moved on), this peer is in that epoch too. Without this, a
        peer whose epoch ends when the swarm's state round lets it would stay one epoch behind
        for good."""
        epochs = [
            e for e in (gathered or {}).values() if isinstance(e, int) and not isinstance(e, bool)
        ]
        if epochs and max(epochs) > self.local_epoch:
            logger.log(
                self.status_loglevel,
                "%s: the state round's group was in epoch %d: moving there from epoch %d",
                self.run_id,
                max(epochs),
                self.local_epoch,
            )
            self._state_averager.local_epoch = max(epochs)

    def _gradients_finite(self) -> bool:
        """Whether this batch's gradients are finite; else the batch is dropped with a warning
        (without a GradScaler, which does this itself): NaN or inf would otherwise reach this
        peer's optimizer (peers never send them: ``swarmtrain.averaging.finite``). With
        ``reuse_grad_buffers`` the ``.grad`` buffers hold the whole epoch's sum, which is lost:
        the accumulators start over."""
        grads = [p.grad for p in self.main_parameters if p.grad is not None]
        if first_non_finite(grads) is None:
            return True
        self.skipped_batches += 1
        if self.reuse_grad_buffers and self.grad_averager is not None:
            self.grad_averager.reset_accumulated_grads_()
            self.local_samples_accumulated = 0.0
        elif self.reuse_grad_buffers or self.use_local_updates:
            for param in self.main_parameters:
                param.grad = None
        logger.warning(
            "%s: this batch's gradients hold NaN or inf: the batch is dropped (%d so far%s)",
            self.run_id,
            self.skipped_batches,
            "; the epoch's accumulated gradients too" if self.reuse_grad_buffers else "",
        )
        return False

    def _gradient_weight(self, grad_scaler: Any) -> float | None:
        """This peer's weight in the gradient round (None: the samples it accumulated)."""
        if self.auxiliary:
            return 0.0
        if grad_scaler is not None and self.reuse_grad_buffers:
            assert self.grad_averager is not None
            if not scaler_method(grad_scaler, "unscale_swarm_grads_")(self.main_parameters):
                logger.log(
                    self.status_loglevel,
                    "%s: non-finite gradients: this peer contributes weight 0 this epoch",
                    self.run_id,
                )
                self.grad_averager.reset_accumulated_grads_()
                return 0.0
        return None

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
        if self.auxiliary and gathered is not None and any(e != epoch for e in gathered.values()):
            logger.log(self.status_loglevel, "%s: the group was in another epoch", self.run_id)
            return False
        return gathered is not None

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

    def _auxiliary_catch_up(self, others: bool) -> None:
        """An auxiliary peer that missed this epoch's gradients loads the state instead."""
        assert self.grad_averager is not None
        self.grad_averager.notify_used_averaged_gradients()
        if others and self.load_state_from_peers(timeout=self.averaging_timeout):
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
