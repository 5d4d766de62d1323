"""DiLoCo without a network: outer step, fragments, streaming schedule, and the simulation."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

from swarmtrain.compression import Float16Compression
from swarmtrain.optim._textdata import BatchSampler, stdlib_text
from swarmtrain.optim.diloco_core import (
    ApplyOuter,
    Fragments,
    OuterState,
    StartSync,
    StreamingSchedule,
    mix_,
)
from swarmtrain.optim.diloco_simulation import (
    SimulationConfig,
    TinyTransformer,
    TinyTransformerConfig,
    evaluate,
    run_data_parallel,
    run_diloco,
)
from swarmtrain.optim.diloco_state import fingerprints_match, reference_peers, shared_fingerprint


def tensors(*values):
    return [torch.tensor(v, dtype=torch.float32) for v in values]


# --- OuterState ------------------------------------------------------------------------------


def test_outer_step_matches_hand_computed_nesterov():
    # SGD, lr 0.7, Nesterov momentum 0.9: buf = 0.9 * buf + g; p -= 0.7 * (g + 0.9 * buf)
    model = tensors([1.0, -2.0, 0.5])
    outer = OuterState(model)
    model[0].copy_(torch.tensor([0.8, -1.5, 0.5]))  # inner training moved the parameters
    delta = outer.pseudo_gradient(model)
    assert torch.allclose(delta[0], torch.tensor([0.2, -0.5, 0.0]))
    # step 1: buf = g = [0.2, -0.5, 0]; update = 1.9 g; p = p0 - 1.33 g
    shared = outer.apply_outer_step(delta, model_params=model)
    expected_1 = torch.tensor([0.734, -1.335, 0.5])
    assert torch.allclose(shared[0], expected_1, atol=1e-6)
    assert torch.equal(model[0], shared[0])  # copied into the model (alpha = 0)
    model[0].copy_(torch.tensor([0.634, -1.235, 0.7]))
    delta = outer.pseudo_gradient(model)
    assert torch.allclose(delta[0], torch.tensor([0.1, -0.1, -0.2]), atol=1e-6)
    # step 2: buf = 0.9 * [0.2, -0.5, 0] + [0.1, -0.1, -0.2] = [0.28, -0.55, -0.2]
    # update = g + 0.9 buf = [0.352, -0.595, -0.38]; p = p1 - 0.7 * update
    shared = outer.apply_outer_step(delta, model_params=model)
    assert torch.allclose(shared[0], torch.tensor([0.4876, -0.9185, 0.766]), atol=1e-6)
    assert outer.outer_step == 2


def test_custom_outer_optimizer_and_plain_sgd():
    model = tensors([1.0, 2.0])
    outer = OuterState(model, functools.partial(torch.optim.SGD, lr=1.0))
    (new,) = outer.apply_outer_step(tensors([0.25, -0.5]))
    assert torch.equal(new, torch.tensor([0.75, 2.5]))
    assert torch.equal(model[0], torch.tensor([1.0, 2.0]))  # model untouched without model_params
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        OuterState(model, lambda params: object())


def test_pseudo_gradient_sign_dtype_and_offload():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    outer = OuterState([param])
    assert outer.params[0].dtype == torch.float32 and outer.params[0].device.type == "cpu"
    assert outer.params[0].data_ptr() != param.data_ptr()
    with torch.no_grad():
        param.sub_(torch.tensor([0.5, -1.0, 0.0], dtype=torch.bfloat16))  # one "inner step"
    assert torch.equal(outer.params[0], torch.tensor([1.0, 2.0, 3.0]))  # the copy did not move
    (delta,) = outer.pseudo_gradient([param])
    assert delta.dtype == torch.float32 and delta.device.type == "cpu" and not delta.requires_grad
    # shared - local: positive where the local parameter went down, as a gradient would be
    assert torch.equal(delta, torch.tensor([0.5, -1.0, 0.0]))
    outer.apply_outer_step([delta], model_params=[param])
    assert param.dtype == torch.bfloat16 and param.requires_grad


def test_fragment_step_leaves_other_parameters_alone():
    model = tensors([1.0, 1.0], [5.0], [7.0, 7.0, 7.0])
    outer = OuterState(model)
    outer.apply_outer_step(tensors([0.1], [1.0, 1.0, 1.0]), indices=[1, 2], model_params=model[1:])
    assert torch.equal(outer.params[0], torch.tensor([1.0, 1.0]))
    assert outer.params[0] not in outer.optimizer.state  # no momentum for the untouched one
    assert torch.allclose(outer.params[1], torch.tensor([5.0 - 0.7 * 1.9 * 0.1]))
    assert torch.equal(model[2], outer.params[2])
    assert all(p.grad is None for p in outer.params)


def test_outer_state_rejects_bad_input_without_changing_state():
    model = tensors([1.0, 2.0], [3.0])
    outer = OuterState(model)
    before = [p.clone() for p in outer.params]
    with pytest.raises(ValueError, match="expected 2 pseudo-gradients"):
        outer.apply_outer_step(tensors([0.0, 0.0]))
    with pytest.raises(ValueError, match="expected shape"):
        outer.apply_outer_step(tensors([0.0], [0.0]))
    with pytest.raises(ValueError, match="not finite"):
        outer.apply_outer_step(tensors([0.0, math.nan], [0.0]))
    with pytest.raises(IndexError):
        outer.pseudo_gradient(model[:1], indices=[5])
    with pytest.raises(ValueError, match="duplicate"):
        outer.pseudo_gradient(model, indices=[0, 0])
    with pytest.raises(ValueError, match="alpha"):
        outer.apply_outer_step(tensors([0.0, 0.0], [0.0]), alpha=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, outer.params, strict=True))
    assert outer.outer_step == 0
    with pytest.raises(ValueError, match="at least one"):
        OuterState([])
    with pytest.raises(TypeError, match="floating-point"):
        OuterState([torch.tensor([1, 2])])


def test_state_dict_round_trip_for_a_joiner():
    torch.manual_seed(0)
    shapes = [(3, 4), (4,), (2, 2, 2)]
    veteran_model = [torch.randn(s) for s in shapes]
    veteran = OuterState(veteran_model)
    for _ in range(3):
        veteran.apply_outer_step([torch.randn(s) for s in shapes])
    state = veteran.state_dict()

    joiner_model = [torch.zeros(s) for s in shapes]  # a fresh peer's own initialization
    joiner = OuterState(joiner_model)
    joiner.load_state_dict(state)
    joiner.copy_to(joiner_model)
    assert joiner.outer_step == 3
    assert all(torch.equal(a, b) for a, b in zip(joiner_model, veteran.params, strict=True))

    # the state dict is a copy: the veteran keeps training without changing it
    saved = [p.clone() for p in state["params"]]
    grads = [torch.randn(s) for s in shapes]
    veteran.apply_outer_step(grads)
    assert all(torch.equal(a, b) for a, b in zip(saved, state["params"], strict=True))
    # from now on both compute the same outer steps (same momentum buffers)
    joiner.apply_outer_step(grads)
    assert all(torch.equal(a, b) for a, b in zip(joiner.params, veteran.params, strict=True))


def test_load_state_dict_validates_before_changing_anything():
    outer = OuterState(tensors([1.0, 2.0]))
    good = OuterState(tensors([5.0, 6.0])).state_dict()
    with pytest.raises(ValueError, match="missing"):
        outer.load_state_dict({"params": good["params"]})
    with pytest.raises(ValueError, match="expected shape"):
        outer.load_state_dict({**good, "params": tensors([1.0, 2.0, 3.0])})
    with pytest.raises(ValueError, match="expected 1 parameters"):
        outer.load_state_dict({**good, "params": tensors([1.0, 2.0], [3.0])})
    with pytest.raises(ValueError, match="outer_step"):
        outer.load_state_dict({**good, "outer_step": -1})
    assert torch.equal(outer.params[0], torch.tensor([1.0, 2.0]))


def test_mix():
    local = torch.tensor([1.0, 2.0])
    mix_(local, torch.tensor([3.0, 5.0]), alpha=0.25)
    assert torch.allclose(local, torch.tensor([2.5, 4.25]))  # 0.25 local + 0.75 shared
    mix_(local, torch.tensor([0.1, 0.2], dtype=torch.float64), alpha=0.0)
    assert torch.equal(local, torch.tensor([0.1, 0.2]))  # plain replace
    model = tensors([0.0, 4.0])
    outer = OuterState(tensors([2.0, 2.0]))
    outer.copy_to(model, alpha=0.5)
    assert torch.equal(model[0], torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="shape"):
        mix_(local, torch.zeros(3))


# --- Fragments -------------------------------------------------------------------------------


def _check_cover(fragments: Fragments, n: int) -> None:
    flat = [i for group in fragments.groups for i in group]
    assert sorted(flat) == list(range(n)) and len(flat) == n  # every parameter exactly once
    assert all(group for group in fragments.groups)


def _best_contiguous_max(numels, k):
    best = math.inf
    for cuts in itertools.combinations(range(1, len(numels)), k - 1):
        bounds = [0, *cuts, len(numels)]
        best = min(best, max(sum(numels[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("strategy", ["contiguous", "greedy"])
def test_fragments_cover_every_parameter_once_and_are_balanced(strategy):
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 9)
        numels = [rng.choice([0, 1, 4, 16, 100, 1000, rng.randint(1, 5000)]) for _ in range(n)]
        k = rng.randint(1, n)
        fragments = Fragments.split(numels, k, strategy=strategy)
        _check_cover(fragments, n)
        assert len(fragments) == k
        loads = [fragments.fragment_numel(f) for f in range(k)]
        assert sum(loads) == sum(numels)
        assert max(loads) <= sum(numels) / k + max(numels)
        assert fragments == Fragments.split(numels, k, strategy=strategy)  # deterministic
        if strategy == "contiguous":
            flat = [i for group in fragments.groups for i in group]
            assert flat == list(range(n))  # consecutive runs, in order
            assert max(loads) == _best_contiguous_max(numels, k)  # optimal min-max


def test_fragments_examples_and_lookups():
    assert Fragments.split([4, 4, 4, 4], 2).groups == ((0, 1), (2, 3))
    assert Fragments.split([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2).groups == (
        (0,),
        tuple(range(1, 11)),
    )
    greedy = Fragments.split([1, 10, 2, 9], 2, strategy="greedy")
    assert greedy.groups == ((0, 1), (2, 3))  # 10 -> 0, 9 -> 1, 2 -> 1, 1 -> 0: 11 and 11
    assert greedy.fragment_of(3) == 1 and greedy.select(["a", "b", "c", "d"], 1) == ["c", "d"]
    assert Fragments.split([5, 5, 5], 3).groups == ((0,), (1,), (2,))
    assert Fragments.split([0, 0, 0], 2).groups in (((0,), (1, 2)), ((0, 1), (2,)))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fragments = Fragments.for_parameters(model.parameters(), 2)
    _check_cover(fragments, 4)


def test_fragments_errors():
    with pytest.raises(ValueError, match="cannot split 2 parameters into 3"):
        Fragments.split([1, 2], 3)
    with pytest.raises(ValueError, match="num_fragments"):
        Fragments.split([1, 2], 0)
    with pytest.raises(ValueError, match="strategy"):
        Fragments.split([1, 2], 1, strategy="random")
    with pytest.raises(ValueError, match="exactly once"):
        Fragments(((0,), (0, 1)), (1, 1))
    with pytest.raises(ValueError, match="at least one"):
        Fragments(((0, 1), ()), (1, 1))


# --- StreamingSchedule -----------------------------------------------------------------------


def test_plain_diloco_schedule_syncs_and_applies_every_h_steps():
    schedule = StreamingSchedule(5)
    assert [s for s in range(1, 16) if schedule.actions(s)] == [5, 10, 15]
    assert schedule.actions(10) == (StartSync(0, 1, 10), ApplyOuter(0, 1, 10, 0.0))
    assert schedule.in_flight(10) == ()


def test_streaming_schedule_staggers_delays_and_mixes():
    schedule = StreamingSchedule(inner_steps=8, num_fragments=4, delay=3, alpha=0.5)
    assert schedule.stride == 2
    starts = {s: a for s in range(1, 40) for a in schedule.actions(s) if isinstance(a, StartSync)}
    applies = {s: a for s in range(1, 40) for a in schedule.actions(s) if isinstance(a, ApplyOuter)}
    # one fragment every H / F = 2 steps, fragment 0 first, each fragment every H = 8 steps
    assert [(s, a.fragment, a.round) for s, a in sorted(starts.items())][:6] == [
        (2, 0, 0),
        (4, 1, 0),
        (6, 2, 0),
        (8, 3, 0),
        (10, 0, 1),
        (12, 1, 1),
    ]
    for fragment in range(4):
        steps = [s for s, a in starts.items() if a.fragment == fragment]
        assert all(b - a == 8 for a, b in itertools.pairwise(steps))
    # each result is applied tau = 3 steps after its start, with alpha, before the next start
    for step, start in starts.items():
        if step + 3 < 40:
            apply = applies[step + 3]
            assert (apply.fragment, apply.round, apply.alpha) == (start.fragment, start.round, 0.5)
            assert schedule.apply_step(start.fragment, start.round) == step + 3
    assert schedule.in_flight(5) == (StartSync(1, 0, 4),)  # started at 4, applied at 7
    assert schedule.in_flight(7) == (StartSync(2, 0, 6),)
    assert schedule.rounds_completed(0, 4) == 0 and schedule.rounds_completed(0, 5) == 1
    assert schedule.rounds_completed(0, 13) == 2
    assert schedule.actions(0) == ()


def test_schedule_errors():
    with pytest.raises(ValueError, match="inner_steps must be at least 1"):
        StreamingSchedule(0)
    with pytest.raises(ValueError, match="num_fragments must be at least 1"):
        StreamingSchedule(4, 0)
    with pytest.raises(ValueError, match="must divide inner_steps"):
        StreamingSchedule(10, 3)
    with pytest.raises(ValueError, match="less than inner_steps"):
        StreamingSchedule(4, 2, delay=4)
    with pytest.raises(ValueError, match="delay must be at least 0"):
        StreamingSchedule(4, delay=-1)
    for alpha in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\)"):
            StreamingSchedule(4, alpha=alpha)
    with pytest.raises(TypeError):
        StreamingSchedule(True)
    with pytest.raises(TypeError):
        StreamingSchedule(4.0)
    with pytest.raises(IndexError):
        StreamingSchedule(4, 2).start_step(2, 0)


# --- the simulation --------------------------------------------------------------------------

TINY = TinyTransformerConfig(context=32, d_model=32, n_layers=1, n_heads=2)


def tiny_model() -> TinyTransformer:
    return TinyTransformer(TINY)


@pytest.fixture(scope="module")
def text():
    return stdlib_text(max_bytes=400_000)


def test_text_data_shards_and_windows(text):
    shards = text.shards(3)
    assert len({len(s) for s in shards}) == 1 and sum(map(len, shards)) <= len(text.train)
    windows = text.eval_windows(32, 10)
    assert windows.shape == (10, 33) and windows.dtype == torch.int64
    batch = BatchSampler(shards[0], 32, 4, seed=1).next()
    assert batch.shape == (4, 33) and int(batch.max()) < 256
    assert torch.equal(batch, BatchSampler(shards[0], 32, 4, seed=1).next())


def test_diloco_simulation_decreases_eval_loss(text):
    config = SimulationConfig(
        num_workers=2, inner_steps=5, outer_steps=20, batch_size=8, context=32, eval_windows=32
    )
    result = run_diloco(config, tiny_model, text)
    initial = evaluate(tiny_model(), text.eval_windows(32, 32))
    losses = [loss for _, loss in result.eval_losses]
    assert [step for step, _ in result.eval_losses] == list(range(5, 101, 5))
    assert losses[-1] < initial - 1.5  # 5.5 nats (random) -> below 4
    assert losses[-1] < losses[0]
    assert result.bytes_per_worker == 20 * 4 * sum(p.numel() for p in tiny_model().parameters())


def test_diloco_h1_outer_sgd_lr1_equals_data_parallel_sgd(text):
    """H = 1, outer SGD lr 1 without momentum, inner SGD: x - mean(x - (x - lr g_w)) is
    data-parallel SGD on the mean gradient, up to float rounding."""
    config = SimulationConfig(
        num_workers=3,
        inner_steps=1,
        outer_steps=6,
        batch_size=4,
        context=32,
        clip_grad_norm=None,
        eval_windows=8,
    )
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    diloco = run_diloco(
        config,
        tiny_model,
        text,
        inner_optimizer=sgd,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
    )
    baseline = run_data_parallel(config, tiny_model, text, optimizer=sgd)
    initial = [p.detach() for p in tiny_model().parameters()]
    moved = max(float((a - b).abs().max()) for a, b in zip(diloco.params, initial, strict=True))
    assert moved > 1e-3  # the runs did train
    difference = max(
        float((a - b).abs().max()) for a, b in zip(diloco.params, baseline.params, strict=True)
    )
    assert difference < 1e-6
    for (_, a), (_, b) in zip(diloco.eval_losses, baseline.eval_losses, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_fp16_pseudo_gradients_stay_within_one_percent_of_fp32(text):
    config = SimulationConfig(
        num_workers=2, inner_steps=5, outer_steps=8, batch_size=8, context=32, eval_windows=32
    )
    exact = run_diloco(config, tiny_model, text)
    fp16 = run_diloco(config, tiny_model, text, codec=Float16Compression())
    assert fp16.final_eval_loss == pytest.approx(exact.final_eval_loss, rel=0.01)
    assert fp16.bytes_per_worker == exact.bytes_per_worker // 2


def test_streaming_diloco_simulation_trains_and_is_deterministic(text):
    config = SimulationConfig(
        num_workers=2,
        inner_steps=4,
        outer_steps=10,
        batch_size=8,
        context=32,
        num_fragments=2,
        delay=1,
        alpha=0.5,
        eval_windows=16,
    )
    first = run_diloco(config, tiny_model, text)
    second = run_diloco(config, tiny_model, text)
    assert first.eval_losses == second.eval_losses
    assert first.final_eval_loss < first.eval_losses[0][1]
    assert first.final_eval_loss < math.log(256) - 1


# ------------------------------------------------------------- shared-parameter fingerprints


def test_fingerprints_tell_other_inits_apart_but_not_last_bits():
    torch.manual_seed(0)
    a = [torch.randn(50, 20), torch.randn(20), torch.zeros(3)]
    synced = [t + t.abs() * 1e-7 * torch.randn_like(t) for t in a]  # another peer's last bits
    torch.manual_seed(1)
    other = [torch.randn(50, 20), torch.randn(20), torch.zeros(3)]
    fa = shared_fingerprint(a)
    assert len(fa) == 64 and fa == shared_fingerprint([t.clone() for t in a])
    assert fingerprints_match(fa, shared_fingerprint(synced))
    assert not fingerprints_match(fa, shared_fingerprint(other))
    assert not fingerprints_match(fa, fa[:-1])
    nan = [t.clone() for t in a]
    nan[0].fill_(float("nan"))
    assert not fingerprints_match(shared_fingerprint(nan), shared_fingerprint(nan))
    assert shared_fingerprint([torch.ones(2)]) == [1.0, 1.0]


def test_reference_peers_majority_then_outer_step_then_peer_id():
    x, y, z = [1.0, 2.0], [5.0, -1.0], [0.0, 3.0]
    assert reference_peers({b"a": (x, 0), b"b": (y, 0), b"c": (y, 0)}) == {b"b", b"c"}
    assert reference_peers({b"a": (x, 0), b"b": (y, 3)}) == {b"b"}  # further along
    assert reference_peers({b"b": (y, 0), b"a": (x, 0), b"c": (z, 0)}) == {b"a"}  # smallest id
    assert reference_peers({b"a": (x, 2), b"b": (x, 2)}) == {b"a", b"b"}
    assert reference_peers({}) == frozenset()
