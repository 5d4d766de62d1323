"""The trio ``TrainingStateAverager`` (``async with TrainingStateAverager.create(...)``): real
peers on loopback, each a trio task of one test run; and ``.aio`` on the blocking one.

No background loop thread is involved in the trio form, delayed phases are tasks of the
averager's nursery, and what they compute reaches the model only at a later ``step``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import trio
import trio.testing
from swarm_util import FAST, group_of, open_dhts
from test_optim_averagers import adam_factory, backward, make_model, state_of

from swarmtrain.dht import DHT
from swarmtrain.optim import TrainingStateAverager
from swarmtrain.optim.async_state_averager import AsyncTrainingStateAverager
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
LR = 0.1


def sgd_factory(params):
    return torch.optim.SGD(params, lr=LR)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


async def step_all(averagers: list[AsyncTrainingStateAverager], **kwargs) -> list:
    """``await averager.step(**kwargs)`` of every averager at once; their results."""
    results: list = [None] * len(averagers)

    async def one(i: int) -> None:
        results[i] = await averagers[i].step(**kwargs)

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.trio
async def test_two_trio_peers_average_parameters_statistics_and_epochs():
    models = [make_model(140 + i) for i in range(2)]
    with trio.fail_after(60):
        async with open_dhts(2) as dhts:
            async with (
                TrainingStateAverager.create(
                    dht=dhts[0],
                    optimizer=adam_factory,
                    params=models[0].parameters(),
                    prefix="trio_state",
                    average_opt_statistics=("exp_avg", "exp_avg_sq"),
                    sync_epoch_when_averaging=True,
                    **group_of(2),
                ) as first,
                TrainingStateAverager.create(
                    dht=dhts[1],
                    optimizer=adam_factory,
                    params=models[1].parameters(),
                    prefix="trio_state",
                    average_opt_statistics=("exp_avg", "exp_avg_sq"),
                    sync_epoch_when_averaging=True,
                    **group_of(2),
                ) as second,
            ):
                averagers = [first, second]
                assert isinstance(first, AsyncTrainingStateAverager)
                for i, (averager, model) in enumerate(zip(averagers, models, strict=True)):
                    backward(model, 4, seed=i)
                    assert await averager.step(optimizer_step=True, zero_grad=True) is None
                    assert all(p.grad is None for p in model.parameters())  # set_to_none
                first.local_epoch, second.local_epoch = 3, 1
                before = [state_of(a.state) for a in averagers]
                assert not torch.equal(before[0]["exp_avg"][0], before[1]["exp_avg"][0])
                results = await step_all(
                    averagers, averaging_round=True, averaging_opts={"timeout": 15}
                )
                assert results[0] == {first.peer_id: 3, second.peer_id: 1} == results[1]
                for averager, model in zip(averagers, models, strict=True):
                    assert averager.local_epoch == 3  # sync_epoch_when_averaging
                    after = state_of(averager.state)
                    for key in ("params", "exp_avg", "exp_avg_sq"):
                        for got, x, y in zip(
                            after[key], before[0][key], before[1][key], strict=True
                        ):
                            torch.testing.assert_close(got, (x + y) / 2)
                    for param, expected in zip(model.parameters(), after["params"], strict=True):
                        assert torch.equal(param, expected)
    assert BackgroundRuntime.active_references() == 0  # no background loop was involved


@pytest.mark.trio
async def test_trio_delayed_step_and_round_reach_the_model_at_the_next_step():
    """``delay_optimizer_step`` + a delayed round: ``step`` returns at once, nothing touches the
    model until a later ``step`` applies the finished round: the mean of both peers' steps."""
    models = [make_model(150 + i) for i in range(2)]
    with trio.fail_after(60):
        async with open_dhts(2) as dhts:
            opts = {
                "optimizer": sgd_factory,
                "offload_optimizer": True,
                "prefix": "trio_delayed",
                **group_of(2),
            }
            async with (
                TrainingStateAverager.create(
                    dht=dhts[0], params=models[0].parameters(), **opts
                ) as first,
                TrainingStateAverager.create(
                    dht=dhts[1], params=models[1].parameters(), **opts
                ) as second,
            ):
                averagers = [first, second]
                stepped = []
                for i, model in enumerate(models):
                    grads = backward(model, 4, seed=10 + i)
                    stepped.append(
                        [p - LR * g for p, g in zip(params_of(model), grads, strict=True)]
                    )
                expected = [(a + b) / 2 for a, b in zip(*stepped, strict=True)]
                before = [params_of(m) for m in models]
                for averager in averagers:
                    result = await averager.step(
                        optimizer_step=True,
                        delay_optimizer_step=True,
                        averaging_round=True,
                        averaging_opts={"timeout": 15},
                    )
                    assert result is None  # delayed: nothing gathered here
                    assert averager.averaging_in_progress
                for averager in averagers:
                    await averager.wait_for_delayed_updates()
                    assert not averager.averaging_in_progress
                for model, params in zip(models, before, strict=True):  # not applied yet
                    assert all(
                        torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)
                    )
                for averager in averagers:
                    assert await averager.step() is None  # applies the finished round
                for model in models:
                    for got, want in zip(model.parameters(), expected, strict=True):
                        torch.testing.assert_close(got.detach(), want)


