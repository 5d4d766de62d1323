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
- ``delay_optimizer_step``: the optimizer step (and the state round after it) runs in the
  background while the trainer goes on with the next epoch's batches; the model gets the
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

How it runs: one implementation, :class:`~swarmtrain.optim.async_optimizer.AsyncOptimizer` (the
trio optimizer of ``Optimizer.create``), entered on swarmtrain's background trio loop as a
``DHT`` runs its ``DHTNode``. A ``step`` runs its batch part (``AsyncOptimizer.on_batch``: the
finiteness check, the accumulation, the progress report; no await) in the trainer's own thread
and enters the loop only when there is loop work: delayed updates to apply, a catch-up, the
gradient round to pre-schedule, the epoch's end. Reads (``local_epoch``, the tracker's
snapshots, ``param_groups``) are direct.

Resource handling: the constructor starts an ``AsyncOptimizer`` on the background loop: a
``TrainingStateAverager``'s trio averager, (without ``use_local_updates``) a gradient
averager's and a progress tracker, and a task group for the delayed work; :meth:`shutdown` (or
leaving a ``with`` block) cancels the delayed work, stops the tracker (it says goodbye), then the
averagers (a running round fails). The DHT is the caller's.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.process_backend import HelperProcessBackend
from swarmtrain.dht import DHT, AsyncDHT
from swarmtrain.dht.node import DHTNode
from swarmtrain.optim._optimizer_options import check_keywords, resolve_modes
from swarmtrain.optim.async_optimizer import AsyncOptimizer
from swarmtrain.optim.progress_tracker import AsyncProgressTracker
from swarmtrain.optim.progress_tracker_blocking import ProgressTracker
from swarmtrain.optim.state_averager import LRScheduler, TrainingStateAverager
from swarmtrain.utils.background import BackgroundRuntime, BackgroundService
from swarmtrain.utils.facade import close_aio_worker, run_in_worker_thread, thread_aio_property

__all__ = ["Optimizer"]


def _check_dht(dht: Any) -> None:
    if not isinstance(dht, DHT):
        raise TypeError(
            f"dht must be a running swarmtrain.DHT, got {type(dht).__name__}: create one with "
            "swarmtrain.DHT(initial_peers=[...])"
        )
    if not dht.is_alive():
        raise RuntimeError("dht is not running (it was shut down, or made with start=False)")


