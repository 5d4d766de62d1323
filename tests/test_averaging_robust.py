"""Averaging against poison and liars, without sockets: CenteredClip in the reducer, bounds on
weights, deltas and bandwidth claims, and bans that outlast a round (sans-IO cores, numbers
for clocks)."""

from __future__ import annotations

import math

import pytest
import torch
from test_averaging_core import exchange, make_cores, make_group
from test_averaging_matchmaking_core import Swarm, config, pid

from swarmtrain.averaging.allreduce import AllReduceConfig
from swarmtrain.averaging.allreduce_core import (
    DEFAULT_MAX_PEER_WEIGHT,
    AllReduceCore,
    Failure,
    Reject,
)
from swarmtrain.averaging.averager_config import AveragerConfig
from swarmtrain.averaging.ban_list import BanList
from swarmtrain.averaging.load_balancing import (
    MAX_SHARE,
    bound_bandwidths,
    bounded_load_balance,
    load_balance_peers,
)
from swarmtrain.averaging.matchmaking_core import GroupAssembled, MatchmakingFailed
from swarmtrain.averaging.part_reducer import TensorPartReducer
from swarmtrain.averaging.robust_aggregation import centered_clip, weighted_median

# ------------------------------------------------------------------------------ CenteredClip


def test_weighted_median_respects_weights():
    values = torch.tensor([[0.0, 5.0], [1.0, 6.0], [10.0, -1.0]])
    assert weighted_median(values, torch.ones(3)).tolist() == [1.0, 5.0]
    assert weighted_median(values, torch.tensor([1.0, 1.0, 5.0])).tolist() == [10.0, -1.0]
    assert weighted_median(values, torch.tensor([1.0, 0.0, 0.0])).tolist() == [0.0, 5.0]


def test_centered_clip_is_the_mean_when_nothing_is_clipped_and_bounded_otherwise():
    generator = torch.Generator().manual_seed(0)
    honest = torch.randn(4, 32, generator=generator)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mean = (weights @ honest) / weights.sum()
    # a radius larger than every distance: plain weighted mean after enough iterations
    torch.testing.assert_close(centered_clip(honest, weights, tau=1e6, iterations=1), mean)
    spread = float(torch.linalg.vector_norm(honest - mean, dim=1).max())
    for attacker in (honest[0] * 1000, torch.full((32,), 3e38), -torch.randn(32) * 1e30):
        values = torch.cat([honest, attacker[None]])
        clipped = centered_clip(values, torch.cat([weights, torch.ones(1)]))
        assert clipped.isfinite().all()
        assert float(torch.linalg.vector_norm(clipped - mean)) < spread
    # a zero-weight row counts for nothing, however far
    values = torch.cat([honest, torch.full((1, 32), 1e30)])
    got = centered_clip(values, torch.cat([weights, torch.zeros(1)]), tau=1e6, iterations=1)
    torch.testing.assert_close(got, mean)


def test_reducer_keeps_contributions_only_in_centered_clip_mode():
    mean = TensorPartReducer([4, 4], [torch.float32] * 2, 3)
    clip = TensorPartReducer([4, 4], [torch.float32] * 2, 3, aggregation="centered_clip")
    rows = [torch.full((4,), float(v)) for v in (1.0, 2.0, 1000.0)]
    for s, row in enumerate(rows):
        mean.accumulate(s, 0, row, 1.0)
        buffer = row.clone()
        clip.accumulate(s, 0, buffer, 1.0)
        buffer.fill_(float("nan"))  # the caller reuses its buffer: the reducer kept a copy
    assert mean.result(0).tolist() == [pytest.approx(1003 / 3)] * 4
    assert all(abs(v - 1.5) <= 1.0 for v in clip.result(0).tolist())
    assert clip._kept[0] == {} and clip._sums == [None, None]
    with pytest.raises(ValueError, match="aggregation"):
        TensorPartReducer([4], [torch.float32], 1, aggregation="median")
    with pytest.raises(ValueError, match="clip_tau"):
        TensorPartReducer([4], [torch.float32], 1, aggregation="centered_clip", clip_tau=-1)


# ---------------------------------------------------------------- SGD with 1 liar out of 5