@pytest.mark.trio
async def test_trio_delayed_step_waits_for_an_async_trigger_and_a_newcomer_loads_it():
    donor_model, newcomer_model = make_model(160), make_model(161)
    with trio.fail_after(60):
        async with open_dhts(2) as dhts:
            async with (
                TrainingStateAverager.create(
                    dht=dhts[0],
                    optimizer=sgd_factory,
                    params=donor_model.parameters(),
                    offload_optimizer=True,
                    prefix="trio_trigger",
                    **FAST,
                ) as donor,
                TrainingStateAverager.create(
                    dht=dhts[1],
                    optimizer=sgd_factory,
                    params=newcomer_model.parameters(),
                    offload_optimizer=True,
                    prefix="trio_trigger",
                    **FAST,
                ) as newcomer,
            ):
                grads = backward(donor_model, 4, seed=3)
                stepped = [p - LR * g for p, g in zip(params_of(donor_model), grads, strict=True)]
                copies_before = [p.detach().clone() for p in donor.state._opt_params()]
                trigger = trio.Event()
                await donor.step(
                    increment_epoch=True,
                    optimizer_step=True,
                    delay_optimizer_step=True,
                    delay_averaging=True,
                    wait_for_trigger=trigger.wait,
                )
                await trio.testing.wait_all_tasks_blocked()
                # the job waits for the trigger: the optimizer's copies are untouched
                for copy, before in zip(donor.state._opt_params(), copies_before, strict=True):
                    assert torch.equal(copy, before)
                trigger.set()
                await donor.wait_for_delayed_updates()
                await donor.step()  # applies the step: the model gets the new values
                for got, want in zip(donor_model.parameters(), stepped, strict=True):
                    torch.testing.assert_close(got.detach(), want)
                assert donor.local_epoch == 1

                assert await newcomer.load_state_from_peers(timeout=10)
                assert newcomer.local_epoch == 1
                for got, want in zip(newcomer_model.parameters(), stepped, strict=True):
                    torch.testing.assert_close(got.detach(), want)