def _check_arguments(dht: Any, kwargs: dict[str, Any]) -> None:
    """Raise on bad keywords before the network is touched (``AsyncOptimizer.__init__``
    checks them again, with the same functions), then on a DHT that is not running."""
    bound = inspect.signature(AsyncOptimizer.__init__).bind(None, dht=dht, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    check_keywords(**{k: arguments[k] for k in inspect.signature(check_keywords).parameters})
    if arguments["client_mode"] is None:
        _check_dht(dht)
        arguments["client_mode"] = bool(dht.client_mode)
    resolve_modes(**{k: arguments[k] for k in inspect.signature(resolve_modes).parameters})
    _check_dht(dht)


def _builds_a_helper_process(factory: Any) -> bool:
    target = factory.func if isinstance(factory, functools.partial) else factory
    return isinstance(target, type) and issubclass(target, HelperProcessBackend)


def _on_blocking_dht(factory: Callable[..., Any], dht: DHT) -> Callable[..., Any]:
    """``factory`` given the blocking ``dht`` (a helper process bootstraps from its peers and
    keywords) instead of the trio one."""

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["dht"] = dht
        return factory(*args, **kwargs)

    return make


class _TrackerView(ProgressTracker):
    """``opt.tracker``: the blocking ``ProgressTracker`` API over the optimizer's own
    ``AsyncProgressTracker`` (the optimizer starts and stops it)."""

    def __init__(self, dht: DHT, runtime: BackgroundRuntime, service: AsyncProgressTracker):
        self.dht, self._runtime, self._service = dht, runtime, service
        self._pid = os.getpid()

    def shutdown(self, timeout: float | None = None) -> None:
        """Nothing to stop here: ``Optimizer.shutdown`` stops the tracker."""
        self._shut_down = True


class _StateAveragerView:
    """``opt.state_averager``: the optimizer's ``TrainingStateAverager`` (its torch side:
    optimizer, copies, locks; built with ``start=False``), whose switches reach the trio
    averager that serves and averages its state, and whose waits are the optimizer's. Reads
    of other attributes are the torch side's; setting one raises (the Optimizer drives its
    state averager: a value set on the torch side would be ignored, e.g. ``round_observer``)."""

    _SETTABLE = ("allow_state_sharing", "state_sharing_priority")

    def __init__(self, owner: Optimizer, state: TrainingStateAverager):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._SETTABLE:
            raise AttributeError(
                f"opt.state_averager.{name} cannot be set: the Optimizer runs its state "
                f"averager itself (settable here: {', '.join(self._SETTABLE)}); for other "
                "settings use the Optimizer's keywords or a TrainingStateAverager of your own"
            )
        object.__setattr__(self, name, value)

    def _service_attr(self, name: str) -> Any:
        runtime, opt = self._owner._running()
        return runtime.call_sync(getattr, opt._state_service, name)

    def _set_service_attr(self, name: str, value: Any) -> None:
        runtime, opt = self._owner._running()
        runtime.call_sync(setattr, opt._state_service, name, value)

    @property
    def local_epoch(self) -> int:
        return self._state.local_epoch

    @property
    def allow_state_sharing(self) -> bool:
        return self._service_attr("allow_state_sharing")

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self._set_service_attr("allow_state_sharing", bool(value))

    @property
    def state_sharing_priority(self) -> float:
        return self._service_attr("state_sharing_priority")

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._set_service_attr("state_sharing_priority", value)

    def is_alive(self) -> bool:
        return self._owner.is_alive()

    @property
    def averaging_in_progress(self) -> bool:
        """Whether a delayed state round still runs."""
        return self._owner._opt.state_averaging_in_progress

    def wait_for_delayed_updates(self, timeout: float | None = None) -> None:
        """Wait for the optimizer's delayed work and apply it (``timeout``: not used)."""
        self._owner.wait_for_delayed_updates()

    def step(
        self,
        wait_for_delayed_updates: bool | None = None,
        apply_delayed_updates: bool = True,
        averaging_round: bool = False,
        averaging_opts: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict | None:
        """The parts of ``TrainingStateAverager.step`` that fit an optimizer's own averager:
        apply the delayed work that finished, or (``wait_for_delayed_updates=True``) wait for
        all of it first; ``averaging_round=True``: one state round now, waited for and applied
        (``averaging_opts``: only ``timeout``), returning the group's ``{peer_id: epoch}`` or
        None. Optimizer steps and delayed rounds are the optimizer's own."""
        opts = dict(averaging_opts or {})
        unsupported = [k for k, v in kwargs.items() if v] + [k for k in opts if k != "timeout"]
        if unsupported:
            raise NotImplementedError(
                f"opt.state_averager.step({', '.join(unsupported)}=...): the Optimizer steps "
                "and averages its state itself; use a TrainingStateAverager of your own for that"
            )
        if averaging_round:
            return self._owner.average_state(opts.get("timeout"))
        if wait_for_delayed_updates:
            self._owner.wait_for_delayed_updates()
        elif apply_delayed_updates:
            self._owner._apply_delayed_updates()
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        """Nothing to stop here: ``Optimizer.shutdown`` stops the averager."""

    def __repr__(self) -> str:
        return f"<state averager of {self._owner!r}>"


_FORWARDED_READS = (
    "run_id",
    "target_batch_size",
    "batch_size_per_step",
    "matchmaking_time",
    "averaging_timeout",
    "load_state_timeout",
    "average_state_every",
    "use_local_updates",
    "client_mode",
    "auxiliary",
    "reuse_grad_buffers",
    "offload_optimizer",
    "delay_optimizer_step",
    "delay_grad_averaging",
    "delay_state_averaging",
    "status_loglevel",
    "local_samples_accumulated",
    "last_epoch_samples",
    "state_rounds_averaged",
    "health",
    "optimizer",
    "main_parameters",
    "param_groups",
    "state",
    "epochs_averaged",
    "epochs_alone",
    "skipped_batches",
    "_epoch_core",
)


def _read(name: str) -> property:
    def get(self: Optimizer) -> Any:
        return getattr(self._opt, name)

    return property(get, doc=f"As ``AsyncOptimizer.{name}``.")


class Optimizer(BackgroundService):
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
    :param declaration_linger: seconds a matchmaking declaration stays readable in the DHT past
      its expiration (default 5; >= 0), for both averagers: a DHT read slower than
      ``matchmaking_time`` (relays, a loaded machine) still finds the peers that declared
      while it ran; 0: declarations expire with the matchmaking window
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

    _service_name = "this Optimizer"

    def __init__(self, *, dht: DHT, **kwargs: Any):
        _check_arguments(dht, kwargs)
        factory = kwargs.get("grad_averager_factory")
        if factory is not None and _builds_a_helper_process(factory):
            kwargs["grad_averager_factory"] = _on_blocking_dht(factory, dht)

        async def get_async_dht(async_dht: AsyncDHT, node: DHTNode) -> AsyncDHT:
            return async_dht

        async_dht = dht.run_coroutine(get_async_dht)
        self.dht = dht
        self._calls = threading.Lock()  # the facade's calls, one at a time
        self._opt: AsyncOptimizer = self._start_in_background(
            lambda: AsyncOptimizer.create(dht=async_dht, **kwargs)
        )
        runtime, opt = self._running()
        assert opt._tracker_service is not None
        self.tracker: ProgressTracker = _TrackerView(dht, runtime, opt._tracker_service)
        self.state_averager = _StateAveragerView(self, opt._state)
        self.grad_averager = opt._grads

    # ------------------------------------------------------------------ reads
    # (plus those of _FORWARDED_READS, set below)
    if TYPE_CHECKING:  # the reads _FORWARDED_READS sets, for type checkers
        run_id: Any
        target_batch_size: Any
        batch_size_per_step: Any
        matchmaking_time: Any
        averaging_timeout: Any
        load_state_timeout: Any
        average_state_every: Any
        use_local_updates: Any
        client_mode: Any
        auxiliary: Any
        reuse_grad_buffers: Any
        offload_optimizer: Any
        delay_optimizer_step: Any
        delay_grad_averaging: Any
        delay_state_averaging: Any
        status_loglevel: Any
        local_samples_accumulated: Any
        last_epoch_samples: Any
        state_rounds_averaged: Any
        health: Any
        optimizer: Any
        main_parameters: Any
        param_groups: Any
        state: Any
        epochs_averaged: Any
        epochs_alone: Any
        skipped_batches: Any
        _epoch_core: Any

    @property
    def defaults(self) -> dict[str, Any]:
        return self._opt.optimizer.defaults

    @property
    def scheduler(self) -> LRScheduler | None:
        return self._opt.scheduler

    @property
    def local_epoch(self) -> int:
        """This peer's epoch: the number of optimizer steps of the swarm it took part in."""
        return self._opt.local_epoch

    @property
    def global_epoch(self) -> int:
        return self.tracker.global_epoch

    @property
    def scheduled_grads(self) -> StepControl | None:
        """The gradient round pre-scheduled for the end of this epoch (hivemind's name)."""
        return self._opt.scheduled_grads

    @property
    def state_averaging_in_progress(self) -> bool:
        return self._opt.state_averaging_in_progress

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm (hivemind's test)."""
        return self.local_epoch >= self.tracker.global_epoch - 1

    # ------------------------------------------------------------------ calls

    def _check_dht_alive(self) -> None:
        if not self.dht.is_alive():
            raise RuntimeError(
                f"{self._opt.run_id}: the DHT of this Optimizer was shut down, so it cannot "
                "reach its peers: shut the Optimizer down before its DHT"
            )

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``await fn(*args)`` on the loop (the optimizer must be running)."""
        runtime, _ = self._running()
        self._check_dht_alive()
        return runtime.call(fn, *args)

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
    ) -> Any:
        """Accumulate this batch and, when the swarm is ready, take a collaborative step.
        ``grad_scaler``: a ``swarmtrain.optim.GradScaler`` when training with AMP. Returns the
        closure's loss (None without a closure)."""
        _, opt = self._running()
        self._check_dht_alive()
        with self._calls:
            batch_size = opt.check_step_arguments(closure, batch_size, grad_scaler)
            if opt.delayed_updates_finished:
                self._call(opt.apply_delayed_updates)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            work = opt.on_batch(batch_size, grad_scaler)  # here: no loop hop per batch
            if work is not None:
                self._call(opt.do_step_work, work, grad_scaler)
            return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model's gradients (the accumulators are not touched)."""
        self._opt.zero_grad(set_to_none)

    def _apply_delayed_updates(self) -> None:
        _, opt = self._running()
        with self._calls:
            if opt.delayed_updates_finished:
                self._call(opt.apply_delayed_updates)

    def wait_for_delayed_updates(self) -> None:
        """Wait for the delayed work still running (optimizer steps, gradient and state rounds
        of ``delay_*``), then apply it to the model, e.g. before evaluating or saving."""
        _, opt = self._running()
        with self._calls:
            self._call(opt.wait_for_delayed_updates)

    def average_state(self, timeout: float | None = None) -> dict | None:
        """One state round now, waited for and applied (after the delayed work), e.g. a final
        sync of the models after training: the group's ``{peer_id: epoch}``, None if it did
        not average (logged). ``timeout``: of the round (default ``averaging_timeout``)."""
        _, opt = self._running()
        with self._calls:
            return self._call(opt.average_state, timeout)

    def wait_for_peers(self, num_peers: int, timeout: float = 60.0) -> int:
        """Announce this peer and wait until the tracker sees ``num_peers`` peers (this one
        counted, unless it is auxiliary) or ``timeout`` seconds pass; return how many it sees."""
        _, opt = self._running()
        return self._call(opt.wait_for_peers, num_peers, timeout)

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download the training state (parameters, optimizer and scheduler state, epoch) from
        a peer, retrying until ``timeout`` (default ``load_state_timeout``) while some peer
        declares a state to share; False at once when none does. Returns whether it loaded."""
        _, opt = self._running()
        with self._calls:
            return self._call(opt.load_state_from_peers, timeout)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the epoch and the scheduler's state."""
        _, opt = self._running()
        with self._calls:
            return self._call(opt.state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (a plain torch optimizer state works too)."""
        _, opt = self._running()
        with self._calls:
            self._call(opt.load_state_dict, state_dict)

    # ------------------------------------------------------------------ lifetime

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the optimizer on the loop: the tracker says goodbye, the averagers stop (a
        running round fails). It stays readable (``local_epoch``, ``tracker``); ``step()`` and
        the other calls raise RuntimeError. ``timeout``: cut the close short after about this
        many seconds (e.g. when this peer's network is gone); None waits for it."""
        if self._shut_down:
            return
        close_aio_worker(self)
        try:
            super().shutdown(timeout)
        finally:
            tracker = self.__dict__.get("tracker")
            if tracker is not None:
                tracker.shutdown()

    def _running(self) -> tuple[BackgroundRuntime, AsyncOptimizer]:
        if self._shut_down:
            raise RuntimeError("this Optimizer was shut down")
        return super()._running()

    #: the trio way in: ``async with Optimizer.create(dht=async_dht, ...) as opt:``
    create = AsyncOptimizer.create

    #: asyncio awaitables, e.g. ``await opt.aio.step()``: each runs the blocking method in
    #: this optimizer's worker thread, never blocking the asyncio loop
    aio = thread_aio_property("step", "load_state_from_peers", "wait_for_peers", "shutdown")

    @classmethod
    async def aio_create(cls, *args: Any, **kwargs: Any) -> Optimizer:
        """From asyncio: ``opt = await Optimizer.aio_create(dht=..., ...)`` builds the optimizer
        (seconds: averagers start) in a worker thread, so the loop goes on."""
        return await run_in_worker_thread(cls, *args, **kwargs)

    def __enter__(self) -> Optimizer:
        return self

    def __repr__(self) -> str:
        opt = self.__dict__.get("_opt")
        epoch = opt.local_epoch if opt is not None else None
        run_id = opt.run_id if opt is not None else None
        return f"{type(self).__name__}(run_id={run_id!r}, local_epoch={epoch})"


for _name in _FORWARDED_READS:
    setattr(Optimizer, _name, _read(_name))


def _show_keywords() -> None:
    """``inspect.signature(Optimizer)`` lists ``AsyncOptimizer``'s keywords."""
    init = inspect.signature(AsyncOptimizer.__init__)
    target: Any = Optimizer.__init__
    target.__signature__ = init


_show_keywords()
