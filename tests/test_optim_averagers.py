"""GradientAverager and TrainingStateAverager between real DHTs and hosts on loopback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from swarm_util import FAST, group_of, swarm

from swarmtrain.averaging import AveragingStage, FailureReason, MatchmakingError, StepControl
from swarmtrain.compression import (
    CompressionInfo,
    Float16Compression,
    NoCompression,
    RoleAdaptiveCompression,
    TensorRole,
)
from swarmtrain.dht import get_dht_time
from swarmtrain.optim._optimizer_state import dump_optimizer_state, load_optimizer_state
from swarmtrain.optim._tensor_infos import TaggedCompression
from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.optim.state_averager import TrainingStateAverager


def run_all(*fns: Callable[[], object]) -> list:
    """Call every function in its own thread at once; their results (errors re-raised)."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [future.result(timeout=60) for future in futures]


def make_model(seed: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).to(
        dtype
    )


def backward(model: torch.nn.Module, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Backward of a mean loss over a random batch; the gradient of this batch alone."""
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(batch_size, 4, generator=generator).to(dtype)
    before = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    model(x).square().mean().backward()
    return [p.grad - b for p, b in zip(model.parameters(), before, strict=True)]


# ------------------------------------------------------------------------------ GradientAverager


def test_gradients_are_averaged_weighted_by_samples():
    batches = [[2, 3], [5], [1, 1, 4], []]  # the last peer has no samples: weight 0
    models = [make_model(i) for i in range(4)]
    weighted_sum = [torch.zeros_like(p) for p in models[0].parameters()]
    with swarm(4) as (dhts, averagers):
        for dht, model in zip(dhts, models, strict=True):
            averagers.append(
                GradientAverager(model.parameters(), dht=dht, prefix="grads", **group_of(4))
            )
        for i, (model, averager) in enumerate(zip(models, averagers, strict=True)):
            for j, batch_size in enumerate(batches[i]):
                grads = backward(model, batch_size, seed=10 * i + j)
                for total, grad in zip(weighted_sum, grads, strict=True):
                    total.add_(grad, alpha=batch_size)
                averager.accumulate_grads_(batch_size)
                model.zero_grad()
            assert averager.local_samples_accumulated == sum(batches[i])
            assert averager.local_times_accumulated == len(batches[i])
        want = [total / sum(map(sum, batches)) for total in weighted_sum]

        results = run_all(*(lambda a=a: a.step(timeout=15) for a in averagers))
        peers = {a.peer_id for a in averagers}
        for result in results:
            assert set(result) == peers
        for model, averager in zip(models, averagers, strict=True):
            assert averager.local_samples_accumulated == 0 == averager.local_times_accumulated
            old = [p.grad for p in model.parameters()]
            with averager.use_averaged_gradients() as averaged:
                assert len(averaged) == len(want)
                for param, expected in zip(model.parameters(), want, strict=True):
                    assert torch.isfinite(param.grad).all()
                    torch.testing.assert_close(param.grad, expected)
            assert all(p.grad is g for p, g in zip(model.parameters(), old, strict=True))


@pytest.mark.parametrize(
    "dtypes", [(torch.float32,) * 3, (torch.float32, torch.bfloat16, torch.float64)]
)
def test_accumulated_buffers_hold_the_weighted_mean_in_fused_and_mixed_dtype_paths(dtypes):
    # one dtype: fused foreach calls; mixed dtypes: the per-tensor loop (no network needed)
    params = [
        torch.zeros(shape, dtype=dtype)
        for shape, dtype in zip([(3, 4), (5,), (300, 300)], dtypes, strict=True)
    ]
    for param in params:
        param.requires_grad_(True)
    averager = GradientAverager(params, dht=None, prefix="grads", start=False, client_mode=False)
    generator = torch.Generator().manual_seed(0)
    batches = [
        (2, [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]),
        (6, [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]),
    ]
    for batch_size, grads in batches:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        averager.accumulate_grads_(batch_size)
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        for i, (tensor, param) in enumerate(zip(averaged, params, strict=True)):
            want = (2 * batches[0][1][i].double() + 6 * batches[1][1][i].double()) / 8
            assert tensor.dtype == param.dtype
            torch.testing.assert_close(tensor.double(), want, atol=2e-2, rtol=2e-2)
    averager.reset_accumulated_grads_()
    assert all(not a.any() for a in averager._grad_accumulators())
    averager.accumulate_grads_(3)  # one batch: its gradient exactly (a plain copy)
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        for tensor, param in zip(averaged, params, strict=True):
            assert torch.equal(tensor, param.grad)


def test_reuse_grad_buffers_and_a_scheduled_step():
    models = [make_model(20 + i) for i in range(2)]
    with swarm(2) as (dhts, averagers):
        averagers.append(
            GradientAverager(
                models[0].parameters(),
                dht=dhts[0],
                prefix="reuse",
                reuse_grad_buffers=True,
                **group_of(2),
            )
        )
        averagers.append(
            GradientAverager(models[1].parameters(), dht=dhts[1], prefix="reuse", **FAST)
        )
        reuse, plain = averagers
        # Matchmaking starts before the gradients exist; the weight is set by step().
        scheduled = get_dht_time() + 1.5
        control = reuse.schedule_step(scheduled_time=scheduled, timeout=15)
        assert isinstance(control, StepControl) and control.scheduled_time == scheduled
        with pytest.raises(ValueError, match="weight"):
            reuse.schedule_step(weight=3.0)

        # reuse_grad_buffers: autograd sums two batches of 3 into .grad; the mean divides by 2.
        g1 = backward(models[0], 3, seed=1)
        reuse.accumulate_grads_(3)
        g2 = backward(models[0], 3, seed=2)
        reuse.accumulate_grads_(3)
        mean0 = [(a + b) / 2 for a, b in zip(g1, g2, strict=True)]
        mean1 = backward(models[1], 4, seed=3)
        plain.accumulate_grads_(4)
        want = [(6 * a + 4 * b) / 10 for a, b in zip(mean0, mean1, strict=True)]

        results = run_all(
            lambda: reuse.step(control=control, timeout=15),
            lambda: plain.step(timeout=15),
        )
        assert results[0] == results[1] and len(results[0]) == 2
        assert control.stage == AveragingStage.FINISHED and control.weight == 6
        with pytest.raises(ValueError, match="already used"):
            reuse.step(control=control)
        for param in models[0].parameters():  # reset_accumulators zeroed the .grad buffers
            assert not param.grad.any()
        for model, averager in zip(models, averagers, strict=True):
            with averager.use_averaged_gradients():
                for param, expected in zip(model.parameters(), want, strict=True):
                    torch.testing.assert_close(param.grad, expected)


def test_gradient_averager_arguments_and_a_lonely_step(caplog):
    model = make_model(30)
    with swarm(1) as (dhts, averagers):
        averager = GradientAverager(
            model.parameters(),
            dht=dhts[0],
            prefix="alone",
            compression=RoleAdaptiveCompression(gradient=Float16Compression()),
            **FAST,
        )
        averagers.append(averager)
        assert isinstance(averager.config.compression, TaggedCompression)
        for bad in (0, -1, float("nan"), True):
            with pytest.raises((ValueError, TypeError)):
                averager.accumulate_grads_(bad)
        backward(model, 2, seed=4)
        averager.accumulate_grads_(2)
        local = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(MatchmakingError) as info:  # nobody to average with
            averager.step(timeout=1.5)
        assert info.value.reason == FailureReason.TOO_FEW_PEERS
        with averager.use_averaged_gradients():  # a failed step leaves the local mean gradient
            for param, expected in zip(model.parameters(), local, strict=True):
                torch.testing.assert_close(param.grad, expected)
    with pytest.raises(ValueError):
        GradientAverager([], dht=None, prefix="x")


# ------------------------------------------------------------------------------ training state


def adam_factory(params):
    return torch.optim.Adam(params, lr=0.1)


def stepped_state_averager(model, dht, seed: int, **kwargs) -> TrainingStateAverager:
    """An averager whose Adam has taken one step on this peer's own gradients."""
    averager = TrainingStateAverager(
        dht=dht, optimizer=adam_factory, params=model.parameters(), **kwargs
    )
    backward(model, 4, seed=seed)
    averager.step(optimizer_step=True, zero_grad=True)
    return averager


def state_of(averager: TrainingStateAverager) -> dict[str, list[torch.Tensor]]:
    opt = averager.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "params": [p.detach().clone() for p in params],
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in params],
        "exp_avg_sq": [opt.state[p]["exp_avg_sq"].clone() for p in params],
    }


