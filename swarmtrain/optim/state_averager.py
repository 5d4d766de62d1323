"""``TrainingStateAverager``: keep parameters, optimizer statistics and epoch in sync with peers.

The averaged tensors are, in this order: the parameters, then for each name in
``average_opt_statistics`` that statistic of every parameter (e.g. Adam's ``exp_avg``,
``exp_avg_sq``), then ``extra_tensors`` (e.g. batch-norm statistics). A peer that fell behind
(or a newcomer) calls ``load_state_from_peers()`` and gets the parameters, the *whole* optimizer
state, the scheduler state and the epoch of the best donor.

Where the tensors live:

- default: the averager holds CPU fp32 copies; an averaging round copies the local tensors in,
  averages, and copies the result back (``delta_rule_averaging``: adds ``result - copy`` instead,
  keeping local updates made while a delayed round ran, so optimizer steps need not wait for
  it; costs one more copy of the averaged tensors);
- ``reuse_tensors`` (CPU tensors only): the local tensors are averaged in place;
- ``offload_optimizer`` (needs an optimizer *factory*): the optimizer is built on CPU fp32
  copies of the parameters and steps there; before a step the model's ``.grad`` is copied in
  (unless ``custom_gradients``), after it the new values are copied back into the model, in its
  own device and dtype. ``reuse_tensors`` defaults to ``offload_optimizer and not
  delta_rule_averaging``: the optimizer's copies are then the averaged tensors themselves.

``step(...)`` does, in this order and each optionally (hivemind's semantics): wait for and apply
delayed updates, ``increment_epoch``, an optimizer step, ``zero_grad``, the scheduler catching
up with ``local_epoch``, and an averaging round (``gather`` = our epoch; with
``sync_epoch_when_averaging`` we then take the group's highest epoch). ``delay_optimizer_step`` /
``delay_averaging`` run those phases in the background (tasks of the averager's nursery, run in
order); their results are applied by a later ``step`` (by default the next one with
``averaging_round=True`` waits for them). A delayed round after a step that is not delayed
averages the tensors as they were at that ``step`` call. A failed averaging round leaves the
local tensors unchanged and is logged at ``status_loglevel``; ``step`` then returns None
instead of the gathered epochs.

One implementation, three ways in (``swarmtrain.optim.async_state_averager``):

- trio: ``async with TrainingStateAverager.create(dht=async_dht, ...) as averager:
  await averager.step(...)``;
- plain code: this class, a facade that runs the trio averager on the DHT's background loop;
- asyncio: ``await averager.aio.step(...)`` on the blocking object.

Modules: the phases decided in ``state_step_core`` (pure); the tensors and the phases that
touch them in ``_state_phases``; the state newcomers download, its checks and its loading in
``_state_sharing``; parameter checks in ``_state_params``.

Locks: ``lock_optimizer`` guards the optimizer and the local tensors; the averager's
``lock_averaged_tensors`` its buffers. They are taken in that order, and never held while
waiting for the network. Do not call the optimizer yourself while delayed steps may run.

Resource handling: ``shutdown()`` (or leaving ``create``) cancels the delayed phases (an
optimizer step already running finishes first) and stops the averager (a running round
fails); the DHT is the caller's.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from itertools import chain
from typing import Any, Union

import torch
import trio

from swarmtrain.averaging import DecentralizedAverager, StepControl
from swarmtrain.compression import CompressionInfo, NoCompression, TensorRole
from swarmtrain.optim._optimizer_state import (
    check_optimizer_state_serializable,
    initialize_optimizer_state_,
)
from swarmtrain.optim._state_checks import LR_TOLERANCE, initial_lrs
from swarmtrain.optim._state_params import (
    LRScheduler,
    OptimizerFactory,
    Parameters,
    ParamGroups,
    SchedulerFactory,
    check_params,
    check_reusable,
    host_copy,
)
from swarmtrain.optim._state_sharing import TrainingStateSharing
from swarmtrain.optim._tensor_infos import tag_compression
from swarmtrain.optim.async_state_averager import (
    ZERO_GRAD_SET_TO_NONE_DEFAULT,
    AsyncTrainingStateAverager,
    plan_step,
    warn_unused_opts,
)
from swarmtrain.utils.background import BackgroundRuntime
from swarmtrain.utils.facade import aio_property

__all__ = [
    "ZERO_GRAD_SET_TO_NONE_DEFAULT",
    "AsyncTrainingStateAverager",
    "LRScheduler",
    "OptimizerFactory",
    "SchedulerFactory",
    "TrainingStateAverager",
]

logger = logging.getLogger(__name__)


class TrainingStateAverager(TrainingStateSharing, DecentralizedAverager):
    """Averages parameters, chosen optimizer statistics and extra tensors with peers, and serves
    the whole training state to newcomers; see the module docstring.

    :param dht: a running blocking ``DHT``
    :param optimizer: a ``torch.optim.Optimizer``, or a factory called with the param groups
    :param params: parameters or param groups (default: the optimizer's)
    :param scheduler: an LR scheduler, or a factory called with the optimizer (a factory if the
      optimizer is one); it follows ``local_epoch``, not the number of optimizer steps
    :param initialize_optimizer: create the optimizer's statistics with one step on zero
      gradients (parameters are kept as they were); default: if its state holds no tensor yet
    :param offload_optimizer: step on CPU fp32 copies of the parameters (factory only)
    :param custom_gradients: with ``offload_optimizer``, do not copy ``.grad`` into the copies
      (the caller fills ``opt_param.grad`` itself)
    :param reuse_tensors: average the local tensors in place (CPU only); default
      ``offload_optimizer and not delta_rule_averaging``
    :param delta_rule_averaging: apply an averaging round as ``local += result - before``
    :param sync_epoch_when_averaging: after a round, take the highest epoch of the group
    :param parameter_names: names of the parameters (keys for codec selectors)
    :param average_opt_statistics: names of per-parameter optimizer statistics to average
    :param extra_tensors: more tensors to average and share (not touched by the optimizer)
    :param status_loglevel: log level of progress messages
    :param averager_kwargs: ``DecentralizedAverager`` keywords (``prefix``, ``start``,
      ``AveragerConfig`` fields); codec selectors (``compression``) see the roles PARAMETER,
      OPTIMIZER and UNSPECIFIED (extras) and the keys ``name``, ``(name, statistic)``, ``i``
    """

    def __init__(
        self,
        *,
        dht,
        optimizer: Union[torch.optim.Optimizer, OptimizerFactory],
        params: Union[Parameters, ParamGroups, None] = None,
        scheduler: Union[LRScheduler, SchedulerFactory, None] = None,
        initialize_optimizer: bool | None = None,
        offload_optimizer: bool = False,
        custom_gradients: bool = False,
        reuse_tensors: bool | None = None,
        delta_rule_averaging: bool = False,
        sync_epoch_when_averaging: bool = False,
        parameter_names: Sequence[Any] | None = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        status_loglevel: int = logging.DEBUG,
        **averager_kwargs: Any,
    ):
        if isinstance(average_opt_statistics, str):
            raise TypeError("average_opt_statistics must be a sequence of names, not one string")
        average_opt_statistics = tuple(average_opt_statistics)
        if not all(isinstance(key, str) for key in average_opt_statistics):
            raise TypeError("average_opt_statistics must hold names (strings)")
        if reuse_tensors is None:
            reuse_tensors = offload_optimizer and not delta_rule_averaging
        if reuse_tensors and delta_rule_averaging:
            raise ValueError("reuse_tensors and delta_rule_averaging are mutually exclusive")
        if custom_gradients and not offload_optimizer:
            logger.warning("custom_gradients has no effect without offload_optimizer")
        optimizer_is_factory = not isinstance(optimizer, torch.optim.Optimizer)
        if optimizer_is_factory and not callable(optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a factory of one")
        scheduler_is_factory = scheduler is not None and not isinstance(scheduler, LRScheduler)
        if scheduler_is_factory and not callable(scheduler):
            raise TypeError("scheduler must be an LR scheduler, a factory of one, or None")
        if optimizer_is_factory and scheduler is not None and not scheduler_is_factory:
            raise ValueError("when the optimizer is built here, pass the scheduler as a factory")
        if offload_optimizer and not optimizer_is_factory:
            raise ValueError("offload_optimizer needs an optimizer factory (it builds the copies)")

        groups, main_parameters, names = check_params(optimizer, params, parameter_names)
        self.status_loglevel = status_loglevel
        self.offload_optimizer = bool(offload_optimizer)
        self.custom_gradients = bool(custom_gradients)
        self.reuse_tensors = bool(reuse_tensors)
        self.delta_rule_averaging = bool(delta_rule_averaging)
        self.sync_epoch_when_averaging = bool(sync_epoch_when_averaging)
        #: called with each successful round's gathered data and this peer's epoch then (in the
        #: thread that ran the round; the Optimizer tells its tracker who averaged with it)
        self.round_observer: Callable[[dict, int], None] | None = None
        self.main_parameters, self.parameter_names = main_parameters, names
        self.opt_keys_for_averaging = average_opt_statistics
        self.extra_tensors = tuple(extra_tensors)
        self.local_epoch = 0
        self.lock_optimizer = threading.Lock()
        self._old_tensors: list[torch.Tensor] | None = None  # delta rule: before averaging

        if self.offload_optimizer or not self.reuse_tensors:
            averaged_parameters = tuple(host_copy(p) for p in main_parameters)
        else:
            averaged_parameters = tuple(
                check_reusable(p, f"parameter {n!r}")
                for p, n in zip(main_parameters, names, strict=True)
            )
        self.optimizer = self._make_optimizer(optimizer, groups, averaged_parameters)
        opt_params = self._opt_params()
        if len(self.optimizer.param_groups) != len(groups) or len(opt_params) != len(names):
            raise ValueError("the optimizer's param groups differ from params")
        if initialize_optimizer is None:
            initialize_optimizer = not any(
                isinstance(v, torch.Tensor)
                for s in self.optimizer.state.values()
                for v in s.values()
            )
        if initialize_optimizer:
            logger.log(
                status_loglevel, "creating the optimizer's statistics (initialize_optimizer)"
            )
            initialize_optimizer_state_(self.optimizer)
        self.scheduler: LRScheduler | None
        if scheduler is None or isinstance(scheduler, LRScheduler):
            self.scheduler = scheduler
        else:
            self.scheduler = scheduler(self.optimizer)
        if self.scheduler is not None and self.scheduler.optimizer is not self.optimizer:
            raise ValueError("the scheduler belongs to another optimizer")
        check_optimizer_state_serializable(self.optimizer)
        #: per param group, the largest lr a donor's state may carry (see _state_checks)
        self.max_donor_lrs = tuple(LR_TOLERANCE * lr for lr in initial_lrs(self.optimizer))

        statistics = []
        for key in self.opt_keys_for_averaging:
            for param, name in zip(opt_params, names, strict=True):
                value = self.optimizer.state.get(param, {}).get(key)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"the optimizer has no statistic {key!r} for parameter {name!r} "
                        "(initialize_optimizer=True creates them)"
                    )
                statistics.append(value)
        if self.reuse_tensors:
            if self.offload_optimizer:
                averaged_parameters = tuple(p.detach() for p in opt_params)
            others = [check_reusable(t, "an optimizer statistic") for t in statistics] + [
                check_reusable(t, f"extra tensor {i}") for i, t in enumerate(self.extra_tensors)
            ]
        else:
            others = [host_copy(t) for t in chain(statistics, self.extra_tensors)]
        averaged = (*averaged_parameters, *others)

        infos = [
            CompressionInfo.from_tensor(p, key=n, role=TensorRole.PARAMETER)
            for p, n in zip(main_parameters, names, strict=True)
        ]
        keys = [(n, key) for key in self.opt_keys_for_averaging for n in names]
        infos += [
            CompressionInfo.from_tensor(t, key=k, role=TensorRole.OPTIMIZER)
            for t, k in zip(statistics, keys, strict=True)
        ]
        infos += [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(self.extra_tensors)]
        compression = averager_kwargs.pop("compression", None) or NoCompression()
        super().__init__(
            averaged, dht, compression=tag_compression(compression, infos), **averager_kwargs
        )

    # ------------------------------------------------------------------ components

    def _make_optimizer(
        self,
        optimizer: Any,
        groups: tuple[dict[str, Any], ...],
        averaged_parameters: tuple[torch.Tensor, ...],
    ) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if not self.offload_optimizer:
            built = optimizer(list(groups))
        else:
            if self.reuse_tensors:
                copies = averaged_parameters
            else:
                copies = tuple(p.clone() for p in averaged_parameters)
            offloaded_groups, start = [], 0
            for group in groups:
                count = len(group["params"])
                params = []
                for main, copy in zip(group["params"], copies[start : start + count], strict=True):
                    copy.requires_grad_(main.requires_grad)
                    copy.grad = torch.zeros_like(copy)
                    params.append(copy)
                offloaded_groups.append({**group, "params": params})
                start += count
            built = optimizer(offloaded_groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned a {type(built).__name__}")
        return built

    # ------------------------------------------------------------------ the trio form

    @classmethod
    @asynccontextmanager
    async def create(  # type: ignore[override]  # its keywords are this class's
        cls, *, dht: Any, **kwargs: Any
    ) -> AsyncIterator[AsyncTrainingStateAverager]:
        """The trio way in: start an :class:`AsyncTrainingStateAverager` on a running
        ``AsyncDHT`` (keywords: this class's, except ``start``); building the torch side (the
        optimizer's copies and statistics) runs in a worker thread."""
        if "start" in kwargs:
            raise TypeError("create() starts the averager: do not pass start")
        state = await trio.to_thread.run_sync(
            functools.partial(cls, dht=dht, start=False, **kwargs)
        )
        async with AsyncTrainingStateAverager.open(state, dht) as averager:
            yield averager

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the averager on the DHT's background loop (the constructor does this unless
        ``start=False``): an :class:`AsyncTrainingStateAverager` over this object."""
        dht_runtime, async_dht = self.dht._running()
        if BackgroundRuntime._instance is not dht_runtime:
            raise RuntimeError("the DHT runs on another background loop (made before a fork?)")
        self._start_in_background(lambda: AsyncTrainingStateAverager.open(self, async_dht))

    def _trio_form(self) -> tuple[BackgroundRuntime, AsyncTrainingStateAverager]:
        return self._running()

    #: asyncio awaitables: ``await averager.aio.step(...)``, ``.aio.load_state_from_peers()``,
    #: ``.aio.wait_for_delayed_updates()`` (never block the asyncio loop)
    aio = aio_property()
    _aio_methods = {
        "step": AsyncTrainingStateAverager.step,
        "load_state_from_peers": AsyncTrainingStateAverager.load_state_from_peers,
        "wait_for_delayed_updates": AsyncTrainingStateAverager.wait_for_delayed_updates,
    }

    # ------------------------------------------------------------------ steps (blocking)

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        """Start matchmaking for a later ``step(averaging_round=True, averaging_control=...)``.
        Keywords: ``DecentralizedAverager.step``'s except ``gather`` (our epoch is sent)."""
        if "gather" in kwargs:
            raise ValueError("a TrainingStateAverager gathers its epoch: do not pass gather")
        return super().step(
            gather=self.local_epoch,
            scheduled_time=scheduled_time,
            wait=False,
            require_trigger=True,
            **kwargs,
        )

    def step(  # type: ignore[override]
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
    ) -> Any:
        keywords = dict(locals())  # the keywords above, for the one implementation
        del keywords["self"]
        if self._runtime is None:  # not started: the torch side alone (no round, no delay)
            phases = plan_step(self._traits, **keywords)
            self._step_in_place(phases, wait_for_trigger, optimizer_step, zero_grad, set_to_none)
            return None
        runtime, averager = self._trio_form()
        phases = plan_step(self._traits, warn=False, **keywords)
        if not averager.needs_loop(phases):  # no loop hop for a plain optimizer step
            warn_unused_opts(phases, averaging_opts)
            self._step_in_place(phases, wait_for_trigger, optimizer_step, zero_grad, set_to_none)
            return None
        return runtime.call(functools.partial(averager.step, **keywords))

    step.__doc__ = AsyncTrainingStateAverager.step.__doc__

    def wait_for_delayed_updates(self, timeout: float | None = None) -> None:
        """Block until every delayed phase has finished (their errors are logged), or for at
        most ``timeout`` seconds."""
        runtime, averager = self._trio_form()
        runtime.call(_at_most, timeout, averager.wait_for_delayed_updates)

    @property
    def averaging_in_progress(self) -> bool:
        """Whether a delayed averaging round is still running (a delayed optimizer step
        alone does not count: peers would skip their state rounds at random)."""
        service = self._service
        return service is not None and service.averaging_in_progress

    # ------------------------------------------------------------------ state sharing

    def load_state_from_peers(  # type: ignore[override]
        self,
        wait: bool = True,
        timeout: float | None = None,
        swarm_epoch: int | None = None,
        min_epoch: int | None = None,
    ) -> bool:
        """Download the training state from the best donor and load it: parameters, extra
        tensors, optimizer state, scheduler state, epoch. False (with a log message) if nobody
        answered within ``timeout`` or every donor's state was rejected.

        Each donor's state is checked before any of it is used (see ``_state_checks``): the
        same tensors as ours (shape and dtype, no casts), finite values, our optimizer's
        structure and hyperparameters (``lr`` up to ``max_donor_lrs``), an epoch from ours to
        ``swarm_epoch + EPOCH_MARGIN`` (``swarm_epoch``: what the swarm's progress vouches for;
        None: unknown, capped at ``EPOCH_LIMIT``). A donor that fails is banned for a while and
        the next one is tried; a donor behind us (or behind ``min_epoch``: e.g. the state after
        this epoch's step) is skipped."""
        if not wait:
            raise ValueError("TrainingStateAverager.load_state_from_peers blocks: use wait=True")
        runtime, averager = self._trio_form()
        return runtime.call(
            functools.partial(averager.load_state_from_peers, timeout, swarm_epoch, min_epoch)
        )

    # ------------------------------------------------------------------ lifetime

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the averager: delayed phases are cancelled (an optimizer step already running
        finishes first) and a running round fails; ``timeout``: cut the close short after
        this many seconds."""
        super().shutdown(timeout)


async def _at_most(seconds: float | None, wait: Callable[[], Awaitable[None]]) -> None:
    with trio.move_on_after(math.inf if seconds is None else seconds):
        await wait()
