"""Which phases one ``TrainingStateAverager.step`` call runs, and where (a pure rule, no I/O).

``TrainingStateAverager.step`` takes hivemind's keyword flags; :func:`plan_state_step` checks
their combination (``ValueError`` for one that cannot work) and returns the phases, in order:

====================== ===================================================================
phase                  when
====================== ===================================================================
wait for delayed work  ``wait_for_delayed_updates`` (default: with ``averaging_round``, or
                       under the delta rule before a delayed optimizer step: one set of
                       buffers, and a delayed step would queue behind the round)
apply delayed work     ``apply_delayed_updates`` (required when a wait is required)
increment the epoch    ``increment_epoch``
load local gradients   with ``offload_optimizer`` and no ``custom_gradients``, when an
                       optimizer step, zero_grad or averaging round follows
prepare the round      ``averaging_round`` (a scheduled control, or a new one)
optimizer phase        ``optimizer_step`` / ``zero_grad`` (after ``wait_for_trigger``): in
                       the worker thread with ``delay_optimizer_step`` (the round follows
                       it there), else here, then the parameters are copied back (offload)
averaging phase        here, or (``delay_averaging``) in the worker thread with the inputs
                       loaded here: the round averages the state as of now
====================== ===================================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "AveragingPlace",
    "StateAveragerTraits",
    "StatePhases",
    "StateStepRequest",
    "plan_state_step",
]


@dataclass(frozen=True)
class StateStepRequest:
    """The keywords of one ``step`` call (``has_*``: whether that argument was given)."""

    wait_for_delayed_updates: bool | None = None
    apply_delayed_updates: bool = True
    increment_epoch: bool = False
    optimizer_step: bool = False
    zero_grad: bool = False
    delay_optimizer_step: bool = False
    averaging_round: bool = False
    delay_averaging: bool | None = None
    has_averaging_control: bool = False
    has_wait_for_trigger: bool = False
    has_averaging_opts: bool = False


@dataclass(frozen=True)
class StateAveragerTraits:
    """How the averager was built (what its tensors are)."""

    offload_optimizer: bool
    delta_rule_averaging: bool
    reuse_tensors: bool
    custom_gradients: bool


class AveragingPlace(enum.Enum):
    NONE = "none"
    HERE = "here"
    IN_WORKER_AFTER_STEP = "in_worker_after_step"  #: with the delayed optimizer step
    IN_WORKER = "in_worker"  #: inputs loaded here, the round runs in the worker


@dataclass(frozen=True)
class StatePhases:
    """What one ``step`` call does, in order (see the module docstring)."""

    wait_for_delayed_updates: bool
    apply_delayed_updates: bool
    increment_epoch: bool
    work: bool  #: anything after the increment (an optimizer step, zero_grad or a round)
    load_local_grads: bool
    prepare_round: bool
    optimizer_in_worker: bool  #: the optimizer phase (and the round after it) in the worker
    apply_parameters: bool  #: after the optimizer phase here: copy the optimizer's parameters
    averaging: AveragingPlace
    warn_unused_averaging_opts: bool


def plan_state_step(request: StateStepRequest, traits: StateAveragerTraits) -> StatePhases:
    """The phases of one ``step`` call; ``ValueError`` for flags that cannot work together."""
    r = request
    delay_averaging = r.delay_optimizer_step if r.delay_averaging is None else r.delay_averaging
    delayed_step = r.delay_optimizer_step and (r.optimizer_step or r.zero_grad)
    should_wait = r.averaging_round or (traits.delta_rule_averaging and delayed_step)
    wait = should_wait if r.wait_for_delayed_updates is None else r.wait_for_delayed_updates
    if should_wait and not (wait and r.apply_delayed_updates):
        raise ValueError("wait for (and apply) delayed updates before scheduling a new one")
    if r.delay_optimizer_step and not delay_averaging:
        raise ValueError("a delayed optimizer step needs delay_averaging too")
    if r.delay_optimizer_step and not traits.offload_optimizer:
        raise ValueError("delay_optimizer_step needs offload_optimizer")
    if r.has_averaging_control and not r.averaging_round:
        raise ValueError("averaging_control is only used with averaging_round=True")
    if r.has_wait_for_trigger:
        if not (r.optimizer_step or r.zero_grad or r.averaging_round):
            raise ValueError("wait_for_trigger needs something to trigger")
        if not (traits.reuse_tensors or traits.custom_gradients):
            raise ValueError(
                "wait_for_trigger needs reuse_tensors or custom_gradients: otherwise it is "
                "unclear which gradients the delayed optimizer step should use"
            )
    work = r.optimizer_step or r.zero_grad or r.averaging_round
    in_worker = work and r.delay_optimizer_step
    stepped_here = work and not in_worker and (r.optimizer_step or r.zero_grad)
    if not (work and r.averaging_round):
        averaging = AveragingPlace.NONE
    elif in_worker:
        averaging = AveragingPlace.IN_WORKER_AFTER_STEP
    elif delay_averaging:
        averaging = AveragingPlace.IN_WORKER
    else:
        averaging = AveragingPlace.HERE
    return StatePhases(
        wait_for_delayed_updates=wait,
        apply_delayed_updates=r.apply_delayed_updates,
        increment_epoch=r.increment_epoch,
        work=work,
        load_local_grads=work and traits.offload_optimizer and not traits.custom_gradients,
        prepare_round=work and r.averaging_round,
        optimizer_in_worker=in_worker,
        apply_parameters=stepped_here and traits.offload_optimizer,
        averaging=averaging,
        warn_unused_averaging_opts=r.has_averaging_opts and not r.averaging_round,
    )