def test_two_peers_average_parameters_and_adam_statistics():
    models = [make_model(40 + i) for i in range(2)]
    with swarm(2) as (dhts, averagers):
        for i, (dht, model) in enumerate(zip(dhts, models, strict=True)):
            averagers.append(
                stepped_state_averager(
                    model,
                    dht,
                    seed=i,
                    prefix="state",
                    average_opt_statistics=("exp_avg", "exp_avg_sq"),
                    sync_epoch_when_averaging=True,
                    compression=RoleAdaptiveCompression(optimizer=NoCompression()),
                    **group_of(2),
                )
            )
        averagers[0].local_epoch = 3
        averagers[1].local_epoch = 1
        before = [state_of(a) for a in averagers]
        assert not torch.equal(before[0]["exp_avg"][0], before[1]["exp_avg"][0])
        results = run_all(
            *(
                lambda a=a: a.step(averaging_round=True, averaging_opts={"timeout": 15})
                for a in averagers
            )
        )
        assert results[0] == {averagers[0].peer_id: 3, averagers[1].peer_id: 1} == results[1]
        for averager, model in zip(averagers, models, strict=True):
            assert averager.local_epoch == 3  # sync_epoch_when_averaging
            after = state_of(averager)
            for key in ("params", "exp_avg", "exp_avg_sq"):
                for got, x, y in zip(after[key], before[0][key], before[1][key], strict=True):
                    torch.testing.assert_close(got, (x + y) / 2)
            for param, expected in zip(model.parameters(), after["params"], strict=True):
                assert torch.equal(param, expected)  # no offloading: the model's own tensors


