"""``Optimizer``: a torch optimizer that trains with peers in epochs of ``target_batch_size``.

Each peer calls ``step()`` after every local backward pass, like a torch optimizer::

    opt = Optimizer(dht=dht, run_id="my_run", target_batch_size=4096, batch_size_per_step=32,
                    optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
                    params=model.parameters())
    for batch in batches:
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

What a step does (hivemind's semantics):

1. delayed updates that finished in the background are applied to the model;
2. a peer behind the swarm loads the training state from peers
   (:meth:`Optimizer.load_state_from_peers`) and returns: two or more epochs behind, or one
   epoch behind in an epoch the swarm had already left when this peer entered it (see
   ``swarmtrain.optim._epoch_sync``; with no donor it takes the swarm's epoch instead);
3. the gradients are added to the accumulators (``GradientAverager.accumulate_grads_``) and the
   number of samples accumulated this epoch is reported (``ProgressTracker``); once the swarm is
   expected to reach ``target_batch_size`` within ``matchmaking_time`` (the tracker's ETA), the
   gradient round's matchmaking starts, so the group is ready when the epoch ends;
4. when the swarm reached ``target_batch_size`` (``tracker.ready_to_update_epoch``): the
   accumulated gradients are averaged with the group, weighted by samples (if that fails, the
   local mean gradient is used and the failure logged), the optimizer steps on them, the
   training state is averaged every ``average_state_every`` epochs (when other peers are seen),
   the epoch is incremented and the accumulators are reset.

Modes (see ``__init__``'s keywords):

- ``use_local_updates=True``: the optimizer steps on the local gradients at every ``step``; at
  each epoch's end the peers average their training state instead of gradients.
- ``offload_optimizer``: the optimizer holds CPU fp32 copies of the parameters and steps there;
  the new values are copied into the model (default on when the optimizer is a factory).
- ``delay_optimizer_step``: the optimizer step (and the state round after it) runs in a
  background thread while the trainer goes on with the next epoch's batches; the model gets the
  new parameters at a later ``step`` (they may be one epoch stale meanwhile). With
  ``delay_grad_averaging`` the gradient round is waited for in that thread too, so a peer does
  not wait for the network at all between epochs.
- ``delay_state_averaging`` (default on): the state round runs in the background; its result is
  applied at a later ``step``. As in hivemind, an epoch skips its state round while the last
  one still runs. Training never waits for it: without ``offload_optimizer`` (e.g. an optimizer
  instance) the result is applied as ``state += averaged - state at the round's start``, so the
  optimizer steps taken meanwhile are kept; with it the optimizer's CPU copies are averaged in
  place.
- ``reuse_grad_buffers``: accumulate in ``param.grad`` itself (no extra memory); never call
  ``zero_grad()`` then: the optimizer resets the gradients after each epoch.
- ``auxiliary=True``: a peer without data that calls ``step()`` (no arguments) in a loop. It
  takes part in the gradient rounds with weight 0, so it helps reduce, receives the group's
  mean gradient and steps its own optimizer on it; it takes part in state rounds with weight 0
  too. Its training state stays current, so it can serve newcomers; when it missed an epoch's
  gradient round, it loads the state from peers. It never delays its optimizer step.
- ``client_mode=True`` (or a client-mode DHT): the peer cannot be dialled (behind NAT); it
  trains and averages, but reduces nothing for others and serves no state.

Mixed precision: pass a ``swarmtrain.optim.GradScaler`` as ``step(grad_scaler=...)`` (its
``step(opt)`` does that): the gradients are unscaled at each step and a batch with inf/NaN is
skipped; with ``reuse_grad_buffers`` they stay scaled until the epoch's end, are unscaled right
before averaging, and inf/NaN make this peer's weight 0 for that epoch. After each epoch the
optimizer calls ``grad_scaler.on_swarm_epoch_end_()``.

Peers must start from the same parameters: build the model with the same seed, or call
:meth:`Optimizer.load_state_from_peers` before training.

Resource handling: the constructor starts a ``TrainingStateAverager``, (without
``use_local_updates``) a gradient averager and a ``ProgressTracker`` on ``dht``;
:meth:`shutdown` (or leaving a ``with`` block) stops the tracker (it says goodbye), the gradient
averager (a running round fails), then the state averager (it waits for its background
thread). The DHT is the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.optim._checkpoint import load_checkpoint, make_checkpoint
from swarmtrain.optim._epoch_gradients import GradientRounds
from swarmtrain.optim._epoch_update import EpochUpdates, scaler_method
from swarmtrain.optim._optimizer_options import (
    averager_options,
    check_keywords,
    check_positive,
    grad_averager_options,
    resolve_modes,
    state_averager_options,
)
from swarmtrain.optim.async_optimizer import AsyncOptimizer
from swarmtrain.optim.epoch_core import EpochCore, EpochModes
from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.optim.progress_core import GlobalProgress
from swarmtrain.optim.progress_tracker_blocking import ProgressTracker
from swarmtrain.optim.state_averager import (
    LRScheduler,
    OptimizerFactory,
    SchedulerFactory,
    TrainingStateAverager,
)
from swarmtrain.optim.swarm_health import SwarmHealth, describe_parameters
from swarmtrain.utils.facade import close_aio_worker, run_in_worker_thread, thread_aio_property
from swarmtrain.utils.logs import show_logs

__all__ = ["Optimizer"]

logger = logging.getLogger(__name__)

GradientAveragerFactory = Callable[..., GradientAverager]


def _time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0.1; None: no deadline."""
    return None if deadline is None else max(0.1, deadline - time.monotonic())


