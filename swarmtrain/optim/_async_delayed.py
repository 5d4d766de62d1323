"""The delayed work of ``AsyncOptimizer``'s epoch ends: tasks of its nursery, one at a time.

Delayed work runs as a *job* in the task group of its owner (the optimizer's, or a standalone
``AsyncTrainingStateAverager``'s); a job waits for the previous one, so jobs run in
order. A job does, each part optionally:

1. wait for the epoch's gradient round (``delay_grad_averaging``), then put the averaged
   gradients into the optimizer's copies (``delay_optimizer_step``); the trainer's next round
   waits for that (:meth:`DelayedUpdates.wait_gradients_consumed`), since it reloads the
   averaged buffers;
2. ``wait_for_trigger`` (awaited, or a plain callable run in a worker thread), then the optimizer
   step and/or ``zero_grad`` (in a worker thread, under the state averager's locks);
3. a state round: its inputs are loaded (after the step), all-reduce runs, it is waited for.

Nothing a job computes reaches the model until the trainer's next ``step`` calls
:meth:`DelayedUpdates.apply_finished` (hivemind's "apply delayed updates"): a finished state
round is applied (``TrainingStateAverager._apply_round``), or the finished optimizer step's
parameters are copied into the model. Torch work runs in ``trio.to_thread``, or in place when it
is small CPU work (``torch_work``: see ``swarmtrain.optim._torch_work``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from swarmtrain.averaging import StepControl
from swarmtrain.optim._torch_work import TorchWork

if TYPE_CHECKING:  # the state averager's trio form uses this class too
    from swarmtrain.optim._state_phases import StateTensors

__all__ = ["DelayedUpdates"]

logger = logging.getLogger("swarmtrain.optim.optimizer")


class DelayedUpdates:
    """The job chain of one ``AsyncOptimizer`` (see the module docstring).

    :param nursery: the optimizer's task group (leaving it cancels running jobs; a cancelled
      round's control is cancelled, so its group is not left waiting)
    :param state: the torch side of the state averager (optimizer, locks, copies)
    :param wait_state_round: waits for a state round's control: the gathered data, or None
      if it failed (logged)
    :param torch_work: runs the torch work (default: always in a worker thread)
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        state: StateTensors,
        *,
        run_id: str,
        status_loglevel: int,
        wait_state_round: Callable[[StepControl], Awaitable[dict | None]],
        torch_work: TorchWork | None = None,
    ):
        self._nursery, self._state = nursery, state
        self.run_id, self.status_loglevel = run_id, status_loglevel
        self._wait_state_round = wait_state_round
        self._torch_work = torch_work or TorchWork()
        self._last_done: trio.Event | None = None  # the last job's
        self._round_done: trio.Event | None = None  # the last job with a state round's
        self._round_averaged = False  # finished, not applied yet
        self._step_finished = False  # finished, its parameters not copied into the model yet
        self._gradients_consumed = trio.Event()
        self._gradients_consumed.set()

    @property
    def round_in_progress(self) -> bool:
        """Whether a delayed state round still runs (a delayed optimizer step alone does not
        count: peers would skip their state rounds at random)."""
        return self._round_done is not None and not self._round_done.is_set()

    @property
    def finished_unapplied(self) -> bool:
        """Whether :meth:`apply_finished` has something to apply (readable from any thread)."""
        return self._step_finished or (self._round_averaged and not self.round_in_progress)

    def start(
        self,
        *,
        gradients: Callable[[], Awaitable[Any]] | None = None,
        consume: Callable[[], None] | None = None,
        optimizer_step: bool = False,
        state_round: StepControl | None = None,
        inputs_loaded: bool = False,
        zero_grad: bool = False,
        set_to_none: bool = True,
        wait_for_trigger: Callable[[], Any] | None = None,
    ) -> None:
        """Queue a job: wait for ``gradients()``, run ``consume`` (in a worker thread), wait
        for ``wait_for_trigger``, the optimizer step and/or ``zero_grad``, then the state round
        of ``state_round`` (its inputs loaded first, unless ``inputs_loaded``: then all-reduce
        was allowed by the caller, and the round averages the state as of then)."""
        step = _StepPhase(optimizer_step, zero_grad, set_to_none, wait_for_trigger)
        previous = self._last_done
        done = self._last_done = trio.Event()
        if state_round is not None:
            self._round_done = done
        if gradients is not None or consume is not None:
            self._gradients_consumed = trio.Event()
        self._nursery.start_soon(
            self._job,
            previous,
            done,
            gradients,
            consume,
            step,
            state_round,
            inputs_loaded,
        )

    async def _job(
        self,
        previous: trio.Event | None,
        done: trio.Event,
        gradients: Callable[[], Awaitable[Any]] | None,
        consume: Callable[[], None] | None,
        step: _StepPhase,
        state_round: StepControl | None,
        inputs_loaded: bool,
    ) -> None:
        try:
            if previous is not None:
                await previous.wait()
            await self._run(gradients, consume, step, state_round, inputs_loaded)
        except Exception:
            logger.exception("%s: delayed work of an epoch failed", self.run_id)
            if state_round is not None:
                state_round.cancel()
        except BaseException:
            if state_round is not None:
                state_round.cancel()
            raise
        finally:
            done.set()

    async def _run(
        self,
        gradients: Callable[[], Awaitable[Any]] | None,
        consume: Callable[[], None] | None,
        step: _StepPhase,
        state_round: StepControl | None,
        inputs_loaded: bool,
    ) -> None:
        if gradients is not None or consume is not None:
            try:
                if gradients is not None:
                    await gradients()
                if consume is not None:
                    await self._torch_work.run(consume)
            finally:
                self._gradients_consumed.set()
        if step.runs:
            try:
                await step.run(self._state, self._torch_work)
            except Exception:
                logger.exception(
                    "%s: a delayed optimizer step failed; its state round is dropped", self.run_id
                )
                if state_round is not None:
                    state_round.cancel()
                return
            self._step_finished = True
        if state_round is not None:
            if not inputs_loaded:
                await self._torch_work.run(self._state._load_round_inputs, state_round)
                state_round.allow_allreduce()
            if await self._wait_state_round(state_round) is not None:
                self._round_averaged = True

    async def apply_finished(self) -> None:
        """Apply what finished jobs computed: a state round's result, or an optimizer step's
        new parameters (copied into the model)."""
        state = self._state
        if self._round_averaged and not self.round_in_progress:
            self._round_averaged = self._step_finished = False  # _apply_round copies both
            await self._torch_work.run(state._apply_round)
            logger.log(self.status_loglevel, "%s: applied a delayed state round", self.run_id)
        if self._step_finished:
            self._step_finished = False
            if state.offload_optimizer:
                await self._torch_work.run(self._copy_parameters)

    def _copy_parameters(self) -> None:
        state = self._state
        with state.lock_optimizer, state.lock_averaged_tensors:
            state._apply_optimizer_parameters_()

    async def wait_jobs(self) -> None:
        """Wait for every queued job (their errors were logged); apply nothing."""
        if self._last_done is not None:
            await self._last_done.wait()

    async def wait_all(self) -> None:
        """Wait for every queued job, then apply what they computed."""
        await self.wait_jobs()
        await self.apply_finished()

    async def wait_gradients_consumed(self, timeout: float) -> None:  # noqa: ASYNC109
        """Wait until the last job took the averaged gradients (at most ``timeout`` s)."""
        with trio.move_on_after(timeout):
            await self._gradients_consumed.wait()
            return
        logger.warning(
            "%s: the last gradient round did not finish in %.0f s (averaging_timeout)",
            self.run_id,
            timeout,
        )