def test_newcomer_loads_parameters_optimizer_state_scheduler_and_epoch():
    donor_model, newcomer_model = make_model(50), make_model(51)

    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    with swarm(2) as (dhts, averagers):
        extra = torch.arange(5.0)
        donor = stepped_state_averager(
            donor_model, dhts[0], seed=5, prefix="load", scheduler=step_lr, extra_tensors=[extra]
        )
        averagers.append(donor)
        for i in range(4):
            backward(donor_model, 3, seed=100 + i)
            donor.step(increment_epoch=True, optimizer_step=True, zero_grad=True)
        assert donor.local_epoch == 4
        assert donor.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)

        newcomer = TrainingStateAverager(
            dht=dhts[1],
            optimizer=adam_factory,
            params=newcomer_model.parameters(),
            scheduler=step_lr,
            extra_tensors=[torch.zeros(5)],
            prefix="load",
            allow_state_sharing=False,
            **FAST,
        )
        averagers.append(newcomer)
        assert newcomer.load_state_from_peers(timeout=10)
        assert newcomer.local_epoch == 4
        assert newcomer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
        assert newcomer.scheduler.last_epoch == donor.scheduler.last_epoch
        assert torch.equal(newcomer.extra_tensors[0], extra)
        want, got = state_of(donor), state_of(newcomer)
        for key in want:
            for x, y in zip(got[key], want[key], strict=True):
                assert torch.equal(x, y)
        for param, expected in zip(newcomer_model.parameters(), want["params"], strict=True):
            assert torch.equal(param, expected)
        steps = [newcomer.optimizer.state[p]["step"] for p in newcomer_model.parameters()]
        assert [float(s) for s in steps] == [6.0] * len(steps), steps  # init + 5 steps

        donor.local_epoch = 2  # a donor behind us is refused
        assert not newcomer.load_state_from_peers(timeout=10)
        assert newcomer.local_epoch == 4


