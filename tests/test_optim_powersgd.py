"""PowerSGDGradientAverager: the pure plan, and real peers averaging over loopback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from swarm_util import FAST, group_of, swarm

from swarmtrain.averaging import AveragingError, NonFiniteError
from swarmtrain.averaging.errors import AllReduceError
from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.optim.power_sgd import (
    PowerSGDGradientAverager,
    PowerSGDPlan,
    _AsyncPowerSGDAverager,
    matrix_shape,
    orthogonalize_,
)


def run_all(*fns: Callable[[], object]) -> list:
    """Call every function in its own thread at once; results or the exceptions they raised."""

    def call(fn):
        try:
            return fn()
        except AveragingError as e:
            return e

    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(call, fn) for fn in fns]
        return [future.result(timeout=60) for future in futures]


SHAPES = [(12, 10), (10,), (6, 2, 8)]  # (12, 10) and (6, 2, 8) -> (12, 8) are compressed


def make_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]


def set_grads(params, grads) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()


def averaged(averager: GradientAverager) -> list[torch.Tensor]:
    with averager.get_tensors() as tensors:
        return [t.clone() for t in tensors]


# ------------------------------------------------------------------------------ pure parts


def test_matrix_shape_and_which_tensors_are_compressed():
    assert matrix_shape((5,)) is None and matrix_shape(()) is None
    assert matrix_shape((12, 10)) == (12, 10)
    assert matrix_shape((6, 2, 8)) == (12, 8)
    assert matrix_shape((2, 3, 4, 5)) == (6, 20)
    plan = PowerSGDPlan([(12, 10), (10,), (6, 2, 8), (3, 40), (64, 64)], 2, 0.5)
    # (3, 40): 1 - 2 * 43 / 120 < 0.5, so sent as it is; 1-D tensors always are
    assert plan.compressed == (0, 2, 4) and plan.uncompressed == (1, 3)
    assert plan.matrix_shapes == ((12, 10), (12, 8), (64, 64))
    sent, full = plan.values_sent
    assert full == 120 + 10 + 96 + 120 + 4096
    assert sent == 10 + 120 + 2 * (22 + 20 + 128)
    assert PowerSGDPlan([(64, 64)], 40, 0.0).compressed == ()  # no saving at this rank
    # every peer starts from the same Q
    assert torch.equal(PowerSGDPlan(SHAPES, 2, 0.5).qs[1], PowerSGDPlan(SHAPES, 2, 0.5).qs[1])


def test_orthogonalize():
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(9, 3, generator=generator)
    original = matrix.clone()
    assert orthogonalize_(matrix) is matrix
    torch.testing.assert_close(matrix.t() @ matrix, torch.eye(3), atol=1e-5, rtol=0)
    # same column space: projecting the original columns onto it changes nothing
    torch.testing.assert_close(matrix @ (matrix.t() @ original), original, atol=1e-5, rtol=0)
    # dependent and zero columns: still orthonormal, never NaN
    for bad in (torch.zeros(5, 2), torch.ones(5, 3)):
        orthogonalize_(bad)
        assert torch.isfinite(bad).all()
        torch.testing.assert_close(bad.t() @ bad, torch.eye(bad.shape[1]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="m >= r"):
        orthogonalize_(torch.zeros(2, 3))


def test_bad_rank_and_ratio_are_clear_errors():
    params = make_params()
    for rank, error in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="averager_rank"):
            PowerSGDGradientAverager(params, rank, dht=None, prefix="x")
    for ratio in (1.0, -0.1):
        with pytest.raises(ValueError, match="min_compression_ratio"):
            PowerSGDGradientAverager(params, 2, min_compression_ratio=ratio, dht=None, prefix="x")
    with pytest.raises(ValueError, match="own averaged tensors"):
        PowerSGDGradientAverager(
            params, 2, grad_extra_tensors=[torch.zeros(1)], dht=None, prefix="x"
        )


# ------------------------------------------------------------------------------ real peers


def low_rank_grads(seed: int, basis: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients whose matrices share a rank-2 column space (so does their weighted mean)."""
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for shape, u in zip(SHAPES, basis, strict=True):
        if u is None:
            grads.append(torch.randn(shape, generator=generator))
        else:
            _, n = matrix_shape(shape)
            grads.append((u @ torch.randn(2, n, generator=generator)).reshape(shape))
    return grads