class _StepPhase:
    """The optimizer part of a job: ``wait_for_trigger``, then an optimizer step and/or
    ``zero_grad`` in a worker thread."""

    __slots__ = ("optimizer_step", "set_to_none", "wait_for_trigger", "zero_grad")

    def __init__(
        self,
        optimizer_step: bool,
        zero_grad: bool,
        set_to_none: bool,
        wait_for_trigger: Callable[[], Any] | None,
    ):
        self.optimizer_step, self.zero_grad = optimizer_step, zero_grad
        self.set_to_none, self.wait_for_trigger = set_to_none, wait_for_trigger

    @property
    def runs(self) -> bool:
        return self.optimizer_step or self.zero_grad or self.wait_for_trigger is not None

    async def run(self, state: StateTensors, torch_work: TorchWork) -> None:
        await call_trigger(self.wait_for_trigger)
        await torch_work.run(
            state._optimizer_phase, None, self.optimizer_step, self.zero_grad, self.set_to_none
        )


async def call_trigger(trigger: Callable[[], Any] | None) -> None:
    """Wait for ``trigger``: awaited if it is an async function (or returns an awaitable),
    else called in a worker thread (a blocking wait must not hold the loop)."""
    if trigger is None:
        return
    if inspect.iscoroutinefunction(trigger):
        await trigger()
        return
    result = await trio.to_thread.run_sync(trigger)
    if inspect.isawaitable(result):
        await result