def _check_dht(dht: Any) -> None:
    if not isinstance(dht, DHT):
        raise TypeError(
            f"dht must be a running swarmtrain.DHT, got {type(dht).__name__}: create one with "
            "swarmtrain.DHT(initial_peers=[...])"
        )
    if not dht.is_alive():
        raise RuntimeError("dht is not running (it was shut down, or made with start=False)")


class Optimizer(EpochUpdates):
    """Trains with peers in epochs of ``target_batch_size`` samples; see the module docstring.

    :param dht: a running blocking ``DHT``
    :param run_id: name of the training run (the DHT prefix of its keys); peers of one run must
      use the same value and the same settings
    :param target_batch_size: samples the whole swarm accumulates per epoch (optimizer step)
    :param batch_size_per_step: samples per local ``step`` (else pass ``step(batch_size=...)``)
    :param optimizer: a ``torch.optim.Optimizer`` or a factory called with the param groups
      (a factory is needed for ``offload_optimizer`` and the delays)
    :param params: parameters or param groups (required with a factory)
    :param scheduler: an LR scheduler or a factory; it follows the epoch, not the local steps
    :param matchmaking_time: seconds to gather a group for each averaging round; the gradient
      round's matchmaking starts this long before the swarm's expected end of the epoch
    :param averaging_timeout: give up an averaging round (matchmaking + all-reduce) after this
    :param allreduce_timeout: give up all-reduce after this long (default ``averaging_timeout``)
    :param next_chunk_timeout: drop a peer that sends nothing for this long during all-reduce or
      a state download (default: the averagers' own, 10 s in all-reduce)
    :param load_state_timeout: give up :meth:`load_state_from_peers` after this long
    :param reuse_grad_buffers: accumulate gradients in ``param.grad`` (never call
      ``zero_grad()`` then); works with every delay
    :param offload_optimizer: step on CPU fp32 copies of the parameters (factory only; default
      on with a factory unless ``use_local_updates`` without delays)
    :param delay_optimizer_step: run the optimizer step and the state round in the background
      (default ``delay_grad_averaging``; needs ``offload_optimizer`` and
      ``delay_state_averaging``)
    :param delay_grad_averaging: wait for the gradient round in the background too
    :param delay_state_averaging: run state rounds in the background (default True)
    :param average_state_every: average the training state every this many epochs
    :param use_local_updates: step locally at each ``step``, average the state each epoch
    :param client_mode: cannot be dialled (default: the DHT's)
    :param auxiliary: help average without training (see the module docstring)
    :param grad_compression: codec of gradient averaging; ``state_averaging_compression``: of
      state averaging; ``load_state_compression``: of state downloads (default
      ``state_averaging_compression``)
    :param grad_averager_factory: builds the gradient averager; called like
      ``GradientAverager(parameters, dht=, prefix=, reuse_grad_buffers=, client_mode=,
      compression=, **AveragerConfig keywords)`` (e.g. a PowerSGD averager)
    :param average_opt_statistics: names of optimizer statistics averaged with the parameters
      (e.g. ``("exp_avg_sq",)``)
    :param extra_tensors: more tensors averaged and shared with the state (e.g. batch-norm
      statistics; CPU tensors with ``offload_optimizer``)
    :param aggregation: how gradients are averaged (the state too, with
      ``use_local_updates``): ``"mean"`` or ``"centered_clip"`` (robust to a minority of peers
      sending garbage; ``clip_tau``, ``clip_iterations``: see ``AveragerConfig``)
    :param averager_opts: more ``AveragerConfig`` keywords for both averagers
    :param tracker_opts: more ``ProgressTracker`` keywords
    :param trusted_peers: peer ids whose progress records vote and vouch (the organisers';
      ``ProgressTracker(trusted_peers=)``, see docs/security.md)
    :param verbose: log progress at INFO level (else DEBUG) and show swarmtrain's logs on stderr
      (``swarmtrain.utils.logs``)
    """

    def __init__(
        self,
        *,
        dht,
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
        grad_averager_factory: GradientAveragerFactory | None = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        aggregation: str = "mean",
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        trusted_peers: Sequence[Any] = (),
        verbose: bool = False,
    ):
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
        )
        if client_mode is None:
            _check_dht(dht)
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
        _check_dht(dht)

        self.dht, self.run_id = dht, run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.matchmaking_time = float(matchmaking_time)
        self.averaging_timeout = float(averaging_timeout)
        self.load_state_timeout = float(load_state_timeout)
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
        self._epoch_core = EpochCore(  # decides what each step and epoch end does
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

        common = averager_options(
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            averager_opts=averager_opts,
        )
        self.state_averager: TrainingStateAverager | None = None
        self.grad_averager: GradientAverager | None = None
        self.tracker: ProgressTracker | None = None
        self._shut_down = False  # shutdown() keeps the components to inspect (hivemind's)
        self._rounds: GradientRounds | None = None
        #: warnings with what to do: peers with another model, state downloads that keep failing
        self.health = SwarmHealth(self.run_id)
        self._last_progress: GlobalProgress | None = None  # the tracker's, at the last step
        self._gradients_consumed = threading.Event()  # the optimizer took the last round's result
        self._gradients_consumed.set()
        try:
            state_opts = state_averager_options(
                common,
                state_averaging_compression=state_averaging_compression,
                load_state_compression=load_state_compression,
                use_local_updates=self.use_local_updates,
                aggregation=aggregation,
            )
            self.state_averager = TrainingStateAverager(
                dht=dht,
                optimizer=optimizer,
                params=params,
                scheduler=scheduler,
                prefix=f"{run_id}_state_averager",
                client_mode=client_mode,
                status_loglevel=self.status_loglevel,
                offload_optimizer=offload_optimizer,
                custom_gradients=offload_optimizer and not self.use_local_updates,
                # a delayed round must not overwrite the steps taken while it ran (the optimizer's
                # copies, with offload_optimizer, are averaged in place instead)
                delta_rule_averaging=self.delay_state_averaging
                and (self.use_local_updates or not offload_optimizer),
                average_opt_statistics=average_opt_statistics,
                extra_tensors=extra_tensors,
                **state_opts,
            )
            if not self.use_local_updates:
                grad_opts = grad_averager_options(
                    common, aggregation=aggregation, grad_compression=grad_compression
                )
                self._make_grad_averager(grad_averager_factory, grad_opts)
            self.tracker = ProgressTracker(
                dht,
                run_id,
                target_batch_size,
                client_mode=client_mode,
                status_loglevel=self.status_loglevel,
                **{
                    "partner_window": max(4, 2 * self.average_state_every),
                    "trusted_peers": trusted_peers,
                    **(tracker_opts or {}),
                },
            )
            self.state_averager.round_observer = self._note_round_partners
        except BaseException:
            self.shutdown()
            raise

    def _make_grad_averager(
        self,
        factory: GradientAveragerFactory | None,
        grad_opts: dict[str, Any],
    ) -> None:
        self.grad_averager = (factory or GradientAverager)(
            self._state_averager.main_parameters,
            dht=self.dht,
            prefix=f"{self.run_id}_grad_averager",
            reuse_grad_buffers=self.reuse_grad_buffers,
            client_mode=self.client_mode,
            **grad_opts,
        )
        with self.grad_averager.get_tensors() as averaged:
            params = self.main_parameters
            self._grad_buffers_match = len(averaged) == len(params) and all(
                a.shape == p.shape for a, p in zip(averaged, params, strict=False)
            )
        if self.delay_optimizer_step and not self._grad_buffers_match:
            raise ValueError(
                "delay_optimizer_step needs a gradient averager whose averaged tensors are one "
                "gradient per parameter; this one averages other tensors (e.g. PowerSGD factors)"
            )
        self._rounds = GradientRounds(
            self.grad_averager,
            run_id=self.run_id,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            status_loglevel=self.status_loglevel,
            health=self.health,
            swarm_epoch=lambda: self._tracker.global_epoch,
        )
        self.health.model = describe_parameters(self.main_parameters)

    # ------------------------------------------------------------------ torch.optim-like

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (on CPU copies with ``offload_optimizer``)."""
        return self._state_averager.optimizer

    @property
    def main_parameters(self) -> tuple[torch.Tensor, ...]:
        """The model's parameters, whose ``.grad`` autograd writes."""
        return self._state_averager.main_parameters

    @property
    def _state_averager(self) -> TrainingStateAverager:
        if self.state_averager is None or self._shut_down:
            raise RuntimeError("this Optimizer was shut down")
        return self.state_averager

    def _check_dht_alive(self) -> None:
        """Raise if the DHT was shut down: the averagers would go on without peers, silently."""
        if not self.dht.is_alive():
            raise RuntimeError(
                f"{self.run_id}: the DHT of this Optimizer was shut down, so it cannot reach its "
                "peers: shut the Optimizer down before its DHT"
            )

    @property
    def _tracker(self) -> ProgressTracker:
        if self.tracker is None or self._shut_down:
            raise RuntimeError("this Optimizer was shut down")
        return self.tracker

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def scheduler(self) -> LRScheduler | None:
        return self._state_averager.scheduler

    @property
    def local_epoch(self) -> int:
        """This peer's epoch: the number of optimizer steps of the swarm it took part in."""
        if self._shut_down and self.state_averager is not None:
            return self.state_averager.local_epoch  # the last one, also after shutdown()
        return self._state_averager.local_epoch

    @property
    def global_epoch(self) -> int:
        if self._shut_down and self.tracker is not None:
            return self.tracker.global_epoch
        return self._tracker.global_epoch

    @property
    def epochs_averaged(self) -> int:
        """Epochs whose gradients were averaged with a group."""
        return self._rounds.averaged if self._rounds is not None else 0

    @property
    def scheduled_grads(self) -> StepControl | None:
        """The gradient round pre-scheduled for the end of this epoch (hivemind's name), if
        any: matchmaking for it is under way; None without gradient averaging."""
        return self._rounds.scheduled if self._rounds is not None else None

    @property
    def epochs_alone(self) -> int:
        """Epochs that used the local gradients (no peers seen, or the round failed)."""
        return self._rounds.alone if self._rounds is not None else 0

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm (hivemind's test; a peer one
        epoch behind may still have to catch up, see ``swarmtrain.optim._epoch_sync``)."""
        return self.local_epoch >= self._tracker.global_epoch - 1

    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> int:
        """Announce this peer and wait until the tracker sees ``num_peers`` peers (this one
        counted, unless it is auxiliary) or ``timeout`` seconds pass; return how many it sees.
        Call it before training when several peers start together: a peer that sees no one
        steps alone, and its first epochs (milliseconds each for a small model) leave the
        swarm out of step."""
        check_positive("num_peers", num_peers)
        check_positive("timeout", timeout)
        tracker = self._tracker
        self._check_dht_alive()
        if not self.auxiliary:  # an auxiliary peer publishes no progress and is not counted
            tracker.announce()
        try:  # woken by each change (gossip brings announcements at once); DHT as fallback
            seen = tracker.wait_num_peers(num_peers, timeout=timeout).num_peers
        except TimeoutError:
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

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
    ) -> Any:
        """Accumulate this batch and, when the swarm is ready, take a collaborative step (see
        the module docstring). ``grad_scaler``: a ``swarmtrain.optim.GradScaler`` when training
        with AMP. Returns the closure's loss (None without a closure)."""
        if self.auxiliary and (
            closure is not None or batch_size is not None or grad_scaler is not None
        ):
            raise ValueError("an auxiliary peer has no batches: call step() without arguments")
        if grad_scaler is not None:
            scaler_method(grad_scaler, "unscale_swarm_grads_")
            scaler_method(grad_scaler, "on_swarm_epoch_end_")
        state_averager = self._state_averager
        self._check_dht_alive()
        state_averager.step(apply_delayed_updates=True)  # what finished in the background
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.auxiliary:
            batch_size = self.batch_size_per_step if batch_size is None else batch_size
            if batch_size is None:
                raise ValueError("pass step(batch_size=...) or Optimizer(batch_size_per_step=...)")
            check_positive("batch_size", batch_size)

        tracker, core = self._tracker, self._epoch_core  # two calls into the tracker per step
        progress = self._last_progress or tracker.global_progress
        if core.is_behind(self.local_epoch, progress.epoch) and core.is_behind(
            self.local_epoch, tracker.global_epoch
        ):
            self._catch_up()
            return loss

        if not self.auxiliary:
            assert batch_size is not None
            if not self._accumulate(batch_size, grad_scaler):
                return loss
        progress = self._last_progress = tracker.global_progress
        plan = core.on_progress(self.local_epoch, progress, get_dht_time())
        if plan.schedule_round:
            assert self._rounds is not None
            self._rounds.maybe_schedule(plan.seconds_left, self.local_epoch, plan.num_peers_present)
        if plan.end_epoch:
            self._last_progress = None
            self._update_global_epoch(grad_scaler)
        return loss

    # ------------------------------------------------------------------ state

    def _catch_up(self) -> None:
        """Load the state from peers; if none could serve it and the swarm is one epoch ahead
        (or no peer shares a state at all), take the swarm's epoch with this peer's own state
        (its next state round pulls it in), rather than stay behind and average no gradients
        ever again. After a catch-up that left us behind, the next waits for a back-off
        (``EpochCore.catch_up_due``): until then a step only skips its batch."""
        if not self._epoch_core.catch_up_due(time.monotonic()):
            return
        logger.warning(
            "%s: local epoch %d is behind the swarm's epoch %d: loading state from peers",
            self.run_id,
            self.local_epoch,
            self._tracker.global_epoch,
        )
        self._last_progress = None
        if self.load_state_from_peers():
            return
        failure = self._state_averager.state_download_failure
        no_donor = failure is not None and not failure.donors
        enter = self._epoch_core.after_failed_catch_up(
            self.local_epoch, self._tracker.global_epoch, no_donor, now=time.monotonic()
        )
        if enter is None:
            logger.warning(
                "%s: still behind the swarm; the next try to catch up is in %.0f s",
                self.run_id,
                self._epoch_core.retry_in,
            )
        else:
            logger.warning(
                "%s: no peer served its state: moving to the swarm's epoch %d with this peer's "
                "own parameters",
                self.run_id,
                enter.epoch,
            )
            self._enter_epoch(enter.epoch)

    def _enter_epoch(self, epoch: int) -> None:
        """Start ``epoch`` afresh: drop the accumulated gradients, tell the tracker, serve the
        state with that priority."""
        self._state_averager.local_epoch = epoch
        if self.grad_averager is not None:
            self.grad_averager.reset_accumulated_grads_()
        self.local_samples_accumulated = 0.0
        self._tracker.update_epoch(epoch)
        if not self.client_mode:
            self._state_averager.state_sharing_priority = epoch

    def _vouched_epoch(self) -> int | None:
        """The swarm's epoch as its progress records show it (None: no other peer seen yet);
        a donor's state may be at most ``EPOCH_MARGIN`` epochs ahead of it."""
        progress = self._tracker.global_progress
        others_seen = progress.num_peers >= 2 or progress.epoch > self.local_epoch
        return progress.epoch if others_seen else None

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download the training state (parameters, optimizer and scheduler state, epoch) from
        a peer, retrying until ``timeout`` (default ``load_state_timeout``) while some peer
        declares a state to share; returns False at once when none does (a lone first peer).
        The accumulated gradients are dropped. Returns whether a state was loaded."""
        return self._load_state(timeout)

    def _load_state(self, timeout: float | None, min_epoch: int | None = None) -> bool:
        """:meth:`load_state_from_peers`; ``min_epoch``: skip donors whose state is older
        (they are retried until ``timeout``)."""
        timeout = self.load_state_timeout if timeout is None else timeout
        check_positive("timeout", timeout)
        state_averager, tracker = self._state_averager, self._tracker
        self._check_dht_alive()
        if self._rounds is not None:
            self._rounds.tag_along()
        state_averager.step(wait_for_delayed_updates=True)
        deadline = time.monotonic() + timeout
        loaded, detail = False, "no peer served a state in time"
        errors: set[str] = set()  # each distinct error is logged once
        while not loaded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                loaded = state_averager.load_state_from_peers(
                    timeout=remaining, swarm_epoch=self._vouched_epoch(), min_epoch=min_epoch
                )
            except Exception as e:
                detail = repr(e)
                if detail not in errors:
                    errors.add(detail)
                    logger.warning("%s: loading state from peers failed: %s", self.run_id, detail)
            else:
                failure = state_averager.state_download_failure
                if not loaded and failure is not None:
                    if not failure.donors:  # as hivemind: nothing to wait for
                        logger.info(
                            "%s: no peer shares a training state: nothing to load", self.run_id
                        )
                        return False
                    detail = str(failure)
            self.health.observe_state_download(bool(loaded), "" if loaded else detail)
            if not loaded:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if not loaded:
            logger.warning(
                "%s: could not load the training state from peers in %.0f s (%s)",
                self.run_id,
                timeout,
                detail,
            )
            return False
        enter = self._epoch_core.after_load(state_averager.local_epoch, tracker.global_epoch)
        self._enter_epoch(enter.epoch)  # the swarm's, if the donor was about to move on
        logger.log(
            self.status_loglevel,
            "%s: loaded the training state, now at epoch %d",
            self.run_id,
            self.local_epoch,
        )
        return True

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the epoch and the scheduler's state."""
        return make_checkpoint(self._state_averager)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (a plain torch optimizer state works too)."""
        state_averager = self._state_averager
        state_averager.step(wait_for_delayed_updates=True)
        epoch = load_checkpoint(state_averager, state_dict)
        if epoch is not None:
            self._tracker.update_epoch(epoch)
            self.local_samples_accumulated = 0.0
            if self.grad_averager is not None:
                self.grad_averager.reset_accumulated_grads_()

    # ------------------------------------------------------------------ lifetime

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the tracker (it says goodbye), the gradient averager, then the state averager
        (after its background thread). They stay readable (``local_epoch``, ``tracker``,
        ``state_averager.is_alive()``); ``step()`` and the other calls raise RuntimeError.

        ``timeout``: return after about this many seconds (plus at most a few seconds for
        cancelled closes to unwind) even if a goodbye or close hangs, e.g. when this peer's
        network is gone; None waits for each close."""
        if self._shut_down:
            return
        close_aio_worker(self)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._rounds is not None:
            self._rounds.cancel()
        errors = []
        try:  # the attributes stay set until the state averager's worker thread has ended
            for component in (self.tracker, self.grad_averager, self.state_averager):
                if component is None:
                    continue
                try:
                    component.shutdown(_time_left(deadline))
                except Exception as e:  # stop the others anyway
                    errors.append(e)
        finally:
            self._shut_down = True  # the stopped components stay readable
        if errors:
            raise errors[0]

    #: the trio way in: ``async with Optimizer.create(dht=async_dht, ...) as opt:`` and
    #: ``await opt.step()`` in the trainer's own trio loop (``swarmtrain.optim.async_optimizer``)
    create = AsyncOptimizer.create

    #: asyncio awaitables, e.g. ``await opt.aio.step()``: each runs the blocking method in
    #: this optimizer's worker thread, never blocking the asyncio loop
    aio = thread_aio_property("step", "load_state_from_peers", "wait_for_peers", "shutdown")

    @classmethod
    async def aio_create(cls, *args: Any, **kwargs: Any) -> Optimizer:
        """From asyncio: ``opt = await Optimizer.aio_create(dht=..., ...)`` builds the optimizer
        (seconds: averagers start, state may load) in a worker thread, so the loop goes on."""
        return await run_in_worker_thread(cls, *args, **kwargs)

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        epoch = self.state_averager.local_epoch if self.state_averager is not None else None
        return f"{type(self).__name__}(run_id={self.run_id!r}, local_epoch={epoch})"
