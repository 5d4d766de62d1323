"""``AsyncOptimizer``: the trio ``Optimizer``, for a trainer whose own loop is trio.

::

    async with DHT.create(initial_peers=[...]) as dht:
        async with Optimizer.create(
            dht=dht, run_id="my_run", target_batch_size=4096, batch_size_per_step=32,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
            params=model.parameters(),
        ) as opt:
            await opt.wait_for_peers(2)
            for batch in batches:
                loss(model, batch).backward()
                await opt.step()
                opt.zero_grad()

Same semantics and keywords as the blocking :class:`~swarmtrain.optim.Optimizer` (see
``swarmtrain.optim.optimizer``), which is a facade over this class on the background loop: one
implementation. The decisions come from the sans-IO
:class:`~swarmtrain.optim.epoch_core.EpochCore`, the tensor work from the
``GradientAverager`` / ``TrainingStateAverager`` methods (objects built with ``start=False``:
their buffers, accumulators, optimizer and locks), and the network from their trio averagers
(``DecentralizedAverager.open_async``) on the caller's loop. No background loop thread, no
worker thread that waits: every wait is an await, and every touch of tensors guarded by a
``threading`` lock (the optimizer step, copies in and out of the averaged buffers, loading a
state) runs in ``trio.to_thread``, so the trainer's loop keeps serving the swarm meanwhile
(small CPU work runs in place: a thread hop would cost more; ``swarmtrain.optim._torch_work``).

Modes: gradient averaging (default), ``use_local_updates``, ``offload_optimizer``,
``delay_state_averaging`` (the state round is a task of this optimizer's nursery; its result is
applied at a later ``step``), ``reuse_grad_buffers``, ``average_state_every``, ``client_mode``,
GradScaler, ``auxiliary``, ``delay_optimizer_step`` and ``delay_grad_averaging`` (the optimizer
step, the wait for the round and the state round after it are a job of this optimizer's task
group: ``swarmtrain.optim._async_delayed``), ``grad_averager_factory`` (e.g. PowerSGD, or
``ProcessGradientAverager``: the gradient all-reduce in a helper process, its controls awaited
here; starting a round waits for the helper's acknowledgement, a pipe round trip).

Cancellation: every method can be cancelled. A step cancelled during its epoch end leaves the
epoch unfinished and drops the gradients accumulated for it (a running thread part finishes
first: tensors are never left half-copied); the next step ends the epoch again.

Resource handling: ``create`` starts the state averager, the gradient averager (without
``use_local_updates``), the progress tracker and a task group for delayed state rounds;
leaving it cancels the delayed round, says goodbye (tracker), then stops the averagers. The DHT
is the caller's.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Union

import torch
import trio

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager, _copies_on_loop
from swarmtrain.averaging.finite import first_non_finite
from swarmtrain.averaging.matchmaking_types import DEFAULT_DECLARATION_LINGER
from swarmtrain.dht import AsyncDHT, get_dht_time
from swarmtrain.optim._async_delayed import DelayedUpdates
from swarmtrain.optim._async_gradient_rounds import AsyncGradientRounds
from swarmtrain.optim._async_state_loading import AsyncStateLoading
from swarmtrain.optim._checkpoint import load_checkpoint, make_checkpoint
from swarmtrain.optim._optimizer_options import (
    averager_options,
    check_keywords,
    check_positive,
    grad_averager_options,
    resolve_modes,
    state_averager_options,
)
from swarmtrain.optim._torch_work import TorchWork, small_cpu_tensors
from swarmtrain.optim.epoch_core import (
    BatchCheck,
    EpochCore,
    EpochModes,
    SkipBatch,
)
from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.optim.grad_scaler import scaler_method
from swarmtrain.optim.progress_tracker import AsyncProgressTracker
from swarmtrain.optim.progress_types import GlobalProgress
from swarmtrain.optim.state_averager import (
    LRScheduler,
    OptimizerFactory,
    SchedulerFactory,
    TrainingStateAverager,
)
from swarmtrain.optim.swarm_health import SwarmHealth, describe_parameters
from swarmtrain.utils.logs import show_logs

__all__ = ["AsyncOptimizer", "StepWork"]

logger = logging.getLogger("swarmtrain.optim.optimizer")


CONFIRM_ALONE_TIMEOUT = 3.0
"""How long a peer alone at the target waits for its confirming DHT fetch (s) before it ends
the epoch alone anyway."""


@dataclass(frozen=True)
class StepWork:
    """What a step still has to do on the loop after its batch part (``on_batch``)."""

    catch_up: bool = False  #: load the state from peers (this peer is behind)
    schedule_round: bool = False  #: start matchmaking for this epoch's gradient round
    seconds_left: float = 0.0  #: until the swarm's expected end of the epoch
    num_peers_present: int = 0
    end_epoch: bool = False  #: the swarm reached the target: end the epoch
    confirm_alone: bool = False  #: alone at the target: fetch once more, then decide


class AsyncOptimizer(AsyncStateLoading):
    """The trio ``Optimizer``; build it with ``async with Optimizer.create(dht=..., ...)``
    (``dht``: an ``AsyncDHT`` from ``DHT.create``). Keywords: those of ``Optimizer``."""

    def __init__(
        self,
        *,
        dht: AsyncDHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: Union[torch.optim.Optimizer, OptimizerFactory],
        params: Iterable[Any] | None = None,
        scheduler: Union[LRScheduler, SchedulerFactory, None] = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 60.0,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        load_state_timeout: float = 60.0,
        declaration_linger: float = DEFAULT_DECLARATION_LINGER,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: Any = None,
        state_averaging_compression: Any = None,
        load_state_compression: Any = None,
        grad_averager_factory: Any = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        aggregation: str = "mean",
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        trusted_peers: Sequence[Any] = (),
        verbose: bool = False,
    ):
        """Check the keywords and build the torch side (no network yet): use :meth:`create`."""
        check_keywords(
            run_id=run_id,
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            load_state_timeout=load_state_timeout,
            average_state_every=average_state_every,
            averager_opts=averager_opts,
            tracker_opts=tracker_opts,
            declaration_linger=declaration_linger,
        )
        if not isinstance(dht, AsyncDHT):
            raise TypeError(
                f"dht must be a running trio swarmtrain DHT (from `async with "
                f"DHT.create(...) as dht`), got {type(dht).__name__}; with a blocking DHT use "
                "swarmtrain.Optimizer(dht=...)"
            )
        if client_mode is None:
            client_mode = bool(dht.client_mode)
        offload_optimizer, delay_optimizer_step = resolve_modes(
            optimizer=optimizer,
            use_local_updates=use_local_updates,
            auxiliary=auxiliary,
            client_mode=client_mode,
            batch_size_per_step=batch_size_per_step,
            reuse_grad_buffers=reuse_grad_buffers,
            offload_optimizer=offload_optimizer,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            delay_state_averaging=delay_state_averaging,
            grad_averager_factory=grad_averager_factory,
        )

        self.dht, self.run_id = dht, run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.matchmaking_time = float(matchmaking_time)
        self.averaging_timeout = float(averaging_timeout)
        self.load_state_timeout = float(load_state_timeout)
        self.declaration_linger = float(declaration_linger)
        self.average_state_every = average_state_every
        self.use_local_updates = bool(use_local_updates)
        self.client_mode, self.auxiliary = client_mode, bool(auxiliary)
        self.reuse_grad_buffers = bool(reuse_grad_buffers)
        self.offload_optimizer = offload_optimizer
        self.delay_optimizer_step = delay_optimizer_step and not self.auxiliary
        self.delay_grad_averaging = bool(delay_grad_averaging) and not self.auxiliary
        self.delay_state_averaging = bool(delay_state_averaging)
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        if verbose:
            show_logs()
        self.local_samples_accumulated = 0.0  #: this epoch, this peer
        self.last_epoch_samples = 0.0  #: samples this peer contributed to its last epoch
        self._epoch_core = EpochCore(
            EpochModes(
                auxiliary=self.auxiliary,
                client_mode=self.client_mode,
                use_local_updates=self.use_local_updates,
                offload_optimizer=self.offload_optimizer,
                delay_optimizer_step=self.delay_optimizer_step,
                delay_grad_averaging=self.delay_grad_averaging,
                delay_state_averaging=self.delay_state_averaging,
                reuse_grad_buffers=self.reuse_grad_buffers,
                average_state_every=self.average_state_every,
                matchmaking_time=self.matchmaking_time,
            )
        )
        self.health = SwarmHealth(run_id)
        self._tracker_opts = {"trusted_peers": trusted_peers, **(tracker_opts or {})}
        self._last_progress: GlobalProgress | None = None
        self._closed = False
        self.state_rounds_averaged = 0  #: state rounds that averaged with a group
        common = averager_options(
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            averager_opts=averager_opts,
            declaration_linger=self.declaration_linger,
        )
        # The torch side of the blocking averagers (start=False: no loop, no network); their
        # trio averagers start in create().
        self._state = TrainingStateAverager(
            dht=dht,
            optimizer=optimizer,
            params=params,
            scheduler=scheduler,
            prefix=f"{run_id}_state_averager",
            client_mode=client_mode,
            start=False,
            status_loglevel=self.status_loglevel,
            offload_optimizer=offload_optimizer,
            custom_gradients=offload_optimizer and not self.use_local_updates,
            delta_rule_averaging=self.delay_state_averaging
            and (self.use_local_updates or not offload_optimizer),
            average_opt_statistics=average_opt_statistics,
            extra_tensors=extra_tensors,
            **state_averager_options(
                common,
                state_averaging_compression=state_averaging_compression,
                load_state_compression=load_state_compression,
                use_local_updates=self.use_local_updates,
                aggregation=aggregation,
            ),
        )
        self._grads: GradientAverager | None = None
        self._grad_buffers_match = True
        #: check and accumulate batches on the loop: CPU parameters of at most
        #: INLINE_COPY_MAX_BYTES, accumulated (a local optimizer step takes a lock: a thread)
        self._batches_on_loop = not self.use_local_updates and _copies_on_loop(
            self._state.main_parameters
        )
        if not self.use_local_updates:
            self._grads = (grad_averager_factory or GradientAverager)(
                self._state.main_parameters,
                dht=dht,
                prefix=f"{run_id}_grad_averager",
                reuse_grad_buffers=self.reuse_grad_buffers,
                client_mode=client_mode,
                start=False,
                **grad_averager_options(
                    common, aggregation=aggregation, grad_compression=grad_compression
                ),
            )
            with self._grads.get_tensors() as averaged:
                params = self.main_parameters
                self._grad_buffers_match = len(averaged) == len(params) and all(
                    a.shape == p.shape for a, p in zip(averaged, params, strict=False)
                )
            if self.delay_optimizer_step and not self._grad_buffers_match:
                raise ValueError(
                    "delay_optimizer_step needs a gradient averager whose averaged tensors are "
                    "one gradient per parameter; this one averages other tensors (e.g. PowerSGD "
                    "factors)"
                )
            self.health.model = describe_parameters(self.main_parameters)
        #: the epoch end's torch work: in place for a small CPU model whose locks are free
        opt_tensors = [p for group in self._state.optimizer.param_groups for p in group["params"]]
        locks = [self._state.lock_optimizer, self._state.lock_averaged_tensors]
        if self._grads is not None:
            locks.append(self._grads.lock_averaged_tensors)
        self._torch = TorchWork(
            small_cpu_tensors([*self._state.main_parameters, *opt_tensors]), locks
        )
        # set by create()
        self._state_service: AsyncDecentralizedAverager | None = None
        self._tracker_service: AsyncProgressTracker | None = None
        self._rounds: AsyncGradientRounds | None = None
        self._nursery: trio.Nursery | None = None
        self._delayed: DelayedUpdates | None = None  # delayed steps and state rounds
        self._busy = trio.StrictFIFOLock()  # step / load_state_from_peers: one at a time

    @classmethod
    @asynccontextmanager
    async def create(cls, **kwargs: Any) -> AsyncIterator[AsyncOptimizer]:
        """Start an optimizer on a running ``AsyncDHT`` (keywords: ``Optimizer``'s); building
        the torch side (the optimizer's copies and statistics) runs in a worker thread."""
        self = await trio.to_thread.run_sync(partial(cls, **kwargs))
        async with AsyncExitStack() as stack:
            self._state_service = await stack.enter_async_context(
                self._state.open_async(self.dht, state_provider=self._current_state)
            )
            if self._grads is not None:
                grad_service = await stack.enter_async_context(self._grads.open_async(self.dht))
                self._rounds = AsyncGradientRounds(
                    grad_service,
                    self._grads,
                    run_id=self.run_id,
                    matchmaking_time=self.matchmaking_time,
                    averaging_timeout=self.averaging_timeout,
                    status_loglevel=self.status_loglevel,
                    health=self.health,
                    swarm_epoch=self._swarm_epoch,
                    peer_epochs=self._peer_epochs,
                    torch_work=self._torch,
                )
            self._tracker_service = await stack.enter_async_context(
                AsyncProgressTracker.create(
                    self.dht,
                    self.run_id,
                    self.target_batch_size,
                    client_mode=self.client_mode,
                    status_loglevel=self.status_loglevel,
                    **{
                        "partner_window": max(4, 2 * self.average_state_every),
                        **self._tracker_opts,
                    },
                )
            )
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._delayed = DelayedUpdates(
                self._nursery,
                self._state,
                run_id=self.run_id,
                status_loglevel=self.status_loglevel,
                wait_state_round=self._wait_state_round,
                torch_work=self._torch,
            )
            try:
                yield self
            finally:
                self._closed = True
                if self._rounds is not None:
                    self._rounds.cancel()
                self._nursery.cancel_scope.cancel()

    def _swarm_epoch(self) -> int:
        """The tracker's epoch of the swarm (also while closing, for a job still waiting)."""
        assert self._tracker_service is not None
        return self._tracker_service.global_epoch

    def _peer_epochs(self) -> list[int]:
        """The epochs the other peers present last published (the tracker's records)."""
        assert self._tracker_service is not None
        return [record.epoch for record in self._tracker_service.peers().values()]

    def _current_state(self) -> Any:
        """What newcomers download (in a worker thread): the state averager's state, with the
        group bits of its trio averager."""
        metadata, tensors, infos = self._state.get_current_state()
        if self._state_service is not None:
            metadata["group_bits"] = self._state_service.get_group_bits()
        return metadata, tensors, infos

    # ------------------------------------------------------------------ torch.optim-like

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (on CPU copies with ``offload_optimizer``)."""
        return self._state.optimizer

    @property
    def main_parameters(self) -> tuple[torch.Tensor, ...]:
        """The model's parameters, whose ``.grad`` autograd writes."""
        return self._state.main_parameters

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def scheduler(self) -> LRScheduler | None:
        scheduler = self._state.scheduler  # built from a factory, or given
        return scheduler if isinstance(scheduler, LRScheduler) else None

    @property
    def local_epoch(self) -> int:
        """This peer's epoch: the number of optimizer steps of the swarm it took part in."""
        return self._state.local_epoch

    @property
    def global_epoch(self) -> int:
        return self._tracker.global_epoch

    @property
    def tracker(self) -> AsyncProgressTracker:
        """The running progress tracker."""
        return self._tracker

    @property
    def epochs_averaged(self) -> int:
        """Epochs whose gradients were averaged with a group."""
        return self._rounds.averaged if self._rounds is not None else 0

    @property
    def epochs_alone(self) -> int:
        """Epochs that used the local gradients (no peers seen, or the round failed)."""
        return self._rounds.alone if self._rounds is not None else 0

    @property
    def scheduled_grads(self) -> StepControl | None:
        """The gradient round pre-scheduled for the end of this epoch, if any."""
        return self._rounds.scheduled if self._rounds is not None else None

    @property
    def skipped_batches(self) -> int:
        """Batches dropped for non-finite gradients."""
        return self._epoch_core.statistics().batches_skipped

    @property
    def state_averaging_in_progress(self) -> bool:
        """Whether a delayed state round still runs."""
        return self._delayed is not None and self._delayed.round_in_progress

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm (hivemind's test)."""
        return self.local_epoch >= self._tracker.global_epoch - 1

    @property
    def _tracker(self) -> AsyncProgressTracker:
        self._check_running()
        assert self._tracker_service is not None
        return self._tracker_service

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("this Optimizer was shut down (its `async with` block ended)")
        if self._tracker_service is None:
            raise RuntimeError("this Optimizer is not running: use `async with Optimizer.create`")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients (the accumulators are not touched)."""
        if self.reuse_grad_buffers:
            raise ValueError(
                "with reuse_grad_buffers=True the gradients are the accumulators: do not call "
                "zero_grad(); the Optimizer resets them after each epoch"
            )
        for param in self.main_parameters:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()

    async def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> int:  # noqa: ASYNC109
        """Announce this peer and wait until the tracker sees ``num_peers`` peers (this one
        counted) or ``timeout`` seconds pass; return how many it sees."""
        check_positive("num_peers", num_peers)
        check_positive("timeout", timeout)
        tracker = self._tracker
        if not self.auxiliary:  # an auxiliary peer publishes no progress and is not counted
            tracker.announce()
        with trio.move_on_after(timeout):
            await tracker.wait_num_peers(num_peers)
        seen = tracker.global_progress.num_peers
        if seen < num_peers:
            logger.warning(
                "%s: saw %d of %d peers within %.0f s: training with those",
                self.run_id,
                seen,
                num_peers,
                timeout,
            )
        return seen

    async def wait_for_delayed_updates(self) -> None:
        """Wait for the delayed work still running (optimizer steps, gradient and state rounds
        of ``delay_*``), then apply it to the model, e.g. before evaluating or saving."""
        async with self._busy:
            await self._delayed_updates().wait_all()

    async def average_state(self, timeout: float | None = None) -> dict | None:  # noqa: ASYNC109
        """One state round now, waited for and applied (after the delayed work), e.g. a final
        sync of the models after training: the group's ``{peer_id: epoch}``, None if it did
        not average (logged). ``timeout``: of the round (default ``averaging_timeout``)."""
        timeout = self.averaging_timeout if timeout is None else timeout
        check_positive("timeout", timeout)
        async with self._busy:
            self._check_running()
            await self._delayed_updates().wait_all()
            weight = 0.0 if self.auxiliary else None
            return await self._finish_state_round(await self._begin_state_round(weight, timeout))

    async def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the epoch and the scheduler's state (after
        the delayed work: an ``await``, unlike torch's, since it waits and takes the lock)."""
        async with self._busy:
            await self._delayed_updates().wait_all()
            return await trio.to_thread.run_sync(make_checkpoint, self._state)

    async def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (a plain torch optimizer state works too); a
        new epoch drops the accumulated gradients and is announced."""
        async with self._busy:
            await self._delayed_updates().wait_all()
            epoch = await trio.to_thread.run_sync(load_checkpoint, self._state, state_dict)
            if epoch is not None:
                await self._enter_epoch(epoch)

    # ------------------------------------------------------------------ a step

    async def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
    ) -> Any:
        """Accumulate this batch and, when the swarm is ready, take a collaborative step (see
        ``swarmtrain.optim.optimizer``). ``closure`` runs here, on the loop (it is the
        trainer's own forward and backward). Returns the closure's loss. Calls from several
        tasks run one at a time."""
        async with self._busy:
            batch_size = self.check_step_arguments(closure, batch_size, grad_scaler)
            await self._delayed_updates().apply_finished()
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self._batches_on_loop or batch_size is None:
                work = self.on_batch(batch_size, grad_scaler)
            else:  # the check and the copies hold a lock the optimizer step also takes
                work = await trio.to_thread.run_sync(self.on_batch, batch_size, grad_scaler)
            if work is not None:
                await self._do_step_work(work, grad_scaler)
            return loss

    # A step in two parts, so that a blocking facade (``swarmtrain.Optimizer``) runs the batch
    # part in the trainer's own thread and enters the loop only when there is loop work:
    # ``on_batch`` (plain, any thread, never awaits) checks and accumulates the batch, reports
    # progress and decides; ``do_step_work`` (on the loop) catches up, pre-schedules the
    # gradient round or ends the epoch.

    def check_step_arguments(
        self, closure: Callable[[], Any] | None, batch_size: int | None, grad_scaler: Any
    ) -> int | None:
        """Raise on arguments ``step`` cannot take; the batch size to use (None: auxiliary)."""
        self._check_running()
        if self.auxiliary and (
            closure is not None or batch_size is not None or grad_scaler is not None
        ):
            raise ValueError("an auxiliary peer has no batches: call step() without arguments")
        if grad_scaler is not None:
            scaler_method(grad_scaler, "unscale_swarm_grads_")
            scaler_method(grad_scaler, "on_swarm_epoch_end_")
        if self.auxiliary:
            return None
        batch_size = self.batch_size_per_step if batch_size is None else batch_size
        if batch_size is None:
            raise ValueError("pass step(batch_size=...) or Optimizer(batch_size_per_step=...)")
        check_positive("batch_size", batch_size)
        return batch_size

    @property
    def delayed_updates_finished(self) -> bool:
        """Whether delayed work finished and waits to be applied (``apply_delayed_updates``)."""
        return self._delayed is not None and self._delayed.finished_unapplied

    async def apply_delayed_updates(self) -> None:
        """Apply the delayed work that finished (a step does this first)."""
        async with self._busy:
            await self._delayed_updates().apply_finished()

    def on_batch(self, batch_size: int | None, grad_scaler: Any) -> StepWork | None:
        """The batch part of a step, in any thread (no await): check and accumulate this
        batch's gradients (``batch_size`` None: an auxiliary peer's step), report progress,
        decide. Returns the loop work due (:meth:`do_step_work`), None if there is none.
        The caller makes the calls one at a time (``step``'s lock, or the facade's)."""
        tracker, core = self._tracker, self._epoch_core
        progress = self._last_progress or tracker.global_progress
        if core.is_behind(self.local_epoch, progress.epoch) and core.is_behind(
            self.local_epoch, tracker.global_epoch
        ):
            if not core.catch_up_due(self._now()):  # backing off: skip this batch
                return None
            self._last_progress = None
            return StepWork(catch_up=True)
        if batch_size is not None and not self._accumulate(batch_size, grad_scaler):
            return None
        progress = self._last_progress = tracker.global_progress
        if progress.confirming_alone:
            return StepWork(confirm_alone=True)
        return self._plan_step_work(progress)

    def _plan_step_work(self, progress: GlobalProgress) -> StepWork | None:
        plan = self._epoch_core.on_progress(self.local_epoch, progress, get_dht_time())
        schedule = plan.schedule_round and self._rounds is not None and self._rounds.needs_schedule
        if not (schedule or plan.end_epoch):
            return None
        if plan.end_epoch:
            self._last_progress = None
        return StepWork(
            schedule_round=schedule,
            seconds_left=plan.seconds_left,
            num_peers_present=plan.num_peers_present,
            end_epoch=plan.end_epoch,
        )

    async def do_step_work(self, work: StepWork, grad_scaler: Any = None) -> None:
        """The loop part of a step that :meth:`on_batch` returned ``work`` for."""
        async with self._busy:
            await self._do_step_work(work, grad_scaler)

    async def _do_step_work(self, work: StepWork | None, grad_scaler: Any) -> None:
        if work is not None and work.confirm_alone:
            work = await self._confirm_alone()
        if work is None:
            return
        if work.catch_up:
            await self._catch_up()
            return
        if work.schedule_round:
            assert self._rounds is not None
            self._rounds.maybe_schedule(work.seconds_left, self.local_epoch, work.num_peers_present)
        if work.end_epoch:
            await self._end_epoch(grad_scaler)

    async def _confirm_alone(self) -> StepWork | None:
        """Alone at the target: wait for a fresh fetch (peers that started with us publish
        with their first step), then plan as usual; if the DHT does not answer in time, the
        epoch ends alone."""
        with trio.move_on_after(CONFIRM_ALONE_TIMEOUT):
            await self._tracker.wait_for_fetch()
        progress = self._tracker.global_progress
        if progress.confirming_alone:
            progress = dataclasses.replace(progress, confirming_alone=False)
        return self._plan_step_work(progress)

    def _accumulate(self, batch_size: int, grad_scaler: Any) -> bool:
        """Check the batch and take it (the caller's thread); False if it was dropped."""
        core, params = self._epoch_core, self.main_parameters
        check = core.batch_check(grad_scaler is not None)
        state, grads = self._state, self._grads
        finite = True
        if check is BatchCheck.UNSCALE:
            finite = bool(scaler_method(grad_scaler, "unscale_swarm_grads_")(params))
        elif check is BatchCheck.CHECK_FINITE:
            finite = first_non_finite([p.grad for p in params if p.grad is not None]) is None
        decision = core.on_batch(check, finite)
        if isinstance(decision, SkipBatch):
            if decision.reset_accumulators:
                assert grads is not None
                grads.reset_accumulated_grads_()
                self.local_samples_accumulated = 0.0
            if decision.clear_grads:
                for param in params:
                    param.grad = None
            log = logger.warning if decision.warn else logger.debug
            log("%s: this batch's gradients hold NaN or inf: the batch is dropped", self.run_id)
            return False
        if decision.local_step:
            state.step(optimizer_step=True)
        else:
            assert grads is not None
            grads.accumulate_grads_(batch_size)
        self.local_samples_accumulated += batch_size
        self._tracker.report_local_progress(self.local_epoch, int(self.local_samples_accumulated))
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_id={self.run_id!r}, local_epoch={self.local_epoch})"


def _show_keywords_on_create() -> None:
    """``inspect.signature(Optimizer.create)`` (IDEs, ``help()``) lists the keywords of
    ``__init__`` rather than ``**kwargs``."""
    init = inspect.signature(AsyncOptimizer.__init__)
    params = list(init.parameters.values())
    cls_param = inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    create: Any = vars(AsyncOptimizer)["create"].__func__
    create.__signature__ = init.replace(
        parameters=[cls_param, *params[1:]], return_annotation=inspect.Signature.empty
    )


_show_keywords_on_create()