def test_offloaded_optimizer_steps_on_a_cpu_copy_and_writes_back():
    models = [make_model(60 + i, dtype=torch.bfloat16) for i in range(2)]

    def sgd(params):
        return torch.optim.SGD(params, lr=0.5)

    with swarm(2) as (dhts, averagers):
        for dht, model in zip(dhts, models, strict=True):
            averagers.append(
                TrainingStateAverager(
                    dht=dht,
                    optimizer=sgd,
                    params=model.parameters(),
                    offload_optimizer=True,
                    prefix="offload",
                    **group_of(2),
                )
            )
        first = averagers[0]
        assert first.reuse_tensors  # hivemind's default with offloading
        copies = [p for g in first.optimizer.param_groups for p in g["params"]]
        mains = list(models[0].parameters())
        assert all(c.dtype == torch.float32 and c.device.type == "cpu" for c in copies)
        assert not any(c is m for c, m in zip(copies, mains, strict=True))

        grads = backward(models[0], 3, seed=6)
        want = [c - 0.5 * g.float() for c, g in zip(copies, grads, strict=True)]
        first.step(optimizer_step=True, zero_grad=True)
        for copy, main, expected in zip(copies, mains, want, strict=True):
            torch.testing.assert_close(copy.detach(), expected)  # stepped in fp32
            assert torch.equal(main.detach(), expected.to(torch.bfloat16))  # written back
            assert main.grad is None  # torch's (and hivemind's) zero_grad: set_to_none=True
        backward(models[0], 3, seed=8)
        first.step(zero_grad=True, set_to_none=False)  # zero tensors instead
        assert all(main.grad is not None and not main.grad.any() for main in mains)
        assert all(copy.grad is not None and not copy.grad.any() for copy in copies)

        # A delayed step runs in the background; the model gets it at a later step().
        grads = backward(models[0], 3, seed=7)
        want = [c - 0.5 * g.float() for c, g in zip(copies, grads, strict=True)]
        assert first.step(optimizer_step=True, delay_optimizer_step=True) is None
        first.wait_for_delayed_updates()
        first.step()  # applies it
        for main, expected in zip(mains, want, strict=True):
            assert torch.equal(main.detach(), expected.to(torch.bfloat16))
        models[0].zero_grad()

        # A delayed averaging round averages the fp32 copies in the background; the next step
        # with averaging_round waits for it and writes the mean back to the models.
        before = [
            [p.detach().clone() for g in a.optimizer.param_groups for p in g["params"]]
            for a in averagers
        ]
        for averager in averagers:
            opts = {"timeout": 15}
            assert (
                averager.step(averaging_round=True, delay_averaging=True, averaging_opts=opts)
                is None
            )
        for averager in averagers:
            averager.wait_for_delayed_updates()
            assert not averager.averaging_in_progress
            averager.step()  # applies the finished round
        for model in models:
            for main, x, y in zip(model.parameters(), *before, strict=True):
                assert torch.equal(main.detach(), ((x + y) / 2).to(torch.bfloat16))


