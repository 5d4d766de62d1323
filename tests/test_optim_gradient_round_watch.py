"""When a gradient round still looking for a group is given up because the swarm left its epoch
(``AsyncGradientRounds.finish``), on a jumping clock.

With delayed updates every peer enters the next epoch before it waits for the round that ended
the last one, so the swarm being one epoch past the round is the normal case there, not a sign
that this peer was left behind (a CI run gave up every round of two delayed-update peers).
"""

from __future__ import annotations

import logging
import math

import pytest
import trio

from swarmtrain.averaging.control import AveragingStage, StepControl
from swarmtrain.optim._async_gradient_rounds import AsyncGradientRounds

pytestmark = pytest.mark.trio

MATCHMAKING_TIME = 2.0


def _rounds(swarm_epoch: list[int]) -> AsyncGradientRounds:
    return AsyncGradientRounds(
        None,  # type: ignore[arg-type]  # finish() only waits on the control it is given
        None,  # type: ignore[arg-type]
        run_id="watch",
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=60.0,
        status_loglevel=logging.DEBUG,
        swarm_epoch=lambda: swarm_epoch[0],
    )


def _looking_for_group() -> StepControl:
    control = StepControl(
        scheduled_time=0.0,
        deadline=math.inf,
        allow_retries=True,
        weight=1.0,
        gather=b"",
        require_trigger=True,
    )
    control._set_stage(AveragingStage.LOOKING_FOR_GROUP)
    return control


async def _finish_after(control: StepControl, seconds: float) -> None:
    await trio.sleep(seconds)
    control._set_stage(AveragingStage.RUNNING_ALLREDUCE)
    control._finish({"a": 5, "b": 5})


async def test_a_delayed_round_is_not_given_up_while_the_swarm_is_one_epoch_past(autojump_clock):
    swarm_epoch = [6]  # both peers entered epoch 6 before waiting for epoch 5's round
    rounds, control = _rounds(swarm_epoch), _looking_for_group()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_finish_after, control, 5 * MATCHMAKING_TIME)
        gathered = await rounds.finish(control, True, 5, peers_moved_on=True)
    assert gathered == {"a": 5, "b": 5} and rounds.averaged == 1 and rounds.alone == 0


async def test_a_delayed_round_is_given_up_once_the_swarm_is_two_epochs_past(autojump_clock):
    swarm_epoch = [6]
    rounds, control = _rounds(swarm_epoch), _looking_for_group()

    async def swarm_moves_on() -> None:
        await trio.sleep(1.0)
        swarm_epoch[0] = 7  # the others finished this round and the next epoch without us

    async with trio.open_nursery() as nursery:
        nursery.start_soon(swarm_moves_on)
        started = trio.current_time()
        assert await rounds.finish(control, True, 5, peers_moved_on=True) is None
        waited = trio.current_time() - started
    assert rounds.alone == 1 and control.cancelled()
    assert 1.0 + MATCHMAKING_TIME <= waited <= 1.0 + MATCHMAKING_TIME + 0.2


async def test_a_round_waited_in_its_epoch_is_given_up_when_the_swarm_moves_on(autojump_clock):
    swarm_epoch = [5]
    rounds, control = _rounds(swarm_epoch), _looking_for_group()

    async def swarm_moves_on() -> None:
        await trio.sleep(1.0)
        swarm_epoch[0] = 6

    async with trio.open_nursery() as nursery:
        nursery.start_soon(swarm_moves_on)
        started = trio.current_time()
        assert await rounds.finish(control, True, 5) is None
        waited = trio.current_time() - started
    assert rounds.alone == 1
    assert 1.0 + MATCHMAKING_TIME <= waited <= 1.0 + MATCHMAKING_TIME + 0.2


async def test_a_round_begun_after_the_swarm_left_gives_up_within_the_short_grace(
    autojump_clock,
):
    swarm_epoch = [7]
    rounds, control = _rounds(swarm_epoch), _looking_for_group()
    started = trio.current_time()
    assert await rounds.finish(control, True, 5, peers_moved_on=True) is None
    assert trio.current_time() - started < 1.0


async def test_a_round_with_a_group_is_never_given_up_for_the_swarm_epoch(autojump_clock):
    swarm_epoch = [9]
    rounds, control = _rounds(swarm_epoch), _looking_for_group()
    control._set_stage(AveragingStage.AWAITING_TRIGGER)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_finish_after, control, 5 * MATCHMAKING_TIME)
        assert await rounds.finish(control, True, 5) == {"a": 5, "b": 5}


@pytest.mark.parametrize(
    ("other_epochs", "waits"),
    [([6, 6], 0.0), ([6, 5], MATCHMAKING_TIME)],
    ids=["every-other-peer-left", "another-peer-still-in-the-epoch"],
)
async def test_a_round_nobody_else_is_in_is_given_up_at_once(autojump_clock, other_epochs, waits):
    """The one-epoch-behind cascade's fix (``test_optim_epoch_cascade.py``) in the shell: once
    every other peer present published a later epoch, nobody is left to meet in this round."""
    swarm_epoch, epochs = [5], [5, 5]
    rounds = AsyncGradientRounds(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        run_id="watch",
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=60.0,
        status_loglevel=logging.DEBUG,
        swarm_epoch=lambda: swarm_epoch[0],
        peer_epochs=lambda: list(epochs),
    )
    control = _looking_for_group()

    async def swarm_moves_on() -> None:
        await trio.sleep(1.0)
        swarm_epoch[0] = 6
        epochs[:] = other_epochs

    async with trio.open_nursery() as nursery:
        nursery.start_soon(swarm_moves_on)
        started = trio.current_time()
        assert await rounds.finish(control, True, 5) is None
        waited = trio.current_time() - started
    assert rounds.alone == 1 and control.cancelled()
    assert 1.0 + waits <= waited <= 1.0 + waits + 0.2
