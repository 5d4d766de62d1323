"""``declaration_linger`` on the public classes: ``DecentralizedAverager``, ``Optimizer`` and
``DiLoCoOptimizer`` take it, check it, and hand it to the matchmaking that runs (the live
``Matchmaking`` object of each averager; what it does is tested in
``test_averaging_matchmaking_linger.py`` and ``test_averaging_slow_dht_reads.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from swarm_util import open_dhts

from swarmtrain.averaging import DecentralizedAverager
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
from swarmtrain.averaging.averager_config import AveragerConfig
from swarmtrain.averaging.matchmaking_types import DEFAULT_DECLARATION_LINGER
from swarmtrain.optim import AsyncDiLoCoOptimizer, AsyncOptimizer, DiLoCoOptimizer, Optimizer


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _optimizer_options(model: torch.nn.Module, **opts) -> dict:
    return {
        "run_id": "linger_opt",
        "target_batch_size": 8,
        "batch_size_per_step": 4,
        "optimizer": _sgd,
        "params": model.parameters(),
        "matchmaking_time": 1.0,
        **opts,
    }


def _diloco_options(**opts) -> dict:
    return {"run_id": "linger_diloco", "inner_steps": 2, "matchmaking_time": 1.0, **opts}


@pytest.mark.parametrize("bad", [-0.5, -math.inf, math.nan, math.inf])
def test_a_negative_or_infinite_linger_is_refused_everywhere(bad):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="declaration_linger must be finite and non-negative"):
        AveragerConfig(prefix="linger", declaration_linger=bad)
    with pytest.raises(ValueError, match="declaration_linger"):
        Optimizer(dht=None, **_optimizer_options(model, declaration_linger=bad))
    with pytest.raises(ValueError, match="declaration_linger"):
        AsyncOptimizer(dht=None, **_optimizer_options(model, declaration_linger=bad))
    with pytest.raises(ValueError, match="declaration_linger"):
        DiLoCoOptimizer(model.parameters(), dht=None, **_diloco_options(declaration_linger=bad))


@pytest.mark.parametrize("bad", ["5", None, True])
def test_a_linger_that_is_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="declaration_linger must be a number"):
        AveragerConfig(prefix="linger", declaration_linger=bad)
    with pytest.raises(TypeError, match="declaration_linger"):
        AsyncOptimizer(
            dht=None, **_optimizer_options(torch.nn.Linear(2, 1), declaration_linger=bad)
        )


def test_the_default_and_zero_reach_the_matchmaking_config():
    assert AveragerConfig(prefix="linger").matchmaking_config().declaration_linger == (
        DEFAULT_DECLARATION_LINGER
    )
    averager = DecentralizedAverager(
        [torch.zeros(3)], None, start=False, prefix="linger", client_mode=False,
        declaration_linger=0,
    )  # fmt: skip
    assert averager.config.matchmaking_config().declaration_linger == 0.0


@pytest.mark.trio
async def test_the_running_averager_matchmakes_with_the_linger_it_was_given():
    async with open_dhts(1) as (dht,):
        async with AsyncDecentralizedAverager.create(
            [torch.zeros(3)], dht, prefix="linger", declaration_linger=1.5
        ) as averager:
            assert averager._matchmaking is not None
            assert averager._matchmaking.config.declaration_linger == 1.5


@pytest.mark.trio
async def test_the_optimizer_gives_its_linger_to_both_averagers():
    model = torch.nn.Linear(2, 1)
    async with open_dhts(1) as (dht,):
        async with Optimizer.create(
            dht=dht, **_optimizer_options(model, declaration_linger=2.5)
        ) as opt:
            assert isinstance(opt, AsyncOptimizer) and opt.declaration_linger == 2.5
            assert opt._rounds is not None and opt._state_service is not None
            for averager in (opt._rounds.averager, opt._state_service):
                assert averager._matchmaking is not None
                assert averager._matchmaking.config.declaration_linger == 2.5


@pytest.mark.trio
async def test_diloco_gives_its_linger_to_every_fragment_averager():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    async with open_dhts(1) as (dht,):
        async with DiLoCoOptimizer.create(
            model.parameters(), dht=dht, **_diloco_options(num_fragments=2, declaration_linger=0.0)
        ) as opt:
            assert isinstance(opt, AsyncDiLoCoOptimizer) and len(opt.averagers) == 2
            for averager in opt.averagers:
                assert averager._matchmaking is not None
                assert averager._matchmaking.config.declaration_linger == 0.0
