"""ProcessGradientAverager (gradient rounds in a helper process) next to an in-process
GradientAverager, over real hosts on loopback."""

from __future__ import annotations

import pytest
import torch
from polling import wait_for
from swarm_util import group_of, swarm
from test_optim_averagers import backward, make_model, run_all
from test_optim_optimizer import Peer, dhts, full_loss, in_threads  # noqa: F401 (dhts: fixture)

from swarmtrain.averaging import AveragingStage
from swarmtrain.averaging.process_backend import HelperProcessBackend
from swarmtrain.optim import GradientAverager, ProcessGradientAverager, TrainingStateAverager

pytestmark = pytest.mark.timeout(240)


def test_gradients_average_between_a_helper_process_and_an_in_process_peer():
    models = [make_model(0), make_model(1)]
    sums = [torch.zeros_like(p) for p in models[0].parameters()]
    with swarm(1) as (nodes, averagers):
        averagers.append(
            GradientAverager(models[0].parameters(), dht=nodes[0], prefix="g", **group_of(2))
        )
        averagers.append(
            ProcessGradientAverager(models[1].parameters(), dht=nodes[0], prefix="g", **group_of(2))
        )
        helper = averagers[1].helper
        assert helper.is_alive() and averagers[1].peer_id == helper.peer_id
        for round_index in range(2):
            for i, (model, averager) in enumerate(zip(models, averagers, strict=True)):
                batch = 2 + i  # weights 2 and 3
                grads = backward(model, batch, seed=10 * round_index + i)
                for total, grad in zip(sums, grads, strict=True):
                    total.add_(grad, alpha=batch)
                averager.accumulate_grads_(batch)
                model.zero_grad()
            want = [total / 5 for total in sums]
            if round_index == 0:
                run_all(*(lambda a=a: a.step(timeout=30) for a in averagers))
            else:  # scheduled: the trigger and weight travel to the helper, its stage back
                controls = [a.schedule_step(timeout=30) for a in averagers]
                assert not controls[1].triggered
                looking = (AveragingStage.LOOKING_FOR_GROUP, AveragingStage.AWAITING_TRIGGER)
                helper_control = controls[1]
                wait_for(lambda c=helper_control, s=looking: c.stage in s, 10, "the stage report")
                run_all(
                    *(
                        lambda a=a, c=c: a.step(control=c)
                        for a, c in zip(averagers, controls, strict=True)
                    )
                )
                assert controls[1].triggered and controls[1].weight == 3
            for model, averager in zip(models, averagers, strict=True):
                with averager.use_averaged_gradients():
                    for param, expected in zip(model.parameters(), want, strict=True):
                        torch.testing.assert_close(param.grad, expected)
            sums = [torch.zeros_like(p) for p in models[0].parameters()]
    assert not helper.is_alive()
    assert helper._process.exitcode == 0


def test_an_averager_with_its_own_state_cannot_move_to_a_helper():
    class ProcessStateAverager(TrainingStateAverager, HelperProcessBackend):
        pass

    model = make_model(0)
    with swarm(1) as (nodes, _):
        with pytest.raises(TypeError, match="get_current_state"):
            ProcessStateAverager(
                optimizer=torch.optim.SGD,
                params=model.parameters(),
                dht=nodes[0],
                prefix="s",
                start=False,
            )


def test_an_optimizer_averages_its_gradients_in_a_helper_process(dhts):  # noqa: F811
    first, second = dhts(2)
    peers = [
        Peer(first, 0, delay_state_averaging=False),
        Peer(second, 1, delay_state_averaging=False, grad_averager_factory=ProcessGradientAverager),
    ]
    try:
        helper = peers[1].opt.grad_averager.helper
        assert helper.is_alive()
        initial_loss = full_loss(peers[1].model)
        in_threads(*(lambda p=p: p.train_until(3) for p in peers))
        assert {p.opt.local_epoch for p in peers} == {3}
        parts_sent, deltas_sent = helper.bytes_sent  # gradient rounds went through the helper
        assert parts_sent > 0 and deltas_sent > 0
        assert full_loss(peers[1].model) < initial_loss
    finally:
        for peer in peers:
            peer.opt.shutdown()
    assert not helper.is_alive() and helper._process.exitcode == 0
