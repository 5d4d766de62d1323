"""``AsyncTrainingStateAverager``: the trio implementation of ``TrainingStateAverager``.

::

    async with DHT.create(initial_peers=[...]) as dht:
        async with TrainingStateAverager.create(
            dht=dht, optimizer=opt, prefix="run_state", average_opt_statistics=("exp_avg",)
        ) as averager:
            await averager.step(optimizer_step=True, zero_grad=True, averaging_round=True)
            await averager.load_state_from_peers(timeout=30)

The blocking ``TrainingStateAverager`` runs this class on the background loop (its ``step``,
``load_state_from_peers``, ``wait_for_delayed_updates`` block until the trio method returns;
``averager.aio.step(...)`` awaits it from asyncio).

Which phases one ``step`` runs, and where, is decided by ``state_step_core.plan_state_step``
(pure); this shell does them: torch work (the optimizer step, copies into and out of the
averaged tensors) in ``trio.to_thread``, rounds on the loop. Delayed phases
(``delay_optimizer_step``, ``delay_averaging``) are jobs of a ``DelayedUpdates`` chain in the
averager's own nursery, run in order; a later ``step`` applies what they computed.

Resource handling: :meth:`open` enters the averager (all-reduce service, matchmaking, state
sharing: ``DecentralizedAverager.open_async``) and a nursery for the delayed phases; leaving it
cancels them (a running optimizer step in its worker thread finishes first; a running round's
control is cancelled, so its group is not left waiting), then closes the averager. The DHT is
the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import torch
import trio

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
from swarmtrain.optim._async_delayed import DelayedUpdates, call_trigger
from swarmtrain.optim.state_step_core import (
    AveragingPlace,
    StateAveragerTraits,
    StatePhases,
    StateStepRequest,
    plan_state_step,
)
from swarmtrain.p2p import PeerID

if TYPE_CHECKING:
    from swarmtrain.optim.state_averager import TrainingStateAverager

__all__ = [
    "ZERO_GRAD_SET_TO_NONE_DEFAULT",
    "AsyncTrainingStateAverager",
    "plan_step",
    "warn_unused_opts",
]

logger = logging.getLogger("swarmtrain.optim.state_averager")

#: hivemind's name: ``zero_grad`` sets gradients to None by default (torch >= 2.0's default)
ZERO_GRAD_SET_TO_NONE_DEFAULT = True


def plan_step(
    traits: StateAveragerTraits,
    *,
    averaging_control: StepControl | None,
    wait_for_trigger: Callable[[], Any] | None,
    averaging_opts: dict[str, Any] | None,
    set_to_none: bool = ZERO_GRAD_SET_TO_NONE_DEFAULT,
    warn: bool = True,
    **flags: Any,
) -> StatePhases:
    """The phases of a ``step`` with these keywords (``state_step_core.plan_state_step``);
    ``flags``: the boolean ones. ``averaging_opts`` unused: a warning (if ``warn``)."""
    phases = plan_state_step(
        StateStepRequest(
            **flags,
            has_averaging_control=averaging_control is not None,
            has_wait_for_trigger=wait_for_trigger is not None,
            has_averaging_opts=bool(averaging_opts),
        ),
        traits,
    )
    if warn:
        warn_unused_opts(phases, averaging_opts)
    return phases


def warn_unused_opts(phases: StatePhases, averaging_opts: dict[str, Any] | None) -> None:
    if phases.warn_unused_averaging_opts:
        logger.warning("averaging_opts %s are unused: averaging_round=False", averaging_opts)


class AsyncTrainingStateAverager:
    """The trio ``TrainingStateAverager`` (see the module docstring). Build it with
    ``async with TrainingStateAverager.create(dht=async_dht, ...)``.

    :param state: the torch side (a ``TrainingStateAverager`` built with ``start=False``):
      optimizer, scheduler, tensors, locks
    :param averager: the running trio averager over its averaged tensors
    :param nursery: where delayed phases run
    """

    def __init__(
        self,
        state: TrainingStateAverager,
        averager: AsyncDecentralizedAverager,
        nursery: trio.Nursery,
    ):
        self.state, self.averager = state, averager
        self._delayed = DelayedUpdates(
            nursery,
            state,
            run_id=state.prefix,
            status_loglevel=state.status_loglevel,
            wait_state_round=self._wait_round,
        )
        self._busy = trio.StrictFIFOLock()  # step / load_state_from_peers: one at a time

    @classmethod
    @asynccontextmanager
    async def open(
        cls, state: TrainingStateAverager, dht: Any
    ) -> AsyncIterator[AsyncTrainingStateAverager]:
        """Run ``state`` (built with ``start=False``) on ``dht`` (an ``AsyncDHT``) on the
        current trio loop."""
        async with state.open_async(dht) as averager, trio.open_nursery() as nursery:
            try:
                yield cls(state, averager, nursery)
            finally:
                nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------ the torch side

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def scheduler(self) -> Any:
        return self.state.scheduler

    @property
    def main_parameters(self) -> tuple[torch.Tensor, ...]:
        return self.state.main_parameters

    @property
    def local_epoch(self) -> int:
        return self.state.local_epoch

    @local_epoch.setter
    def local_epoch(self, value: int) -> None:
        self.state.local_epoch = value

    @property
    def averaging_in_progress(self) -> bool:
        """Whether a delayed averaging round is still running (a delayed optimizer step
        alone does not count)."""
        return self._delayed.round_in_progress

    def needs_loop(self, phases: StatePhases) -> bool:
        """Whether a step with these phases needs the loop: a round, delayed work to start,
        wait for or apply. If not, the blocking facade runs it in the caller's thread
        (``StateTensors._step_in_place``: the optimizer's lock orders it with delayed work)."""
        return (
            phases.prepare_round
            or phases.optimizer_in_worker
            or phases.wait_for_delayed_updates
            or (phases.apply_delayed_updates and self._delayed.finished_unapplied)
        )

    # ------------------------------------------------------------------ steps

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        """Start matchmaking for a later ``step(averaging_round=True, averaging_control=...)``.
        Keywords: ``AsyncDecentralizedAverager.start_step``'s except ``gather`` (our epoch is
        sent) and ``require_trigger``."""
        if "gather" in kwargs:
            raise ValueError("a TrainingStateAverager gathers its epoch: do not pass gather")
        return self.averager.start_step(
            gather=self.state.local_epoch,
            scheduled_time=scheduled_time,
            require_trigger=True,
            **kwargs,
        )

    async def step(
        self,
        wait_for_delayed_updates: bool | None = None,
        apply_delayed_updates: bool = True,
        increment_epoch: bool = False,
        optimizer_step: bool = False,
        zero_grad: bool = False,
        set_to_none: bool = ZERO_GRAD_SET_TO_NONE_DEFAULT,
        delay_optimizer_step: bool = False,
        averaging_round: bool = False,
        delay_averaging: bool | None = None,
        averaging_control: StepControl | None = None,
        wait_for_trigger: Callable[[], Any] | None = None,
        averaging_opts: dict[str, Any] | None = None,
    ) -> dict | None:
        """Do some of the following, in this order (hivemind's semantics; which ones and where:
        ``swarmtrain.optim.state_step_core``).

        :param wait_for_delayed_updates: wait for delayed phases still running (default: when
          ``averaging_round``, or with ``delta_rule_averaging`` before a delayed optimizer step;
          an optimizer step that is not delayed does not wait for a delayed round then)
        :param apply_delayed_updates: apply delayed phases that have finished
        :param increment_epoch: ``local_epoch += 1`` (the scheduler follows at the next phase)
        :param optimizer_step: one optimizer step; ``zero_grad``: then reset the gradients (the
          optimizer's and, with ``offload_optimizer``, the model's), to None if ``set_to_none``
          (torch's default) else to zeros
        :param delay_optimizer_step: run them in the background (needs ``offload_optimizer``
          and delayed averaging); the model gets the new values at a later ``step``
        :param averaging_round: average with a group; ``delay_averaging`` (default:
          ``delay_optimizer_step``) runs it in the background
        :param averaging_control: a control from :meth:`schedule_step` for this round
        :param wait_for_trigger: waited for before the optimizer step (an async function is
          awaited, a plain one called in a worker thread); if it raises, the step is aborted
          (needs ``reuse_tensors`` or ``custom_gradients``)
        :param averaging_opts: keywords for a new round (``timeout``, ``scheduled_time``,
          ``weight``, ``allow_retries``)
        :returns: the round's ``{peer_id: epoch}`` if it ran here and succeeded, else None
        """
        state = self.state
        phases = plan_step(
            state._traits,
            wait_for_delayed_updates=wait_for_delayed_updates,
            apply_delayed_updates=apply_delayed_updates,
            increment_epoch=increment_epoch,
            optimizer_step=optimizer_step,
            zero_grad=zero_grad,
            delay_optimizer_step=delay_optimizer_step,
            averaging_round=averaging_round,
            delay_averaging=delay_averaging,
            averaging_control=averaging_control,
            wait_for_trigger=wait_for_trigger,
            averaging_opts=averaging_opts,
        )
        async with self._busy:
            if phases.wait_for_delayed_updates:
                await self._delayed.wait_jobs()
            if phases.apply_delayed_updates:
                await self._delayed.apply_finished()
            if phases.increment_epoch:
                state.local_epoch += 1
            if not phases.work:
                return None
            if phases.load_local_grads:
                await trio.to_thread.run_sync(state._load_local_grads)
            control = None
            if phases.prepare_round:
                control = self._prepare_round(averaging_control, dict(averaging_opts or {}))
            if phases.optimizer_in_worker:  # the round, if any, follows the step there
                self._delayed.start(
                    optimizer_step=optimizer_step,
                    zero_grad=zero_grad,
                    set_to_none=set_to_none,
                    wait_for_trigger=wait_for_trigger,
                    state_round=control,
                )
                return None
            try:
                await call_trigger(wait_for_trigger)
                await trio.to_thread.run_sync(
                    state._optimizer_phase, None, optimizer_step, zero_grad, set_to_none
                )
                if phases.apply_parameters:
                    await trio.to_thread.run_sync(state._apply_optimizer_parameters)
                if control is not None:
                    await trio.to_thread.run_sync(state._load_round_inputs, control)
                    control.allow_allreduce()
            except BaseException:
                if control is not None:
                    control.cancel()
                raise
            if control is None:
                return None
            if phases.averaging is AveragingPlace.IN_WORKER:  # it averages the state as of now
                self._delayed.start(state_round=control, inputs_loaded=True)
                return None
            gathered = await self._wait_round(control)
            if gathered is not None:
                await trio.to_thread.run_sync(state._apply_round)
            return gathered

    def _prepare_round(self, control: StepControl | None, opts: dict[str, Any]) -> StepControl:
        if control is not None and (control.triggered or control.done()):
            logger.log(
                self.state.status_loglevel, "discarding a used or failed control: %s", control
            )
            control = None
        if control is None:
            return self.schedule_step(**opts)
        if opts:
            logger.warning("averaging_opts %s are unused: the round was scheduled before", opts)
        return control

    async def _wait_round(self, control: StepControl) -> dict | None:
        """Wait for a round whose all-reduce is allowed: the gathered epochs, or None if it
        failed (logged at ``status_loglevel``). No extra timeout: the round ends by itself
        (its matchmaking deadline, then the all-reduce timeouts)."""
        try:
            gathered = await control.wait_result()
        except Exception as e:
            control.cancel()
            logger.log(self.state.status_loglevel, "state averaging failed: %r", e)
            return None
        except BaseException:
            control.cancel()
            raise
        await trio.to_thread.run_sync(self.state._round_finished, gathered)
        return gathered

    async def wait_for_delayed_updates(self) -> None:
        """Wait until every delayed phase has finished (their errors are logged); a later
        ``step`` applies what they computed."""
        await self._delayed.wait_jobs()

    # ------------------------------------------------------------------ state sharing

    async def load_state_from_peers(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 (hivemind's keyword)
        swarm_epoch: int | None = None,
        min_epoch: int | None = None,
    ) -> bool:
        """Download the training state from the best donor and load it (see
        ``TrainingStateAverager.load_state_from_peers``); False if nobody answered within
        ``timeout`` or every donor's state was rejected."""
        state = self.state
        async with self._busy:
            check = await trio.to_thread.run_sync(state._state_check, swarm_epoch, min_epoch)
            loaded = await self.averager.load_state_from_peers(timeout, check=check)
            if loaded is None:
                return False
            return await trio.to_thread.run_sync(state._load_downloaded_state, loaded, min_epoch)

    # -------------------------------------------- the averager's (for the blocking facade)

    def start_step(self, *args: Any, **kwargs: Any) -> StepControl:
        """``AsyncDecentralizedAverager.start_step`` (a round of the averaged tensors as they
        are, without this class's phases)."""
        return self.averager.start_step(*args, **kwargs)

    def get_group_bits(self) -> str:
        return self.averager.get_group_bits()

    def set_group_bits(self, group_bits: str) -> None:
        self.averager.set_group_bits(group_bits)

    @property
    def peer_id(self) -> PeerID:
        return self.averager.peer_id

    @property
    def part_bytes_sent(self) -> int:
        return self.averager.part_bytes_sent

    @property
    def delta_bytes_sent(self) -> int:
        return self.averager.delta_bytes_sent

    @property
    def bans(self) -> Any:
        return self.averager.bans

    @property
    def state_download_failure(self) -> Any:
        return self.averager.state_download_failure

    @property
    def allow_state_sharing(self) -> bool:
        return self.averager.allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self.averager.allow_state_sharing = value

    @property
    def state_sharing_priority(self) -> float:
        return self.averager.state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self.averager.state_sharing_priority = value
