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
``delay_averaging`` run those phases in a background worker thread (one per averager, made on
first use, phases run in order); their results are applied by a later ``step`` (by default the
next one with ``averaging_round=True`` waits for them). A delayed round after a step that is not
delayed averages the tensors as they were at that ``step`` call. A failed averaging round leaves
the local tensors unchanged and is logged at ``status_loglevel``; ``step`` then returns None
instead of the gathered epochs.

Locks: ``lock_optimizer`` guards the optimizer and the local tensors; the averager's
``lock_averaged_tensors`` its buffers. They are taken in that order, and never held while
waiting for the network. Do not call the optimizer yourself while delayed steps may run.

Resource handling: ``shutdown()`` stops the averager (a running round fails), then waits for the
background worker; the DHT is the caller's.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import nullcontext
from itertools import chain
from typing import Any, Union

import torch

from swarmtrain.averaging import DecentralizedAverager, StepControl
from swarmtrain.averaging.state_checks import (
    RejectReason,
    StateCheck,
    StateRejected,
    TensorSpec,
)
from swarmtrain.compression import CompressionInfo, NoCompression, TensorRole
from swarmtrain.dht import serialize
from swarmtrain.optim._optimizer_state import (
    check_optimizer_state_serializable,
    dump_optimizer_state,
    encode_tensors,
    initialize_optimizer_state_,
    load_optimizer_state,
)
from swarmtrain.optim._state_checks import (
    LR_TOLERANCE,
    check_epoch,
    check_scheduler_state,
    initial_lrs,
    optimizer_state_specs,
)
from swarmtrain.optim._tensor_infos import tag_compression
from swarmtrain.optim.state_step_core import (
    AveragingPlace,
    StateAveragerTraits,
    StatePhases,
    StateStepRequest,
    plan_state_step,
)

__all__ = ["TrainingStateAverager"]

logger = logging.getLogger(__name__)

Parameters = Iterable[torch.Tensor]
ParamGroups = Iterable[dict[str, Any]]
LRScheduler = torch.optim.lr_scheduler.LRScheduler
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
_LATE_SCHEDULER_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


def _check_params(
    optimizer: Any, params: Any, parameter_names: Sequence[Any] | None
) -> tuple[tuple[dict[str, Any], ...], tuple[torch.Tensor, ...], tuple[Any, ...]]:
    """(param groups, flat parameters, names) from ``params`` or the optimizer's groups."""
    if params is None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("pass params=... when optimizer is a factory")
        params = optimizer.param_groups
    groups = tuple(params)
    if groups and all(isinstance(p, torch.Tensor) for p in groups):
        groups = ({"params": list(groups)},)
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("params must be tensors or param groups (dicts with 'params')")
    groups = tuple(  # copies: the caller's dicts stay as they were
        {
            **g,
            "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]),
        }
        for g in groups
    )
    for group in groups:
        if not all(isinstance(p, torch.Tensor) for p in group["params"]):
            raise TypeError("every entry of a param group's 'params' must be a tensor")
    parameters = tuple(chain.from_iterable(group["params"] for group in groups))
    if not parameters:
        raise ValueError("TrainingStateAverager needs at least one parameter")
    if len({id(p) for p in parameters}) != len(parameters):
        raise ValueError("params contain duplicate parameters")
    for i, param in enumerate(parameters):
        if not param.dtype.is_floating_point:
            raise TypeError(f"parameter {i} has dtype {param.dtype}: it cannot be averaged")
    names = tuple(range(len(parameters))) if parameter_names is None else tuple(parameter_names)
    if len(names) != len(parameters):
        raise ValueError(f"got {len(names)} parameter names for {len(parameters)} parameters")
    return groups, parameters, names


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU fp32 copy (fp64 stays fp64) for averaging."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.detach().to(device="cpu", dtype=dtype, copy=True)