def test_rank_r_gradients_are_averaged_exactly_weighted_by_samples():
    generator = torch.Generator().manual_seed(100)
    basis = [torch.randn(12, 2, generator=generator), None, torch.randn(12, 2, generator=generator)]
    batch_sizes = [1, 2, 5]
    params = [make_params() for _ in batch_sizes]
    grads = [low_rank_grads(i, basis) for i in range(len(batch_sizes))]
    total = sum(batch_sizes)
    want = [
        sum(g[k] * b for g, b in zip(grads, batch_sizes, strict=True)) / total
        for k in range(len(SHAPES))
    ]
    with swarm(3) as (dhts, averagers):
        for dht, ps in zip(dhts, params, strict=True):
            averagers.append(PowerSGDGradientAverager(ps, 2, dht=dht, prefix="psgd", **group_of(3)))
        assert len({a.schema_hash for a in averagers}) == 1
        for ps, g, b, averager in zip(params, grads, batch_sizes, averagers, strict=True):
            set_grads(ps, g)
            averager.accumulate_grads_(b)
        results = run_all(*(lambda a=a: a.step(timeout=15) for a in averagers))
        for result in results:
            assert isinstance(result, dict) and len(result) == 3, result
        for ps, averager in zip(params, averagers, strict=True):
            with averager.use_averaged_gradients():
                for param, expected in zip(ps, want, strict=True):
                    torch.testing.assert_close(param.grad, expected, atol=1e-4, rtol=1e-4)
        for j in range(2):  # nothing was lost: the weighted mean residual is zero
            residual = sum(
                b * a.plan.residuals[j] for a, b in zip(averagers, batch_sizes, strict=True)
            )
            assert residual.abs().max() / total < 1e-4
        # peers with another rank have another schema: they never average together
        other = PowerSGDGradientAverager(make_params(), 3, dht=dhts[0], prefix="psgd2", **FAST)
        averagers.append(other)
        assert other.schema_hash != averagers[0].schema_hash


def test_error_feedback_tracks_the_running_sum_of_true_means():
    """Full-rank gradients at rank 1: one step loses much, but the lost part is carried over,
    so sum(applied) == sum(true means) - mean residual, and the relative error shrinks."""
    shapes = [(8, 6)]
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(8, 6, generator=generator) for _ in range(2)]
    true_mean = (grads[0] + grads[1]) / 2
    params = [[torch.nn.Parameter(torch.zeros(8, 6))] for _ in range(2)]
    applied_sum = [torch.zeros(8, 6) for _ in range(2)]
    errors = []
    with swarm(3) as (dhts, averagers):
        for dht, ps in zip(dhts[:2], params, strict=True):
            averagers.append(
                PowerSGDGradientAverager(
                    ps, 1, min_compression_ratio=0.0, dht=dht, prefix="ef", **group_of(2)
                )
            )
        assert averagers[0].plan.compressed == (0,) and shapes == [(8, 6)]
        rounds = 4
        for t in range(1, rounds + 1):
            for ps, grad, averager in zip(params, grads, averagers, strict=True):
                set_grads(ps, [grad])
                averager.accumulate_grads_(4)
            results = run_all(*(lambda a=a: a.step(timeout=15) for a in averagers))
            assert all(isinstance(r, dict) and len(r) == 2 for r in results), results
            for i, averager in enumerate(averagers[:2]):
                with averager.use_averaged_gradients():
                    applied_sum[i] += params[i][0].grad
            torch.testing.assert_close(applied_sum[0], applied_sum[1], atol=1e-4, rtol=1e-4)
            mean_residual = (averagers[0].plan.residuals[0] + averagers[1].plan.residuals[0]) / 2
            torch.testing.assert_close(
                applied_sum[0] + mean_residual, t * true_mean, atol=1e-4, rtol=1e-4
            )
            errors.append(float((applied_sum[0] - t * true_mean).norm() / (t * true_mean).norm()))
        # a newcomer downloads the group's warm-started Q (its own is the initial one)
        newcomer = PowerSGDGradientAverager(
            [torch.nn.Parameter(torch.zeros(8, 6))],
            1,
            min_compression_ratio=0.0,
            dht=dhts[2],
            prefix="ef",
            **group_of(2),
        )
        averagers.append(newcomer)
        assert not torch.equal(newcomer.plan.qs[0], averagers[0].plan.qs[0])
        metadata, tensors = newcomer.load_state_from_peers(timeout=10)
        assert metadata["powersgd_rank"] == 1 and len(tensors) == 1
        torch.testing.assert_close(newcomer.plan.qs[0], averagers[0].plan.qs[0])
    assert errors[0] > 0.3  # rank 1 of a full-rank 8 x 6 mean: one step alone is far off
    assert errors[-1] < 0.8 * errors[0], errors