def test_delta_rule_round_in_the_background_keeps_the_steps_taken_meanwhile():
    """With ``delta_rule_averaging`` (what the Optimizer uses with an optimizer instance and
    delayed state averaging) an optimizer step does not wait for the delayed round, and the
    round's result is added on top of that step when it lands."""
    models = [make_model(70 + i) for i in range(2)]
    with swarm(2) as (dhts, averagers):
        for dht, model in zip(dhts, models, strict=True):
            averagers.append(
                TrainingStateAverager(
                    dht=dht,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                    delta_rule_averaging=True,
                    prefix="delta",
                    # room for a third peer: the group of 2 forms at the 3 s deadline
                    **{**group_of(3), "min_group_size": 2, "min_matchmaking_time": 3.0},
                )
            )
        first = averagers[0]
        before = [params_of(model) for model in models]
        for averager in averagers:
            averager.step(
                averaging_round=True, delay_averaging=True, averaging_opts={"timeout": 15}
            )
        grads = backward(models[0], 3, seed=8)
        first.step(optimizer_step=True, zero_grad=True)  # in matchmaking for 3 s: no wait
        assert first.averaging_in_progress
        stepped = [p - 0.5 * g for p, g in zip(before[0], grads, strict=True)]
        for param, expected in zip(models[0].parameters(), stepped, strict=True):
            torch.testing.assert_close(param.detach(), expected)
        mean = [(x + y) / 2 for x, y in zip(*before, strict=True)]
        for averager in averagers:
            averager.wait_for_delayed_updates()
            averager.step()  # applies the finished round: += mean - before the round
        for param, m, x, s in zip(models[0].parameters(), mean, before[0], stepped, strict=True):
            torch.testing.assert_close(param.detach(), s + (m - x))
        for param, m in zip(models[1].parameters(), mean, strict=True):
            torch.testing.assert_close(param.detach(), m)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_state_averager_arguments(caplog):
    model = make_model(70)
    with swarm(1) as (dhts, averagers):
        with pytest.raises(ValueError, match="offload_optimizer needs an optimizer factory"):
            TrainingStateAverager(
                dht=dhts[0],
                optimizer=adam_factory(model.parameters()),
                offload_optimizer=True,
                prefix="x",
            )
        with pytest.raises(ValueError, match="no statistic"):
            TrainingStateAverager(
                dht=dhts[0],
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                average_opt_statistics=["exp_avg"],
                prefix="x",
            )
        averager = TrainingStateAverager(
            dht=dhts[0], optimizer=adam_factory, params=model.parameters(), prefix="x", **FAST
        )
        averagers.append(averager)
        with pytest.raises(ValueError, match="offload_optimizer"):
            averager.step(optimizer_step=True, delay_optimizer_step=True)
        control = averager.schedule_step(timeout=5)
        with pytest.raises(ValueError, match="averaging_control"):
            averager.step(averaging_control=control)
        control.cancel()
        with caplog.at_level(logging.DEBUG, logger="swarmtrain.optim.state_averager"):
            # Nobody to average with: the round fails, the parameters stay as they were.
            params = [p.detach().clone() for p in model.parameters()]
            result = averager.step(averaging_round=True, averaging_opts={"timeout": 1.5})
        assert result is None
        assert "state averaging failed" in caplog.text
        for param, expected in zip(model.parameters(), params, strict=True):
            assert torch.equal(param, expected)


# ------------------------------------------------------------------------------ pure helpers


def test_optimizer_state_round_trip_and_tagged_compression():
    model = make_model(80)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    backward(model, 2, seed=8)
    opt.step()
    metadata, tensors = dump_optimizer_state(opt)
    other = torch.optim.AdamW(make_model(81).parameters(), lr=0.5)
    load_optimizer_state(other, metadata, tensors)
    assert other.param_groups[0]["betas"] == (0.8, 0.9) and other.param_groups[0]["lr"] == 0.01
    for a, b in zip(opt.state.values(), other.state.values(), strict=True):
        for key in a:
            assert torch.equal(a[key], b[key])
    with pytest.raises(ValueError):
        load_optimizer_state(other, metadata, tensors[:1])

    seen = []

    class Spy(RoleAdaptiveCompression):
        def compress(self, tensor, info=None, allow_inplace=False):
            seen.append(info)
            return super().compress(tensor, info, allow_inplace)

    infos = [CompressionInfo.from_tensor(torch.zeros(2), key="w", role=TensorRole.PARAMETER)]
    tagged = TaggedCompression(Spy(), infos)
    tagged.compress(torch.ones(2), CompressionInfo.from_tensor(torch.ones(2), key=0))
    tagged.compress(torch.ones(2), CompressionInfo.from_tensor(torch.ones(2), key=7))
    assert (seen[0].key, seen[0].role) == ("w", TensorRole.PARAMETER)
    assert (seen[1].key, seen[1].role) == (7, TensorRole.UNSPECIFIED)