def _least_squares(num_peers: int, dim: int = 24, rows: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    truth = torch.randn(dim, generator=generator)
    shards = []
    for _ in range(num_peers):
        a = torch.randn(rows, dim, generator=generator)
        b = a @ truth + 0.1 * torch.randn(rows, generator=generator)
        shards.append((a, b))
    return shards


def _loss(w, shards) -> float:
    return sum(float(((a @ w - b) ** 2).mean()) for a, b in shards) / len(shards)


def _train(attack: str | None, aggregation: str, steps: int = 40, lr: float = 0.1) -> float:
    """Data-parallel SGD of 5 peers through real AllReduceCores; peer 4 lies if ``attack``.
    The delta check is off (``max_delta_ratio=None``): this compares aggregations alone."""
    shards = _least_squares(5)
    honest = shards[:4]
    generator = torch.Generator().manual_seed(1)
    w = torch.zeros(shards[0][0].shape[1])
    group = make_group([1.0] * 5)
    for _ in range(steps):
        grads = [[a.T @ (a @ w - b) * (2 / a.shape[0])] for a, b in shards]
        if attack == "scaled":
            grads[4] = [grads[4][0] * 1000]
        elif attack == "garbage":
            grads[4] = [torch.randn(w.shape, generator=generator) * 1e4]
        cores = make_cores(
            group, grads, aggregation=aggregation, part_size_bytes=32, max_delta_ratio=None
        )
        exchange(cores)
        assert all(core.finished and not core.banned_senders for core in cores)
        averaged = [g[0] + core.deltas()[0] for g, core in zip(grads, cores, strict=True)]
        scale = float(averaged[0].abs().max())  # own + (average - own): float32 rounding
        for other in averaged[1:4]:  # every honest peer holds the same result
            torch.testing.assert_close(other, averaged[0], rtol=1e-5, atol=1e-6 * scale)
        w = w - lr * averaged[0]
        if not math.isfinite(_loss(w, honest)):
            break
    return _loss(w, honest)


@pytest.mark.parametrize("attack", ["scaled", "garbage"])
def test_sgd_converges_with_centered_clip_despite_one_liar_in_five(attack):
    start = _loss(torch.zeros(24), _least_squares(5)[:4])
    clean = _train(None, "mean")
    assert clean < start / 50  # the problem is learnable in these steps
    clipped = _train(attack, "centered_clip")
    assert clipped < 1.1 * clean, (clipped, clean)  # as good as without the liar
    poisoned = _train(attack, "mean")
    assert not poisoned < start, (poisoned, start)  # the plain mean diverges (or goes nowhere)


def test_centered_clip_without_liars_trains_like_the_mean():
    clean, clipped = _train(None, "mean"), _train(None, "centered_clip")
    assert clipped < 1.1 * clean, (clipped, clean)


# ------------------------------------------------------------------------ boundary checks


def test_weights_above_max_peer_weight_ban_the_sender():
    group = make_group([1.0, 1.0, 1.0])
    tensors = [[torch.randn(40)] for _ in range(3)]
    core = make_cores(group, tensors, max_peer_weight=100.0)[0]
    assert core.open_sender(1, b"gid", 100.0, now=0.0) is None
    assert core.open_sender(2, b"gid", 1e30, now=0.0) == Reject.BAD_PART
    assert core.banned_senders == {"peer2": Failure.IMPLAUSIBLE}
    with pytest.raises(ValueError, match="max_peer_weight"):
        AllReduceCore(group, 0, tensors[0], weight=101.0, max_peer_weight=100.0)
    # the default bound: a 1e30 claim no longer replaces everyone's values
    default = make_cores(group, tensors)[0]
    assert default.open_sender(1, b"gid", DEFAULT_MAX_PEER_WEIGHT * 10, 0.0) == Reject.BAD_PART


def test_a_liar_refused_last_completes_the_parts_it_was_awaited_for():
    """The liar's stream is the last to open: refusing it completes every part, and the
    shell learns so (``take_completed``), or the honest senders would wait forever."""
    group = make_group([1.0, 1.0, 1.0])
    tensors = [[torch.randn(40)] for _ in range(3)]
    core = make_cores(group, tensors, max_peer_weight=100.0)[0]
    core.take_completed()
    assert core.open_sender(1, b"gid", 1.0, now=0.0) is None
    outcome = core.receive_part(1, 0, core.container.input_part(0, 0).clone(), now=0.0)
    assert outcome.reject is None and outcome.completed == ()
    assert core.take_completed() == ()
    assert core.open_sender(2, b"gid", 1e30, now=0.0) == Reject.BAD_PART
    assert core.take_completed() == (0,)
    assert core.is_part_ready(0) and core.take_completed() == ()


def test_absurd_delta_fails_the_reducer_and_keeps_local_values():
    group = make_group([1.0, 1.0])
    ours = torch.randn(64)
    core = make_cores(group, [[ours], [torch.randn(64)]], part_size_bytes=1024)[0]
    numel = core.container.part_spec(1, 0).numel
    own_norm = float(torch.linalg.vector_norm(core.container.input_part(1, 0)))
    scale = 1e3 * own_norm / math.sqrt(numel)  # a delta of exactly 1e3 x our part's norm
    assert core.receive_delta(1, 0, torch.full((numel,), scale * 0.99), unchanged=False, now=1)
    core = make_cores(group, [[ours], [torch.randn(64)]], part_size_bytes=1024)[0]
    assert not core.receive_delta(1, 0, torch.full((numel,), scale * 1.01), unchanged=False, now=1)
    assert core.failed_reducers == {"peer1": Failure.IMPLAUSIBLE}
    assert not core.deltas()[0].any()  # local values kept
    # our part all zero: nothing to compare with, any finite delta is taken
    zeros = make_cores(group, [[torch.zeros(64)], [torch.randn(64)]], part_size_bytes=1024)[0]
    assert zeros.receive_delta(1, 0, torch.full((numel,), 1e20), unchanged=False, now=1)
    # the check is off with max_delta_ratio=None
    off = make_cores(group, [[ours], [ours]], part_size_bytes=1024, max_delta_ratio=None)[0]
    assert off.receive_delta(1, 0, torch.full((numel,), 1e30), unchanged=False, now=1)


def test_huge_finite_delta_with_overflowing_squares_is_implausible_not_non_finite():
    group = make_group([1.0, 1.0])
    core = make_cores(group, [[torch.randn(64)], [torch.randn(64)]], part_size_bytes=1024)[0]
    numel = core.container.part_spec(1, 0).numel
    assert not core.receive_delta(1, 0, torch.full((numel,), 3e38), unchanged=False, now=1)
    assert core.failed_reducers == {"peer1": Failure.IMPLAUSIBLE}


@pytest.mark.parametrize(
    "bandwidths",
    [[100, 100, 1e12], [100, 100, 100, 1e12], [100] * 4 + [1e12], [100, 1e12], [None, 5, 1e12]],
)
def test_a_huge_bandwidth_claim_never_makes_a_sole_reducer(bandwidths):
    assert max(load_balance_peers(1000, bandwidths)) > MAX_SHARE * 1000 + 1  # unbounded
    counts = bounded_load_balance(1000, bandwidths)
    assert sum(counts) == 1000
    assert max(counts) <= MAX_SHARE * 1000 + 1
    assert sum(c > 0 for c in counts) >= 2  # a peer too slow to help may reduce nothing


def test_bounded_load_balance_leaves_sane_claims_alone():
    for bandwidths in ([None] * 4, [100, 200, 300, 300], [0, 100, 100], [1, 2, 2]):
        assert bounded_load_balance(1000, bandwidths) == load_balance_peers(1000, bandwidths)
    assert bound_bandwidths([None, 0, 10, 20, 1e9]) == [None, 0, 10, 20, 80]
    # a peer that would reduce most of the vector hands the excess to the others
    assert load_balance_peers(1000, [1, 2, 3]) == (0, 200, 800)
    assert bounded_load_balance(1000, [1, 2, 3]) == (0, 500, 500)


def test_options_are_validated_with_their_names():
    with pytest.raises(ValueError, match="aggregation"):
        AveragerConfig(prefix="p", aggregation="trimmed")
    with pytest.raises(ValueError, match="clip_iterations"):
        AllReduceConfig(aggregation="centered_clip", clip_iterations=0)
    with pytest.raises(ValueError, match="max_peer_weight"):
        AveragerConfig(prefix="p", max_peer_weight=0)
    with pytest.raises(ValueError, match="ban_duration"):
        AveragerConfig(prefix="p", ban_duration=-1)
    config = AveragerConfig(prefix="p", aggregation="centered_clip", clip_tau=2.0)
    assert config.allreduce_config().aggregation == "centered_clip"
    assert config.allreduce_config().clip_tau == 2.0


# ---------------------------------------------------------------------------------- bans


def test_ban_list_doubles_per_offence_and_decays():
    bans = BanList(10.0, max_duration=40.0, half_life=100.0)
    assert bans.ban("x", now=0.0) == 10.0
    assert bans.is_banned("x", 9.9) and not bans.is_banned("x", 10.0)
    assert bans.ban("x", now=10.0) == pytest.approx(10.0 + 10 * 2 ** (0.5**0.1))
    assert bans.ban("x", now=31.0) < 31.0 + 40.0 + 1e-9
    for _ in range(10):
        assert bans.ban("x", now=31.0) == 31.0 + 40.0  # capped at max_duration
    # a long quiet time forgives: the offence count halves every half_life
    later = 31.0 + 2000.0
    assert bans.offences("x", later) < 0.01
    assert bans.ban("x", later) == pytest.approx(later + 10.0, rel=1e-3)
    assert bans.banned(later) == {"x"} and bans.banned(later + 11) == frozenset()
    assert BanList(0.0).ban("x", 5.0) == 5.0 and not BanList(0.0).is_banned("x", 5.0)


def test_ban_list_is_bounded():
    bans = BanList(10.0, max_peers=3)
    for i in range(10):
        bans.ban(i, now=float(i))
    assert len(bans) == 3 and bans.banned(9.5) == {7, 8, 9}


def test_followers_do_not_join_a_banned_leader():
    swarm = Swarm(config(target_group_size=4, min_group_size=2))
    swarm.add(pid(0))  # would lead: the lowest id
    for i in (1, 2, 3):
        swarm.add(pid(i), banned={pid(0)})
    results = swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(1), pid(2), pid(3)}
    assert isinstance(results[pid(0)], MatchmakingFailed)


def test_a_leader_refuses_banned_joiners():
    swarm = Swarm(config(target_group_size=4, min_group_size=2))
    swarm.add(pid(0), banned={pid(3)})
    for i in (1, 2, 3):
        swarm.add(pid(i))
    results = swarm.run()
    leader = results[pid(0)]
    assert isinstance(leader, GroupAssembled)
    assert set(leader.group.peer_ids) == {pid(0), pid(1), pid(2)}
    assert pid(3) not in leader.group.peer_ids