class _SkipsRoundQ(_AsyncPowerSGDAverager):
    """Fault injection: this peer leaves after round P (as if it crashed in between)."""

    async def _round(self, group, suffix, tensors, infos, weight, failed_members=None):
        if suffix == b".Q":
            raise AllReduceError("injected: left before round Q")
        return await super()._round(group, suffix, tensors, infos, weight, failed_members)


class _FailingPowerSGD(PowerSGDGradientAverager):
    _async_class = _SkipsRoundQ


def test_a_peer_failing_mid_step_leaves_a_finite_partial_average():
    generator = torch.Generator().manual_seed(7)
    params = [make_params() for _ in range(3)]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(3)]
    timeouts = {"next_chunk_timeout": 1.0, "allreduce_timeout": 10.0}
    with swarm(3) as (dhts, averagers):
        for i, (dht, ps) in enumerate(zip(dhts, params, strict=True)):
            cls = _FailingPowerSGD if i == 2 else PowerSGDGradientAverager
            averagers.append(cls(ps, 2, dht=dht, prefix="fail", **group_of(3), **timeouts))
        for ps, g, averager in zip(params, grads, averagers, strict=True):
            set_grads(ps, g)
            averager.accumulate_grads_(3)
        results = run_all(
            *(functools.partial(a.step, timeout=15, allow_retries=False) for a in averagers)
        )
        assert isinstance(results[2], AllReduceError), results[2]
        assert all(isinstance(r, dict) for r in results[:2]), results
        # the survivors did without its round-Q parts: it is no round partner of theirs
        assert all(r.failed == {averagers[2].peer_id} for r in results[:2]), results
        mean = [sum(g[k] for g in grads) / 3 for k in range(len(SHAPES))]
        for i in range(2):
            values = averaged(averagers[i])
            assert all(torch.isfinite(v).all() for v in values)
            # the 1-D tensor went in round P, which completed with all three peers
            torch.testing.assert_close(values[1], mean[1], atol=1e-5, rtol=1e-5)
            residuals = averagers[i].plan.residuals
            assert all(torch.isfinite(r).all() for r in residuals)
        # the failed peer kept its local mean gradient and its (zero) residuals
        failed = averaged(averagers[2])
        for value, local in zip(failed, grads[2], strict=True):
            torch.testing.assert_close(value, local)
        assert all(r.abs().max() == 0 for r in averagers[2].plan.residuals)


def test_a_peer_with_nan_gradients_sends_zeros_and_the_others_stay_finite(caplog):
    generator = torch.Generator().manual_seed(7)
    basis = [torch.randn(12, 2, generator=generator), None, torch.randn(12, 2, generator=generator)]
    params = [make_params() for _ in range(3)]
    grads = [low_rank_grads(i, basis) for i in range(3)]
    grads[2][0][1, 1] = float("nan")
    with swarm(3) as (dhts, averagers):
        for dht, ps in zip(dhts, params, strict=True):
            averagers.append(
                PowerSGDGradientAverager(ps, 2, dht=dht, prefix="psgd_nan", **group_of(3))
            )
        for ps, g, averager in zip(params, grads, averagers, strict=True):
            set_grads(ps, g)
            averager.accumulate_grads_(1)
        results = run_all(*(lambda a=a: a.step(timeout=15) for a in averagers))
        assert isinstance(results[2], NonFiniteError), results[2]
        for result in results[:2]:
            assert isinstance(result, dict) and len(result) == 3, result  # nobody waited
        assert averagers[0].plan.compressed  # the P and Q rounds ran
        # rank-2 gradients: PowerSGD is exact, the mean of the two clean peers
        want = [(a + b) / 2 for a, b in zip(grads[0], grads[1], strict=True)]
        for averager in averagers[:2]:
            for got, expected in zip(averaged(averager), want, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert all(bool(torch.isfinite(r).all()) for a in averagers[:2] for r in a.plan.residuals)
    assert any("skips PowerSGD round" in r.getMessage() for r in caplog.records)
