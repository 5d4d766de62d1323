"""Real averagers on loopback against a liar: CenteredClip keeps the result near the honest
mean, and a peer that sends an implausible weight is left out of the next rounds."""

from __future__ import annotations

import functools

import pytest
import torch
import trio
from test_averaging_averager import Swarm, local, random_tensors, step_all

from swarmtrain.averaging import AveragingError, MatchmakingError
from swarmtrain.averaging.errors import AllReduceError
from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.optim import DiLoCoOptimizer, Optimizer

FULL5 = {"target_group_size": 5, "min_group_size": 5, "min_matchmaking_time": 2.0}


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(
        torch.linalg.vector_norm(
            torch.cat([(x - y).reshape(-1) for x, y in zip(a, b, strict=True)])
        )
    )


@pytest.mark.trio
@pytest.mark.parametrize("aggregation", ["centered_clip", "mean"])
async def test_centered_clip_keeps_five_real_peers_near_the_honest_mean(aggregation):
    tensors = [random_tensors(40 + i) for i in range(5)]
    tensors[4] = [t * 1000 for t in tensors[4]]  # the liar
    honest_mean = [sum(tensors[i][t] for i in range(4)) / 4 for t in range(len(tensors[0]))]
    spread = max(_distance(tensors[i], honest_mean) for i in range(4))
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, prefix=f"robust_{aggregation}")
        averagers = [
            await swarm.add([t.clone() for t in tensors[i]], aggregation=aggregation, **FULL5)
            for i in range(5)
        ]
        results = await step_all(averagers, timeout=[20] * 5)
        assert all(isinstance(r, dict) and len(r) == 5 for r in results), results
        errors = [_distance(local(a), honest_mean) for a in averagers[:4]]
        swarm.stop_all()
    if aggregation == "centered_clip":
        # within the honest peers' own spread around their mean, on every honest peer
        assert max(errors) < 0.5 * spread, (errors, spread)
    else:
        assert min(errors) > 50 * spread, (errors, spread)  # the liar moved everyone


async def _step(averager, **kwargs):
    try:
        return await averager.step(**kwargs)
    except AveragingError as e:
        return e


@pytest.mark.trio
async def test_a_peer_claiming_an_implausible_weight_is_banned_across_rounds():
    tensors = [random_tensors(50 + i) for i in range(5)]
    group = {"target_group_size": 5, "min_group_size": 4, "min_matchmaking_time": 4.0}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, prefix="robust_ban")
        honest = [await swarm.add([t.clone() for t in tensors[i]], **group) for i in range(4)]
        # a liar that configured itself to allow its own huge weight
        liar = await swarm.add([t.clone() for t in tensors[4]], max_peer_weight=1e12, **group)
        results: list = [None] * 5

        async def run(i, **kwargs):
            results[i] = await _step([*honest, liar][i], **kwargs)

        async with trio.open_nursery() as steps:
            for i in range(4):
                steps.start_soon(functools.partial(run, i, timeout=20))
            # every honest member refuses its parts: it fails (no retry) instead of looking on
            steps.start_soon(
                functools.partial(run, 4, weight=1e10, timeout=20, allow_retries=False)
            )
        assert all(isinstance(r, dict) and len(r) == 5 for r in results[:4]), results
        # ... with the liar marked as a member they did without (it is no round partner)
        assert all(r.failed == {liar.peer_id} for r in results[:4]), results
        assert isinstance(results[4], AllReduceError), results[4]
        for averager in honest:
            assert averager.bans.banned(get_dht_time()) == {liar.peer_id}
        # next round: the honest peers group without the liar, which nobody leads or follows
        async with trio.open_nursery() as steps:
            for i in range(4):
                steps.start_soon(functools.partial(run, i, timeout=10, expected_group_size=4))
            steps.start_soon(functools.partial(run, 4, timeout=5))
        for result in results[:4]:
            assert isinstance(result, dict) and set(result) == {a.peer_id for a in honest}
            assert not result.failed
        assert isinstance(results[4], MatchmakingError), results[4]  # found nobody
        swarm.stop_all()


def test_optimizers_pass_the_aggregation_to_their_averagers():
    dht = DHT([], use_relay=False, relay_service=False, use_autonat=False)
    model = torch.nn.Linear(4, 2)

    def optimizer(**kwargs):
        return Optimizer(
            dht=dht,
            run_id="robust_opt",
            target_batch_size=8,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            aggregation="centered_clip",
            **kwargs,
        )

    try:
        with optimizer() as opt:
            assert opt.grad_averager.config.aggregation == "centered_clip"
            assert opt.state_averager.config.aggregation == "mean"  # parameters: exact mean
        with optimizer(use_local_updates=True) as opt:
            assert opt.state_averager.config.aggregation == "centered_clip"  # the only round
        diloco = DiLoCoOptimizer(
            model.parameters(),
            dht=dht,
            run_id="robust_diloco",
            inner_steps=2,
            num_fragments=2,
            aggregation="centered_clip",
        )
        try:
            assert [a.config.aggregation for a in diloco.averagers] == ["centered_clip"] * 2
        finally:
            diloco.shutdown()
        with pytest.raises(ValueError, match="aggregation"):
            DiLoCoOptimizer(
                model.parameters(), dht=dht, run_id="bad", inner_steps=2, aggregation="median"
            )
    finally:
        dht.shutdown()