@pytest.mark.trio
async def test_trio_step_errors_and_leaving_with_a_pending_round():
    """Bad flag combinations raise before anything runs; a trigger that fails aborts the step
    (the optimizer is not stepped); leaving ``create`` with a delayed round still looking for
    a group cancels it at once instead of waiting for its 30 s timeout."""
    model = make_model(170)
    with trio.fail_after(30):
        async with open_dhts(1) as dhts:
            async with TrainingStateAverager.create(
                dht=dhts[0],
                optimizer=sgd_factory,
                params=model.parameters(),
                offload_optimizer=True,
                prefix="trio_errors",
                **FAST,
            ) as averager:
                with pytest.raises(TypeError, match="start"):
                    async with TrainingStateAverager.create(
                        dht=dhts[0], optimizer=sgd_factory, params=model.parameters(), start=True
                    ):
                        pass  # pragma: no cover
                with pytest.raises(ValueError, match="delay_averaging"):
                    await averager.step(optimizer_step=True, delay_optimizer_step=True,
                                        delay_averaging=False)  # fmt: skip
                backward(model, 4, seed=5)
                before = params_of(model)

                async def failing_trigger() -> None:
                    raise RuntimeError("no trigger today")

                with pytest.raises(RuntimeError, match="no trigger today"):
                    await averager.step(optimizer_step=True, wait_for_trigger=failing_trigger)
                await averager.step()
                assert all(
                    torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)
                )

                assert (
                    await averager.step(
                        averaging_round=True, delay_averaging=True, averaging_opts={"timeout": 30}
                    )
                    is None
                )
                assert averager.averaging_in_progress
                left = trio.current_time()
        assert trio.current_time() - left < 10  # not the round's 30 s


def test_blocking_state_averager_has_asyncio_awaitables():
    model = make_model(180)
    dht = DHT(**HOST)
    try:
        averager = TrainingStateAverager(
            dht=dht,
            optimizer=sgd_factory,
            params=model.parameters(),
            offload_optimizer=True,
            prefix="aio_state",
            **FAST,
        )
        try:
            grads = backward(model, 4, seed=7)
            stepped = [p - LR * g for p, g in zip(params_of(model), grads, strict=True)]

            async def main() -> None:
                assert (
                    await averager.aio.step(
                        optimizer_step=True, delay_optimizer_step=True, delay_averaging=True
                    )
                    is None
                )
                await averager.aio.wait_for_delayed_updates()
                await averager.aio.step()

            asyncio.run(main())
            for got, want in zip(model.parameters(), stepped, strict=True):
                torch.testing.assert_close(got.detach(), want)
            assert sorted(n for n in dir(averager.aio) if not n.startswith("_")) == [
                "load_state_from_peers",
                "step",
                "wait_for_delayed_updates",
            ]
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()


def test_a_torch_side_that_was_not_started_steps_in_place_but_cannot_average():
    model = make_model(190)
    state = TrainingStateAverager(
        dht=None, optimizer=sgd_factory, params=model.parameters(), prefix="torch", start=False,
        client_mode=False,
    )  # fmt: skip
    grads = backward(model, 4, seed=9)
    stepped = [p - LR * g for p, g in zip(params_of(model), grads, strict=True)]
    state.step(increment_epoch=True, optimizer_step=True, zero_grad=True)
    assert state.local_epoch == 1
    for got, want in zip(model.parameters(), stepped, strict=True):
        torch.testing.assert_close(got.detach(), want)
    with pytest.raises(RuntimeError, match="not running"):
        state.step(averaging_round=True)


def test_a_plain_blocking_step_stays_in_the_callers_thread_and_a_delayed_one_does_not():
    """The facade enters the loop only for rounds and delayed work: an optimizer step alone
    runs in the caller's thread (no loop hop), a delayed one in a worker thread."""
    threads: list[threading.Thread] = []

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure=None):
            threads.append(threading.current_thread())
            return super().step(closure)

    model = make_model(200)
    dht = DHT(**HOST)
    try:
        averager = TrainingStateAverager(
            dht=dht,
            optimizer=lambda params: RecordingSGD(params, lr=LR),
            params=model.parameters(),
            offload_optimizer=True,
            prefix="threads",
            **FAST,
        )
        try:
            threads.clear()  # initialize_optimizer's step
            backward(model, 4, seed=11)
            averager.step(optimizer_step=True)
            assert threads == [threading.current_thread()]
            averager.step(optimizer_step=True, delay_optimizer_step=True, delay_averaging=True)
            averager.wait_for_delayed_updates()
            assert len(threads) == 2 and threads[1] is not threading.current_thread()
            averager.step()  # applies it
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()
