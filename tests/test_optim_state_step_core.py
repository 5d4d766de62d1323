"""plan_state_step: which phases one TrainingStateAverager.step call runs (pure rule)."""

from __future__ import annotations

import pytest

from swarmtrain.optim.state_step_core import (
    AveragingPlace,
    StateAveragerTraits,
    StateStepRequest,
    plan_state_step,
)

# the averagers Optimizer builds: offloaded (averages the optimizer's copies in place), plain
# (delta rule: a delayed round adds its result on top of the steps taken meanwhile)
OFFLOADED = StateAveragerTraits(
    offload_optimizer=True, delta_rule_averaging=False, reuse_tensors=True, custom_gradients=True
)
DELTA = StateAveragerTraits(
    offload_optimizer=False, delta_rule_averaging=True, reuse_tensors=False, custom_gradients=False
)
PLAIN = StateAveragerTraits(
    offload_optimizer=False, delta_rule_averaging=False, reuse_tensors=False, custom_gradients=False
)


def test_applying_delayed_updates_alone_does_nothing_else():
    phases = plan_state_step(StateStepRequest(), OFFLOADED)
    assert phases.apply_delayed_updates and not phases.wait_for_delayed_updates
    assert not phases.work and phases.averaging is AveragingPlace.NONE
    phases = plan_state_step(StateStepRequest(wait_for_delayed_updates=True), OFFLOADED)
    assert phases.wait_for_delayed_updates and not phases.work


@pytest.mark.parametrize(
    ("request_", "traits", "expected"),
    [
        # an epoch end of Optimizer without offloading: step here, then a synchronous round
        (
            StateStepRequest(averaging_round=True, delay_averaging=False),
            PLAIN,
            (True, False, False, False, AveragingPlace.HERE),
        ),
        # offload_optimizer, synchronous: step here, copy back, then the round here
        (
            StateStepRequest(
                increment_epoch=True,
                optimizer_step=True,
                averaging_round=True,
                delay_averaging=False,
            ),
            OFFLOADED,
            (True, False, True, False, AveragingPlace.HERE),
        ),
        # delay_state_averaging: the inputs are loaded here, the round runs in the worker
        (
            StateStepRequest(
                increment_epoch=True,
                optimizer_step=True,
                averaging_round=True,
                delay_averaging=True,
            ),
            OFFLOADED,
            (True, False, True, False, AveragingPlace.IN_WORKER),
        ),
        # delay_optimizer_step: step and round in the worker, in that order
        (
            StateStepRequest(
                increment_epoch=True,
                optimizer_step=True,
                delay_optimizer_step=True,
                averaging_round=True,
                has_wait_for_trigger=True,
            ),
            OFFLOADED,
            (True, True, False, False, AveragingPlace.IN_WORKER_AFTER_STEP),
        ),
        # use_local_updates with an optimizer instance: a local step, nothing to load
        (
            StateStepRequest(optimizer_step=True),
            DELTA,
            (False, False, False, False, AveragingPlace.NONE),
        ),
        # an offloaded averager without custom gradients loads the model's gradients first
        (
            StateStepRequest(optimizer_step=True),
            StateAveragerTraits(True, False, True, custom_gradients=False),
            (False, False, True, True, AveragingPlace.NONE),
        ),
    ],
)
def test_phases_per_mode(request_, traits, expected):
    prepare, in_worker, apply_parameters, load_grads, averaging = expected
    phases = plan_state_step(request_, traits)
    assert phases.work
    assert phases.prepare_round == prepare
    assert phases.optimizer_in_worker == in_worker
    assert phases.apply_parameters == apply_parameters
    assert phases.load_local_grads == load_grads
    assert phases.averaging is averaging
    assert phases.wait_for_delayed_updates == (
        request_.averaging_round or (traits.delta_rule_averaging and in_worker)
    )


def test_under_the_delta_rule_a_delayed_step_waits_for_the_round_and_a_local_one_does_not():
    traits = StateAveragerTraits(True, True, False, False)
    delayed = StateStepRequest(optimizer_step=True, delay_optimizer_step=True)
    assert plan_state_step(delayed, traits).wait_for_delayed_updates
    assert not plan_state_step(
        StateStepRequest(optimizer_step=True), traits
    ).wait_for_delayed_updates
    with pytest.raises(ValueError, match="wait for"):
        plan_state_step(
            StateStepRequest(
                optimizer_step=True, delay_optimizer_step=True, wait_for_delayed_updates=False
            ),
            traits,
        )


def test_unused_averaging_opts_are_warned_about():
    phases = plan_state_step(StateStepRequest(optimizer_step=True, has_averaging_opts=True), PLAIN)
    assert phases.warn_unused_averaging_opts
    with_round = StateStepRequest(averaging_round=True, has_averaging_opts=True)
    assert not plan_state_step(with_round, PLAIN).warn_unused_averaging_opts


@pytest.mark.parametrize(
    ("request_", "traits", "match"),
    [
        (StateStepRequest(averaging_round=True, wait_for_delayed_updates=False), PLAIN, "wait"),
        (StateStepRequest(averaging_round=True, apply_delayed_updates=False), PLAIN, "apply"),
        (
            StateStepRequest(delay_optimizer_step=True, delay_averaging=False),
            OFFLOADED,
            "delay_averaging",
        ),
        (StateStepRequest(delay_optimizer_step=True), PLAIN, "offload_optimizer"),
        (StateStepRequest(has_averaging_control=True), PLAIN, "averaging_control"),
        (StateStepRequest(has_wait_for_trigger=True), OFFLOADED, "something to trigger"),
        (
            StateStepRequest(optimizer_step=True, has_wait_for_trigger=True),
            PLAIN,
            "reuse_tensors or custom_gradients",
        ),
    ],
)
def test_flags_that_cannot_work_together_are_refused(request_, traits, match):
    with pytest.raises(ValueError, match=match):
        plan_state_step(request_, traits)
