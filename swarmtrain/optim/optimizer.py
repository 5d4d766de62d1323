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

1. a peer whose ``local_epoch`` is more than one epoch behind the swarm loads the training state
   from peers (:meth:`Optimizer.load_state_from_peers`) and returns;
2. the gradients are added to the accumulators (``GradientAverager.accumulate_grads_``) and the
   number of samples accumulated this epoch is reported (``ProgressTracker``);
3. when the swarm reached ``target_batch_size`` (``tracker.ready_to_update_epoch``): the
   accumulated gradients are averaged with the peers, weighted by samples (if that fails, the
   local mean gradient is used and the failure logged), the optimizer steps on them, the
   training state is averaged every ``average_state_every`` epochs (when other peers are seen),
   the epoch is incremented and the accumulators are reset.

With ``use_local_updates=True`` the optimizer steps on the local gradients at every ``step``
and, at each epoch's end, the peers average their training state instead of gradients.

An ``auxiliary`` peer has no data: it calls ``step()`` without a batch size, helps the others
average gradients (``AveragerConfig.auxiliary``), never steps the optimizer, and follows the
epoch; its parameters are not kept up to date (call :meth:`load_state_from_peers` to get them).

Peers must start from the same parameters: build the model with the same seed, or call
:meth:`Optimizer.load_state_from_peers` before training.

Resource handling: the constructor starts a ``ProgressTracker``, a ``TrainingStateAverager``
and (without ``use_local_updates``) a ``GradientAverager`` on ``dht``; :meth:`shutdown` (or
leaving a ``with`` block) stops them in that order. The DHT is the caller's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch

from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.optim.progress_tracker_blocking import ProgressTracker
from swarmtrain.optim.state_averager import (
    LRScheduler,
    OptimizerFactory,
    SchedulerFactory,
    TrainingStateAverager,
)

__all__ = ["Optimizer"]

logger = logging.getLogger(__name__)

_EPOCH_KEY = "swarmtrain_local_epoch"
_SCHEDULER_KEY = "swarmtrain_scheduler"


def _positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")