def _check_reusable(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ValueError(f"reuse_tensors needs CPU tensors, but {what} is on {tensor.device}")
    return tensor.detach()


#: most characters of a donor's group bits
MAX_GROUP_BITS = 1024


def _check_training_state(
    metadata: Any,
    *,
    local: list[TensorSpec],
    optimizer_metadata: Any,
    optimizer_specs: list[TensorSpec],
    scheduler_state: Any,
    local_epoch: int,
    swarm_epoch: int | None,
    max_lrs: Sequence[float],
) -> list[TensorSpec]:
    """The specs of a donor's state tensors, after checking its metadata (a ``StateCheck``)."""
    if not isinstance(metadata, dict):
        raise StateRejected(RejectReason.METADATA, "the metadata is not a dict")
    epoch = check_epoch(metadata.get("epoch"), local_epoch, swarm_epoch)
    bits = metadata.get("group_bits")
    if not isinstance(bits, str) or len(bits) > MAX_GROUP_BITS:
        raise StateRejected(RejectReason.METADATA, "group_bits is not a short string")
    specs = optimizer_state_specs(
        optimizer_metadata, optimizer_specs, metadata.get("optimizer_metadata"), max_lrs
    )
    check_scheduler_state(
        scheduler_state, metadata.get("scheduler_state"), epoch, max(max_lrs, default=0.0)
    )
    return [*local, *specs]


#: hivemind's name: ``zero_grad`` sets gradients to None by default (torch >= 2.0's default)
ZERO_GRAD_SET_TO_NONE_DEFAULT = True


class TrainingStateAverager(DecentralizedAverager):
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

        groups, main_parameters, names = _check_params(optimizer, params, parameter_names)
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
        self._executor: ThreadPoolExecutor | None = None
        self._pending: set[Future] = set()
        self._pending_rounds: set[Future] = set()  # the pending phases with an averaging round
        self._finished_optimizer_step = threading.Event()  # by a delayed phase, not applied yet
        self._finished_averaging_round = threading.Event()

        if self.offload_optimizer or not self.reuse_tensors:
            averaged_parameters = tuple(_host_copy(p) for p in main_parameters)
        else:
            averaged_parameters = tuple(
                _check_reusable(p, f"parameter {n!r}")
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
            others = [_check_reusable(t, "an optimizer statistic") for t in statistics] + [
                _check_reusable(t, f"extra tensor {i}") for i, t in enumerate(self.extra_tensors)
            ]
        else:
            others = [_host_copy(t) for t in chain(statistics, self.extra_tensors)]
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

    def _opt_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _local_tensors(self) -> Iterator[torch.Tensor]:
        """The trainer's tensors, in the order of the averaged ones."""
        opt_params = self._opt_params()
        yield from opt_params
        for key in self.opt_keys_for_averaging:
            for param in opt_params:
                yield self.optimizer.state[param][key]
        yield from self.extra_tensors

    def _update_scheduler(self) -> None:
        """Step the scheduler until it reaches ``local_epoch`` (fast-forwarding is intended)."""
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LATE_SCHEDULER_WARNING)
            while self.scheduler._step_count <= self.local_epoch:
                self.scheduler.step()

    # ------------------------------------------------------------ copies (lock_optimizer held)

    @torch.no_grad()
    def _load_local_grads_into_optimizer_(self) -> None:
        for main, copy in zip(self.main_parameters, self._opt_params(), strict=True):
            if main.grad is None:
                continue
            if copy.grad is None:
                copy.grad = torch.empty_like(copy)
            copy.grad.copy_(main.grad)

    @torch.no_grad()
    def _apply_optimizer_parameters_(self) -> None:
        for main, copy in zip(self.main_parameters, self._opt_params(), strict=True):
            main.copy_(copy)

    @torch.no_grad()
    def _copy_local_into_averaged(self, averaged: Sequence[torch.Tensor]) -> None:
        local = list(self._local_tensors())
        for local_tensor, averaged_tensor in zip(local, averaged, strict=True):
            averaged_tensor.copy_(local_tensor)
        if self.delta_rule_averaging:
            self._old_tensors = [t.clone() for t in averaged]

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        with self.get_tensors() as averaged:
            local = list(self._local_tensors())
            if not self.delta_rule_averaging or self._old_tensors is None:
                for local_tensor, averaged_tensor in zip(local, averaged, strict=True):
                    local_tensor.copy_(averaged_tensor)
            else:
                for local_tensor, new, old in zip(local, averaged, self._old_tensors, strict=True):
                    local_tensor.add_(new.sub(old).to(local_tensor.device, local_tensor.dtype))
            self._old_tensors = None

    # ------------------------------------------------------------------ steps

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
        """Do some of the following, in this order (hivemind's semantics; which ones and where:
        ``swarmtrain.optim.state_step_core``).

        :param wait_for_delayed_updates: wait for delayed phases still running (default: when
          ``averaging_round``, or with ``delta_rule_averaging`` before a delayed optimizer step;
          an optimizer step in the caller's thread does not wait for a delayed round then)
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
        :param wait_for_trigger: called (and awaited) before the optimizer step; if it raises,
          the step is aborted (needs ``reuse_tensors`` or ``custom_gradients``)
        :param averaging_opts: keywords for a new round (``timeout``, ``scheduled_time``,
          ``weight``, ``allow_retries``)
        :returns: the round's ``{peer_id: epoch}`` if it ran here and succeeded, else None
        """
        phases = plan_state_step(
            StateStepRequest(
                wait_for_delayed_updates=wait_for_delayed_updates,
                apply_delayed_updates=apply_delayed_updates,
                increment_epoch=increment_epoch,
                optimizer_step=optimizer_step,
                zero_grad=zero_grad,
                delay_optimizer_step=delay_optimizer_step,
                averaging_round=averaging_round,
                delay_averaging=delay_averaging,
                has_averaging_control=averaging_control is not None,
                has_wait_for_trigger=wait_for_trigger is not None,
                has_averaging_opts=bool(averaging_opts),
            ),
            self._traits,
        )
        if phases.warn_unused_averaging_opts:
            logger.warning("averaging_opts %s are unused: averaging_round=False", averaging_opts)
        if phases.wait_for_delayed_updates:
            self.wait_for_delayed_updates()
        self._forget_finished_updates()
        if phases.apply_delayed_updates:
            self._apply_delayed_updates()
        if phases.increment_epoch:
            self.local_epoch += 1
        if not phases.work:
            return None
        if phases.load_local_grads:
            with self.lock_optimizer:
                self._load_local_grads_into_optimizer_()
        control = None
        if phases.prepare_round:
            control = self._prepare_round(averaging_control, dict(averaging_opts or {}))
        if phases.optimizer_in_worker:  # the round, if any, follows the step there
            self._submit(
                wait_for_trigger, optimizer_step, zero_grad, control, set_to_none=set_to_none
            )
            return None
        return self._run_phases_here(
            phases, control, wait_for_trigger, optimizer_step, zero_grad, set_to_none
        )

    def _run_phases_here(
        self,
        phases: StatePhases,
        control: StepControl | None,
        wait_for_trigger: Callable[[], Any] | None,
        optimizer_step: bool,
        zero_grad: bool,
        set_to_none: bool,
    ) -> dict | None:
        """The optimizer phase in this thread, then the round here or in the worker."""
        try:
            self._optimizer_phase(wait_for_trigger, optimizer_step, zero_grad, set_to_none)
        except BaseException:
            if control is not None:
                control.cancel()
            raise
        if phases.apply_parameters:
            with self.lock_optimizer:
                self._apply_optimizer_parameters_()
        if control is None:
            return None
        if phases.averaging is AveragingPlace.IN_WORKER:  # it averages the state as of now
            self._load_round_inputs(control)
            self._submit(None, False, False, control, inputs_loaded=True)
            return None
        gathered = self._averaging_phase(control)
        if gathered is not None:
            self._apply_round()
        return gathered

    @property
    def _traits(self) -> StateAveragerTraits:
        return StateAveragerTraits(
            offload_optimizer=self.offload_optimizer,
            delta_rule_averaging=self.delta_rule_averaging,
            reuse_tensors=self.reuse_tensors,
            custom_gradients=self.custom_gradients,
        )

    def _prepare_round(self, control: StepControl | None, opts: dict[str, Any]) -> StepControl:
        if control is not None and (control.triggered or control.done()):
            logger.log(self.status_loglevel, "discarding a used or failed control: %s", control)
            control = None
        if control is None:
            return self.schedule_step(**opts)
        if opts:
            logger.warning("averaging_opts %s are unused: the round was scheduled before", opts)
        return control

    def _optimizer_phase(
        self,
        wait_for_trigger: Callable[[], Any] | None,
        optimizer_step: bool,
        zero_grad: bool,
        set_to_none: bool = True,
    ) -> None:
        if wait_for_trigger is not None:
            wait_for_trigger()
        with self.lock_optimizer:
            if optimizer_step:
                with self.lock_averaged_tensors if self.reuse_tensors else nullcontext():
                    self.optimizer.step()
            if zero_grad:
                self.optimizer.zero_grad(set_to_none=set_to_none)
                if self.offload_optimizer:
                    for param in self.main_parameters:
                        if set_to_none:
                            param.grad = None
                        elif param.grad is not None:
                            param.grad.zero_()
            self._update_scheduler()

    def _load_round_inputs(self, control: StepControl) -> None:
        """Copy the local tensors into the averaged ones (unless those are the local ones)."""
        if self.reuse_tensors:
            return
        try:
            with self.lock_optimizer, self.get_tensors() as averaged:
                self._copy_local_into_averaged(averaged)
        except BaseException:
            control.cancel()
            raise

    def _averaging_phase(self, control: StepControl, inputs_loaded: bool = False) -> dict | None:
        """Load the local tensors (unless ``inputs_loaded``), let all-reduce run, wait: the
        gathered epochs, or None. No extra timeout: the round ends by itself (its matchmaking
        deadline, then the all-reduce timeouts)."""
        try:
            if not inputs_loaded:
                self._load_round_inputs(control)
            control.allow_allreduce()
            gathered = control.result()
        except Exception as e:
            control.cancel()
            logger.log(self.status_loglevel, "state averaging failed: %r", e)
            return None
        except BaseException:
            control.cancel()
            raise
        logger.log(self.status_loglevel, "averaged the training state with %d peers", len(gathered))
        if self.round_observer is not None:
            self.round_observer(gathered, self.local_epoch)
        if self.sync_epoch_when_averaging:
            epochs = [
                e for e in gathered.values() if isinstance(e, int) and not isinstance(e, bool)
            ]
            if epochs and max(epochs) > self.local_epoch:
                logger.log(self.status_loglevel, "a peer has a newer epoch (%d)", max(epochs))
                with self.lock_optimizer:
                    self.local_epoch = max(epochs)
                    self._update_scheduler()
        return gathered

    def _apply_round(self) -> None:
        with self.lock_optimizer:
            if not self.reuse_tensors:
                self._apply_averaging_results_()
            if self.offload_optimizer:
                self._apply_optimizer_parameters_()

    # ------------------------------------------------------------------ delayed phases

    def _submit(
        self,
        wait_for_trigger: Callable[[], Any] | None,
        optimizer_step: bool,
        zero_grad: bool,
        control: StepControl | None,
        inputs_loaded: bool = False,
        set_to_none: bool = True,
    ) -> None:
        """Run :meth:`_background_phases` in the worker thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="swarmtrain-state-averager")
        future = self._executor.submit(
            self._background_phases,
            wait_for_trigger,
            optimizer_step,
            zero_grad,
            control,
            inputs_loaded,
            set_to_none,
        )
        self._pending.add(future)
        if control is not None:
            self._pending_rounds.add(future)

    def _background_phases(
        self,
        wait_for_trigger: Callable[[], Any] | None,
        optimizer_step: bool,
        zero_grad: bool,
        control: StepControl | None,
        inputs_loaded: bool = False,
        set_to_none: bool = True,
    ) -> dict | None:
        """A delayed optimizer step and/or averaging round (in the worker thread)."""
        if optimizer_step or zero_grad or wait_for_trigger is not None:
            try:
                self._optimizer_phase(wait_for_trigger, optimizer_step, zero_grad, set_to_none)
            except Exception:
                logger.exception("a delayed optimizer step failed; its averaging round is dropped")
                if control is not None:
                    control.cancel()
                return None
            self._finished_optimizer_step.set()
        if control is None:
            return None
        gathered = self._averaging_phase(control, inputs_loaded)
        if gathered is not None:
            self._finished_averaging_round.set()
        return gathered

    def wait_for_delayed_updates(self, timeout: float | None = None) -> None:
        """Block until every delayed phase has finished (their errors are logged)."""
        for future in list(self._pending):
            try:
                future.result(timeout)
            except Exception as e:
                logger.log(self.status_loglevel, "a delayed update failed: %r", e)

    def _forget_finished_updates(self) -> None:
        self._pending = {future for future in self._pending if not future.done()}

    def _apply_delayed_updates(self) -> None:
        if self._finished_averaging_round.is_set():
            self._finished_averaging_round.clear()
            self._finished_optimizer_step.clear()  # _apply_round copies the parameters too
            self._apply_round()
            logger.log(self.status_loglevel, "applied a delayed averaging round")
        if self._finished_optimizer_step.is_set():
            self._finished_optimizer_step.clear()
            if self.offload_optimizer:
                with self.lock_optimizer:
                    self._apply_optimizer_parameters_()

    @property
    def averaging_in_progress(self) -> bool:
        """Whether a delayed averaging round is still running (a delayed optimizer step
        alone does not count: peers would skip their state rounds at random)."""
        self._pending_rounds = {future for future in self._pending_rounds if not future.done()}
        return bool(self._pending_rounds)

    # ------------------------------------------------------------------ state sharing

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], list]:
        """``(metadata, tensors, infos)`` for newcomers: metadata holds ``epoch``,
        ``group_bits``, ``optimizer_metadata`` and ``scheduler_state``; the tensors are the
        parameters, the extra tensors, then every tensor of the optimizer's state dict."""
        with torch.no_grad(), self.lock_optimizer, self.lock_averaged_tensors:
            params = [p.detach().to("cpu", copy=True) for p in self._opt_params()]
            extras = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
            optimizer_metadata, optimizer_tensors = dump_optimizer_state(self.optimizer)
            scheduler_state = self._scheduler_state()
            epoch = self.local_epoch
        infos = [
            CompressionInfo.from_tensor(p, key=n, role=TensorRole.PARAMETER)
            for p, n in zip(params, self.parameter_names, strict=True)
        ]
        infos += [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(extras)]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
            for i, t in enumerate(optimizer_tensors)
        ]
        service = self._service
        metadata = {
            "epoch": epoch,
            "group_bits": service.get_group_bits() if service is not None else "",
            "optimizer_metadata": optimizer_metadata,
            "scheduler_state": scheduler_state,
        }
        return metadata, [*params, *extras, *optimizer_tensors], infos

    def _scheduler_state(self) -> dict | None:
        if self.scheduler is None:
            return None
        state = self.scheduler.state_dict()
        try:
            serialize(state, max_size=None)
        except ValueError:
            return None  # e.g. callables inside: the newcomer fast-forwards its own instead
        return state

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
        check = self._state_check(swarm_epoch, min_epoch)
        loaded = super().load_state_from_peers(wait=True, timeout=timeout, check=check)
        if loaded is None:
            return False
        return self._load_downloaded_state(loaded, min_epoch)

    def _load_downloaded_state(
        self, loaded: tuple[Any, list[torch.Tensor]], min_epoch: int | None = None
    ) -> bool:
        """Load a donor's ``(metadata, tensors)`` that passed :meth:`_state_check` (takes the
        locks: call it off the trio loop); False if it no longer fits."""
        metadata, tensors = loaded
        epoch, least = metadata["epoch"], max(self.local_epoch, min_epoch or 0)
        if epoch < least:  # we moved on during the download
            logger.warning("not loading the state of a donor behind us (%d < %d)", epoch, least)
            return False
        local = [*self._opt_params(), *self.extra_tensors]
        with torch.no_grad(), self.lock_optimizer, self.lock_averaged_tensors:
            statistics = self._averaged_statistics()
            try:
                load_optimizer_state(
                    self.optimizer, metadata.get("optimizer_metadata"), tensors[len(local) :]
                )
            except (ValueError, KeyError, TypeError, IndexError) as e:
                logger.error("the donor's optimizer state does not fit ours: %s", e)
                return False
            self._restore_statistics(statistics)
            for local_tensor, loaded_tensor in zip(local, tensors, strict=False):
                local_tensor.copy_(loaded_tensor)
            if self.offload_optimizer:
                self._apply_optimizer_parameters_()
            if not self.reuse_tensors:
                self._copy_local_into_averaged(self._averaged_tensors)
            self.local_epoch = epoch
            self._load_scheduler_state(metadata.get("scheduler_state"))
            self._update_scheduler()
        logger.log(self.status_loglevel, "loaded the training state of epoch %d", epoch)
        return True

    def _state_check(self, swarm_epoch: int | None, min_epoch: int | None = None) -> StateCheck:
        """A snapshot of what a donor's state must look like (ours, now), as a check."""
        with self.lock_optimizer:
            local = [TensorSpec.of(t) for t in (*self._opt_params(), *self.extra_tensors)]
            tensors: list[torch.Tensor] = []
            optimizer_metadata = encode_tensors(self.optimizer.state_dict(), tensors, copy=False)
            return functools.partial(
                _check_training_state,
                local=local,
                optimizer_metadata=optimizer_metadata,
                optimizer_specs=[TensorSpec.of(t) for t in tensors],
                scheduler_state=self._scheduler_state(),
                local_epoch=max(self.local_epoch, min_epoch or 0),
                swarm_epoch=swarm_epoch,
                max_lrs=self.max_donor_lrs,
            )

    def _averaged_statistics(self) -> dict[tuple[int, str], torch.Tensor]:
        """The statistic tensors averaged in place (``reuse_tensors``), to keep across a load."""
        if not self.reuse_tensors:
            return {}
        return {
            (i, key): self.optimizer.state[param][key]
            for key in self.opt_keys_for_averaging
            for i, param in enumerate(self._opt_params())
        }

    def _restore_statistics(self, statistics: dict[tuple[int, str], torch.Tensor]) -> None:
        """``load_state_dict`` made new tensors: copy them into the averaged ones, put those in."""
        params = self._opt_params()
        for (i, key), tensor in statistics.items():
            state = self.optimizer.state[params[i]]
            tensor.copy_(state[key])
            state[key] = tensor

    def _load_scheduler_state(self, state: Any) -> None:
        if self.scheduler is None or not isinstance(state, dict):
            return
        try:
            self.scheduler.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("the donor's scheduler state does not fit ours: %s", e)

    # ------------------------------------------------------------------ lifetime

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the averager (a running round fails), then wait for the background worker
        (each for at most ``timeout`` seconds: then it returns, leaving the worker to end)."""
        try:
            super().shutdown(timeout)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=timeout is None, cancel_futures=True)
                if timeout is not None:
                    futures_wait(list(self._pending), timeout)
