"""Newcomers do not load poison: a donor's state is checked before any of it is used."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import torch
from swarm_util import FAST, swarm

from swarmtrain.averaging.state_checks import DonorBans, RejectReason, StateRejected, TensorSpec
from swarmtrain.optim._optimizer_state import encode_tensors
from swarmtrain.optim._state_checks import (
    EPOCH_LIMIT,
    check_epoch,
    check_scheduler_state,
    optimizer_state_specs,
)
from swarmtrain.optim.state_averager import TrainingStateAverager


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def adam(params):
    return torch.optim.Adam(params, lr=0.1)


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


# ------------------------------------------------------------------ the checks alone (no network)


def adam_state(lr: float = 0.1, **group) -> tuple[dict, list[TensorSpec]]:
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0].update(lr=lr, **group)
    tensors: list[torch.Tensor] = []
    return encode_tensors(opt.state_dict(), tensors, copy=False), [
        TensorSpec.of(t) for t in tensors
    ]


def test_hyperparameters_must_match_except_a_bounded_lr_and_momenta():
    mine, specs = adam_state()
    assert optimizer_state_specs(mine, specs, adam_state(lr=0.5)[0], [1.0]) == specs
    assert optimizer_state_specs(mine, specs, adam_state(betas=(0.5, 0.9))[0], [1.0]) == specs
    for poison, reason in [
        (adam_state(lr=2.0)[0], RejectReason.HYPERPARAMETERS),  # above 10x
        (adam_state(lr=-0.1)[0], RejectReason.HYPERPARAMETERS),
        (adam_state(lr=float("nan"))[0], RejectReason.HYPERPARAMETERS),
        (adam_state(betas=(1.5, 0.9))[0], RejectReason.HYPERPARAMETERS),
        (adam_state(weight_decay=0.1)[0], RejectReason.HYPERPARAMETERS),
        (adam_state(evil=1)[0], RejectReason.HYPERPARAMETERS),
        (adam_state(lr=1)[0], RejectReason.HYPERPARAMETERS),  # an int where ours is a float
    ]:
        with pytest.raises(StateRejected) as info:
            optimizer_state_specs(mine, specs, poison, [1.0])
        assert info.value.reason is reason and info.value.ban


def test_tensor_references_must_cover_each_tensor_once():
    mine, specs = adam_state()
    twice = adam_state()[0]
    state = twice["state"][0]
    state["exp_avg_sq"] = dict(state["exp_avg"])
    with pytest.raises(StateRejected, match="used twice"):
        optimizer_state_specs(mine, specs, twice, [1.0])
    wrong = adam_state()[0]
    wrong["state"][0]["exp_avg"] = [1.0, 2.0, 3.0]
    with pytest.raises(StateRejected, match="not a tensor reference"):
        optimizer_state_specs(mine, specs, wrong, [1.0])


def test_epochs_are_bounded_by_the_swarm_or_the_cap():
    assert check_epoch(6, 0, 5) == 6  # within the margin
    assert check_epoch(10**6, 0, None) == 10**6  # no progress known: only the cap
    for epoch, vouched in [(10**9, 5), (EPOCH_LIMIT + 1, None), (8, 5)]:
        with pytest.raises(StateRejected) as info:
            check_epoch(epoch, 0, vouched)
        assert info.value.reason is RejectReason.EPOCH
    with pytest.raises(StateRejected) as info:
        check_epoch(3, 4, None)
    assert info.value.reason is RejectReason.BEHIND and not info.value.ban
    with pytest.raises(StateRejected):
        check_epoch(True, 0, None)


def test_scheduler_configuration_must_match():
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = step_lr(torch.optim.SGD([param], lr=0.1))
    mine = scheduler.state_dict()
    check_scheduler_state(mine, {**mine, "last_epoch": 3, "_step_count": 4}, 3, 1.0)
    check_scheduler_state(mine, None, 3, 1.0)
    for poison in [
        {**mine, "base_lrs": [1e9]},
        {**mine, "gamma": 2.0},
        {**mine, "_last_lr": [1e9]},
        {**mine, "last_epoch": 10**9},
        {**mine, "evil": 1},
    ]:
        with pytest.raises(StateRejected):
            check_scheduler_state(mine, poison, 3, 1.0)


def test_bans_expire():
    bans = DonorBans(600.0, max_banned=2)
    bans.ban("a", "NaN", now=0.0)
    assert bans.banned("a", 599.0) == "NaN"
    assert bans.banned("a", 600.0) is None
    for i, peer in enumerate("bcd"):
        bans.ban(peer, "x", now=float(i))
    assert len(bans) == 2 and bans.banned("b", 3.0) is None  # the soonest to expire went first


# ------------------------------------------------------------------ real peers


def _poison_lr(metadata, tensors):
    metadata["optimizer_metadata"]["param_groups"][0]["lr"] = 1e9


def _poison_key(metadata, tensors):
    metadata["optimizer_metadata"]["param_groups"][0]["evil"] = 1.0


def _poison_decay_type(metadata, tensors):
    metadata["optimizer_metadata"]["param_groups"][0]["weight_decay"] = "0"


def _poison_scheduler(metadata, tensors):
    metadata["scheduler_state"]["base_lrs"] = [1e9]


def _poison_epoch(metadata, tensors):
    metadata["epoch"] = 10**9


def _poison_nan(metadata, tensors):
    tensors[0][0, 0] = float("nan")


def _poison_float64(metadata, tensors):
    tensors[0] = tensors[0].double()


def _poison_int64(metadata, tensors):
    tensors[0] = (tensors[0] * 1000).long()


def _poison_shape(metadata, tensors):
    tensors[0] = torch.zeros(tensors[0].numel() + 1)


def _poison_statistic_dtype(metadata, tensors):
    tensors[-1] = tensors[-1].double()  # the optimizer's last state tensor


def _poison_missing(metadata, tensors):
    del tensors[-1]


POISONS: dict[str, tuple[Callable, RejectReason]] = {
    "nan": (_poison_nan, RejectReason.NON_FINITE),
    "float64": (_poison_float64, RejectReason.DTYPE),
    "int64": (_poison_int64, RejectReason.DTYPE),
    "shape": (_poison_shape, RejectReason.SHAPE),
    "statistic_dtype": (_poison_statistic_dtype, RejectReason.DTYPE),
    "missing_tensor": (_poison_missing, RejectReason.TENSOR_COUNT),
    "epoch": (_poison_epoch, RejectReason.EPOCH),
    "lr": (_poison_lr, RejectReason.HYPERPARAMETERS),
    "new_key": (_poison_key, RejectReason.HYPERPARAMETERS),
    "decay_type": (_poison_decay_type, RejectReason.HYPERPARAMETERS),
    "scheduler": (_poison_scheduler, RejectReason.HYPERPARAMETERS),
}


class HostileAverager(TrainingStateAverager):
    """Serves its real state with one poison applied."""

    def __init__(self, *args, poison: Callable, **kwargs):
        self.poison = poison
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        metadata, tensors, _ = super().get_current_state()
        self.poison(metadata, tensors)
        return metadata, tensors  # compression infos are made from the tensors sent


def averager(dht, model, cls=TrainingStateAverager, **kwargs) -> TrainingStateAverager:
    return cls(
        dht=dht,
        optimizer=adam,
        params=model.parameters(),
        scheduler=step_lr,
        prefix="poison",
        **FAST,
        **kwargs,
    )


def train(state_averager: TrainingStateAverager, model, epochs: int, seed: int) -> None:
    for i in range(epochs):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + i))
        model(x).square().mean().backward()
        state_averager.step(increment_epoch=True, optimizer_step=True, zero_grad=True)


def snapshot(state_averager: TrainingStateAverager) -> dict:
    opt = state_averager.optimizer
    return {
        "epoch": state_averager.local_epoch,
        "params": [p.detach().clone() for p in state_averager.main_parameters],
        "stats": [opt.state[p]["exp_avg"].clone() for p in state_averager._opt_params()],
        "lr": opt.param_groups[0]["lr"],
        "groups": [sorted(g) for g in opt.param_groups],
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["epoch"] == b["epoch"] and a["lr"] == b["lr"] and a["groups"] == b["groups"]
    for key in ("params", "stats"):
        for x, y in zip(a[key], b[key], strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_newcomer_rejects_a_poisoned_state_and_loads_an_honest_one(poison, caplog):
    apply, reason = POISONS[poison]
    with swarm(3) as (dhts, averagers):
        hostile_model, honest_model, new_model = make_model(1), make_model(2), make_model(3)
        hostile = averager(dhts[0], hostile_model, HostileAverager, poison=apply)
        averagers.append(hostile)
        honest = averager(dhts[1], honest_model, allow_state_sharing=False)
        averagers.append(honest)
        for peer, model, seed in ((hostile, hostile_model, 10), (honest, honest_model, 20)):
            train(peer, model, 4, seed)
        hostile.state_sharing_priority = 9.0  # asked first
        newcomer = averager(dhts[2], new_model, allow_state_sharing=False)
        averagers.append(newcomer)
        before = snapshot(newcomer)

        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert not newcomer.load_state_from_peers(timeout=10, swarm_epoch=5)
        assert_same(snapshot(newcomer), before)  # nothing of the rejected state was applied
        failure = newcomer.state_download_failure
        assert failure is not None and [r.rejected for r in failure.reasons] == [reason]
        assert failure.reasons[0].donor == hostile.peer_id
        assert any(
            str(hostile.peer_id) in r.getMessage() and "banned for 600 s" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]

        honest.allow_state_sharing = True
        honest.state_sharing_priority = 1.0
        deadline = time.monotonic() + 20
        while not newcomer.load_state_from_peers(timeout=5, swarm_epoch=5):
            assert newcomer.state_download_failure.banned == 1  # the hostile one is skipped
            assert time.monotonic() < deadline, newcomer.state_download_failure
            time.sleep(0.1)
        assert_same(snapshot(newcomer), {**snapshot(honest), "epoch": 4})
        assert newcomer.local_epoch == 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("poison", ["epoch", "lr", "float64"])
def test_an_optimizer_newcomer_skips_a_hostile_donor_for_an_honest_one(poison, caplog):
    """The epoch is checked against the swarm's progress: 10**9 is not what it vouches for."""
    from swarmtrain.optim import Optimizer

    apply, reason = POISONS[poison]
    fast = {"matchmaking_time": 1.0, "averaging_timeout": 10.0, "load_state_timeout": 10.0}
    tracker = {"tracker_opts": {"gossip_period": 0.1, "min_refresh_period": 0.2}}
    with swarm(3) as (dhts, averagers):
        honest_model, new_model, hostile_model = make_model(1), make_model(2), make_model(3)
        honest = Optimizer(
            dht=dhts[0], run_id="poison", target_batch_size=8, batch_size_per_step=4,
            optimizer=sgd, params=honest_model.parameters(), **fast, **tracker,
        )  # fmt: skip
        averagers.append(honest)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        while honest.local_epoch < 3:
            honest_model(x).square().mean().backward()
            honest.step()
            honest.zero_grad()
        hostile = HostileAverager(
            dht=dhts[1], optimizer=sgd, params=hostile_model.parameters(), poison=apply,
            prefix="poison_state_averager", **FAST,
        )  # fmt: skip
        averagers.append(hostile)
        train(hostile, hostile_model, 3, seed=30)
        hostile.state_sharing_priority = 1e9  # asked first
        newcomer = Optimizer(
            dht=dhts[2], run_id="poison", target_batch_size=8, batch_size_per_step=4,
            optimizer=sgd, params=new_model.parameters(), **fast, **tracker,
        )  # fmt: skip
        averagers.append(newcomer)
        deadline = time.monotonic() + 10
        while newcomer.tracker.global_epoch < 3:  # the honest peer's progress arrives
            assert time.monotonic() < deadline
            time.sleep(0.1)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert newcomer.load_state_from_peers()
        assert newcomer.local_epoch == 3
        for mine, theirs in zip(new_model.parameters(), honest_model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        assert newcomer.state_averager.optimizer.param_groups[0]["lr"] == 0.1
        assert any(
            str(hostile.peer_id) in r.getMessage() and reason.value in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