class Optimizer:
    """Trains with peers in epochs of ``target_batch_size`` samples; see the module docstring.

    :param dht: a running blocking ``DHT``
    :param run_id: name of the training run (the DHT prefix of its keys); peers of one run must
      use the same value and the same settings
    :param target_batch_size: samples the whole swarm accumulates per epoch (optimizer step)
    :param batch_size_per_step: samples per local ``step`` (else pass ``step(batch_size=...)``)
    :param optimizer: a ``torch.optim.Optimizer`` or a factory called with the param groups
    :param params: parameters or param groups (required with a factory)
    :param scheduler: an LR scheduler or a factory; it follows the epoch, not the local steps
    :param matchmaking_time: seconds to gather a group for each averaging round
    :param averaging_timeout: give up an averaging round (matchmaking + all-reduce) after this
    :param load_state_timeout: give up :meth:`load_state_from_peers` after this long
    :param average_state_every: average the training state every this many epochs
    :param use_local_updates: step locally at each ``step``, average the state each epoch
    :param client_mode: cannot be dialled (default: the DHT's)
    :param auxiliary: help average gradients without training (see the module docstring)
    :param grad_compression: codec of gradient averaging; ``state_averaging_compression``: of
      state averaging (and state downloads)
    :param averager_opts: more ``AveragerConfig`` keywords for both averagers
    :param tracker_opts: more ``ProgressTracker`` keywords
    :param verbose: log progress at INFO level (else DEBUG)
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
        load_state_timeout: float = 60.0,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: Any = None,
        state_averaging_compression: Any = None,
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        verbose: bool = False,
    ):
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty string")
        if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int):
            raise TypeError(f"target_batch_size must be an int, got {target_batch_size!r}")
        _positive("target_batch_size", target_batch_size)
        _positive("batch_size_per_step", batch_size_per_step, allow_none=True)
        _positive("matchmaking_time", matchmaking_time)
        _positive("averaging_timeout", averaging_timeout)
        _positive("load_state_timeout", load_state_timeout)
        if (
            isinstance(average_state_every, bool)
            or not isinstance(average_state_every, int)
            or average_state_every < 1
        ):
            raise ValueError(f"average_state_every must be an int >= 1, got {average_state_every}")
        if client_mode is None:
            client_mode = bool(dht.client_mode)
        if auxiliary and client_mode:
            raise ValueError("an auxiliary peer must accept connections: it cannot be a client")
        if auxiliary and use_local_updates:
            raise ValueError("an auxiliary peer does not train: use_local_updates makes no sense")
        if auxiliary and batch_size_per_step is not None:
            raise ValueError("an auxiliary peer has no batches: do not pass batch_size_per_step")
        for name, opts in (("averager_opts", averager_opts), ("tracker_opts", tracker_opts)):
            if opts is not None and not isinstance(opts, dict):
                raise TypeError(f"{name} must be a dict of keywords")
        if tracker_opts and "client_mode" in tracker_opts:
            raise ValueError("pass client_mode to the Optimizer, not in tracker_opts")

        self.dht, self.run_id = dht, run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.matchmaking_time = float(matchmaking_time)
        self.averaging_timeout = float(averaging_timeout)
        self.load_state_timeout = float(load_state_timeout)
        self.average_state_every = average_state_every
        self.use_local_updates = bool(use_local_updates)
        self.client_mode, self.auxiliary = client_mode, bool(auxiliary)
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        self.local_samples_accumulated = 0.0  #: this epoch, this peer
        self.last_epoch_samples = 0.0  #: samples this peer contributed to its last epoch
        self.epochs_averaged = self.epochs_alone = 0  #: gradient rounds that did / did not work

        common: dict[str, Any] = {
            "min_matchmaking_time": self.matchmaking_time,
            "request_timeout": min(3.0, self.matchmaking_time / 2),
            "allreduce_timeout": self.averaging_timeout,
        }
        common.update(averager_opts or {})
        self.state_averager: TrainingStateAverager | None = None
        self.grad_averager: GradientAverager | None = None
        self.tracker: ProgressTracker | None = None
        try:
            state_opts = dict(common)
            if state_averaging_compression is not None:
                state_opts.setdefault("compression", state_averaging_compression)
                state_opts.setdefault("state_compression", state_averaging_compression)
            self.state_averager = TrainingStateAverager(
                dht=dht,
                optimizer=optimizer,
                params=params,
                scheduler=scheduler,
                prefix=f"{run_id}_state_averager",
                client_mode=client_mode,
                status_loglevel=self.status_loglevel,
                **state_opts,
            )
            if not self.use_local_updates:
                grad_opts = dict(common)
                if grad_compression is not None:
                    grad_opts.setdefault("compression", grad_compression)
                if self.auxiliary:
                    grad_opts["auxiliary"] = True
                self.grad_averager = GradientAverager(
                    self.state_averager.main_parameters,
                    dht=dht,
                    prefix=f"{run_id}_grad_averager",
                    client_mode=client_mode,
                    **grad_opts,
                )
            self.tracker = ProgressTracker(
                dht,
                run_id,
                target_batch_size,
                client_mode=client_mode,
                status_loglevel=self.status_loglevel,
                **(tracker_opts or {}),
            )
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ torch.optim-like

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._state_averager.optimizer

    @property
    def _state_averager(self) -> TrainingStateAverager:
        if self.state_averager is None:
            raise RuntimeError("this Optimizer was shut down")
        return self.state_averager

    @property
    def _tracker(self) -> ProgressTracker:
        if self.tracker is None:
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
        return self._state_averager.local_epoch

    @property
    def global_epoch(self) -> int:
        return self._tracker.global_epoch

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm (else it must load state)."""
        return self.local_epoch >= self._tracker.global_epoch - 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients (the accumulators are not touched)."""
        for param in self._state_averager.main_parameters:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """Accumulate this batch and, when the swarm is ready, take a collaborative step (see
        the module docstring). Returns the closure's loss (None without a closure)."""
        if self.auxiliary and (closure is not None or batch_size is not None):
            raise ValueError("an auxiliary peer has no batches: call step() without arguments")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.auxiliary:
            batch_size = self.batch_size_per_step if batch_size is None else batch_size
            if batch_size is None:
                raise ValueError("pass step(batch_size=...) or Optimizer(batch_size_per_step=...)")
            _positive("batch_size", batch_size)

        if not self.is_synchronized_with_peers():
            logger.warning(
                "%s: local epoch %d is behind the swarm's epoch %d: loading state from peers",
                self.run_id,
                self.local_epoch,
                self._tracker.global_epoch,
            )
            self.load_state_from_peers()
            return loss

        if not self.auxiliary:
            assert batch_size is not None
            if self.use_local_updates:
                self._state_averager.step(optimizer_step=True, zero_grad=False)
            else:
                assert self.grad_averager is not None
                self.grad_averager.accumulate_grads_(batch_size)
            self.local_samples_accumulated += batch_size
            self._tracker.report_local_progress(
                self.local_epoch, int(self.local_samples_accumulated)
            )
        if self._tracker.ready_to_update_epoch:
            self._update_global_epoch()
        return loss

    def _update_global_epoch(self) -> None:
        tracker, state_averager = self._tracker, self._state_averager
        with tracker.pause_updates():
            averaged = self.grad_averager is not None and self._average_gradients()
            swarm_not_empty = tracker.global_progress.num_peers > 1
            next_epoch = self.local_epoch + 1
            average_state = (
                swarm_not_empty
                and not self.auxiliary
                and next_epoch % self.average_state_every == 0
            )
            optimizer_step = not self.auxiliary and not self.use_local_updates
            if optimizer_step:
                assert self.grad_averager is not None
                with self.grad_averager.use_averaged_gradients():
                    state_averager.step(
                        increment_epoch=True,
                        optimizer_step=True,
                        averaging_round=average_state,
                        averaging_opts={"timeout": self.averaging_timeout}
                        if average_state
                        else None,
                    )
            else:
                state_averager.step(
                    increment_epoch=True,
                    averaging_round=average_state,
                    averaging_opts={"timeout": self.averaging_timeout} if average_state else None,
                )
            if self.grad_averager is not None:
                self.grad_averager.reset_accumulated_grads_()
                if not optimizer_step:
                    self.grad_averager.notify_used_averaged_gradients()
            self.last_epoch_samples = self.local_samples_accumulated
            self.local_samples_accumulated = 0.0
            tracker.update_epoch(self.local_epoch)
        logger.log(
            self.status_loglevel,
            "%s: epoch %d (%s gradients, %s state)",
            self.run_id,
            self.local_epoch,
            "averaged" if averaged else "local",
            "averaged" if average_state else "local",
        )

    def _average_gradients(self) -> bool:
        """Average the accumulated gradients with a group; on failure the averaged buffers hold
        the local mean gradient. Returns whether the group round worked."""
        assert self.grad_averager is not None
        try:
            gathered = self.grad_averager.step(
                weight=0.0 if self.auxiliary else None,
                reset_accumulators=False,
                timeout=self.averaging_timeout,
            )
        except Exception as e:
            self.epochs_alone += 1
            logger.log(
                logging.WARNING if self._tracker.global_progress.num_peers > 1 else logging.DEBUG,
                "%s: averaging gradients failed (%r): using the local gradients",
                self.run_id,
                e,
            )
            return False
        self.epochs_averaged += 1
        logger.log(
            self.status_loglevel, "%s: averaged gradients with %d peers", self.run_id, len(gathered)
        )
        return True

    # ------------------------------------------------------------------ state

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download the training state (parameters, optimizer and scheduler state, epoch) from
        a peer, retrying until ``timeout`` (default ``load_state_timeout``); the accumulated
        gradients are dropped. Returns whether a state was loaded."""
        timeout = self.load_state_timeout if timeout is None else timeout
        _positive("timeout", timeout)
        state_averager, tracker = self._state_averager, self._tracker
        deadline = time.monotonic() + timeout
        loaded = False
        while not loaded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                loaded = state_averager.load_state_from_peers(timeout=remaining)
            except Exception as e:
                logger.warning("%s: loading state from peers failed: %r", self.run_id, e)
            if not loaded:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if not loaded:
            logger.warning("%s: could not load the training state from peers", self.run_id)
            return False
        global_epoch = tracker.global_epoch
        if global_epoch - 1 <= state_averager.local_epoch < global_epoch:
            state_averager.local_epoch = global_epoch  # the donor was about to move on
        if self.grad_averager is not None:
            self.grad_averager.reset_accumulated_grads_()
        self.local_samples_accumulated = 0.0
        tracker.update_epoch(state_averager.local_epoch)
        logger.log(
            self.status_loglevel,
            "%s: loaded the training state, now at epoch %d",
            self.run_id,
            self.local_epoch,
        )
        return True

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the epoch and the scheduler's state."""
        state = dict(self.optimizer.state_dict())
        state[_EPOCH_KEY] = self.local_epoch
        if self.scheduler is not None:
            state[_SCHEDULER_KEY] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (a plain torch optimizer state works too)."""
        state = dict(state_dict)
        epoch = state.pop(_EPOCH_KEY, None)
        scheduler_state = state.pop(_SCHEDULER_KEY, None)
        state_averager = self._state_averager
        with state_averager.lock_optimizer:
            self.optimizer.load_state_dict(state)
            if scheduler_state is not None and self.scheduler is not None:
                self.scheduler.load_state_dict(scheduler_state)
            if epoch is not None:
                if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                    raise ValueError(f"invalid epoch in the state dict: {epoch!r}")
                state_averager.local_epoch = epoch
        if epoch is not None:
            self._tracker.update_epoch(epoch)
            self.local_samples_accumulated = 0.0
            if self.grad_averager is not None:
                self.grad_averager.reset_accumulated_grads_()

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Stop the tracker (it says goodbye), then the state and gradient averagers."""
        components = (self.tracker, self.state_averager, self.grad_averager)
        self.tracker = self.state_averager = self.grad_averager = None
        errors = []
        for component in components:
            if component is None:
                continue
            try:
                component.shutdown()
            except Exception as e:  # stop the others anyway
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        epoch = self.state_averager.local_epoch if self.state_averager is not None else None
        return f"{type(self).__name__}(run_id={self.run_id!r}, local_epoch={epoch})"
