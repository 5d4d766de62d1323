"""Load balancing is exact: compared with brute force over a grid of the simplex."""

import itertools
import random

import numpy as np
import pytest

from swarmtrain.averaging.load_balancing import (
    MAX_SHARE,
    NoReducerError,
    bounded_load_balance,
    butterfly_cost,
    load_balance_peers,
    optimize_fractions,
)


def brute_force(bandwidths, senders, steps=40):
    n = len(bandwidths)
    best = float("inf")
    for combo in itertools.product(range(steps + 1), repeat=n - 1):
        if sum(combo) > steps:
            continue
        fractions = [c / steps for c in combo] + [(steps - sum(combo)) / steps]
        if any(
            f > 0 and not (b is None or b > 0) for f, b in zip(fractions, bandwidths, strict=True)
        ):
            continue  # clients reduce nothing
        best = min(best, butterfly_cost(fractions, bandwidths, senders))
    return best


CASES = [
    ([1.0, 1.0, 1.0, 1.0], None),
    ([1.0, 2.0, 3.0, 4.0], None),
    ([10.0, 1.0, 1.0], None),
    ([100.0, 1.0, 0.0, 1.0], None),
    ([1.0, 1.0, 5.0], [True, True, False]),
    ([1.0, 3.0, 2.0, 2.0], [True, False, True, True]),
    ([0.0, 2.0, 1.0], [True, False, False]),
    ([1.0, 2.0], None),
    ([1.0, 2.0, 7.0], [True, True, False]),
    ([None, 2.0, 0.0, None], None),
    ([5.0], None),
]


@pytest.mark.parametrize("bandwidths, senders", CASES)
def test_optimal_against_brute_force(bandwidths, senders):
    fractions = optimize_fractions(bandwidths, senders)
    assert abs(sum(fractions) - 1) < 1e-12 and min(fractions) >= 0
    for f, b in zip(fractions, bandwidths, strict=True):
        if b == 0:
            assert f == 0
    cost = butterfly_cost(fractions, bandwidths, senders)
    assert cost <= brute_force(bandwidths, senders) + 1e-12


def test_random_cases_beat_brute_force_and_random_points():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 4)
        bandwidths = [rng.choice([0.0, rng.uniform(0.1, 10)]) for _ in range(n)]
        if not any(bandwidths):
            bandwidths[0] = 1.0
        senders = [rng.random() < 0.8 for _ in range(n)]
        cost = butterfly_cost(optimize_fractions(bandwidths, senders), bandwidths, senders)
        assert cost <= brute_force(bandwidths, senders, steps=20) + 1e-12
        for _ in range(20):  # no feasible point is better
            raw = [rng.random() if b > 0 else 0.0 for b in bandwidths]
            point = [x / sum(raw) for x in raw]
            assert cost <= butterfly_cost(point, bandwidths, senders) + 1e-12


def test_equal_bandwidths_split_equally():
    assert optimize_fractions([3.0] * 4) == pytest.approx([0.25] * 4)
    assert load_balance_peers(100, [None, None, None, None]) == (25, 25, 25, 25)


def test_load_balance_peers_integers_clients_and_min_size():
    sizes = load_balance_peers(1000, [1.0, 0.0, 2.0, None])
    assert sum(sizes) == 1000 and sizes[1] == 0
    tiny = load_balance_peers(1000, [1000.0, 1000.0, 0.001], min_size=100)
    assert tiny[2] == 0 and sum(tiny) == 1000


def test_bad_bandwidths():
    for bad in ([], [0.0, 0.0], [-1.0, 1.0], [float("nan")]):
        with pytest.raises(ValueError):
            optimize_fractions(bad)
    with pytest.raises(ValueError):
        optimize_fractions([1.0, 1.0], [True])


def test_all_zero_bandwidths_raise_a_value_error_that_hivemind_code_also_catches():
    for catch in (NoReducerError, ValueError, AssertionError):  # hivemind asserts here
        with pytest.raises(catch, match="positive"):
            load_balance_peers(100, (0, 0, 0))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_bandwidths_as_numpy_arrays_match_lists(dtype):
    values = [1.0, 0.0, 2.0, 4.0]
    array = np.array(values, dtype=dtype)
    assert load_balance_peers(1000, array) == load_balance_peers(1000, values)
    assert optimize_fractions(array, np.array([True, True, False, True])) == optimize_fractions(
        values, [True, True, False, True]
    )
    assert load_balance_peers(np.int64(10), array[:1]) == (10,)
    assert load_balance_peers(10, (b for b in values)) == load_balance_peers(10, values)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (np.array([]), ValueError, "at least one peer"),
        (np.array([1.0, np.nan]), ValueError, "finite and non-negative"),
        (np.array([1.0, np.inf]), ValueError, "finite and non-negative"),
        (np.array([1.0, -2.0]), ValueError, "finite and non-negative"),
        (np.zeros(3), ValueError, "positive"),
        (np.ones((2, 2)), TypeError, "numbers or None"),
        ([1.0, "2"], TypeError, "numbers or None"),
        ([True, 1.0], TypeError, "numbers or None"),
        ("12", TypeError, "sequence of numbers"),
        (3.0, TypeError, "sequence of numbers"),
    ],
)
def test_bad_bandwidths_say_what_is_wrong(bad, error, match):
    with pytest.raises(error, match=match):
        load_balance_peers(100, bad)


def peer_times(fractions, bandwidths, senders=None):
    """Each reducing-capable peer's time in the round (the terms of butterfly_cost's max)."""
    senders = [True] * len(bandwidths) if senders is None else senders
    num_senders = sum(senders)
    return [
        2.0 * (int(s) + (num_senders - 2 * int(s)) * w) / b
        for w, b, s in zip(fractions, bandwidths, senders, strict=True)
        if b > 0
    ]


# A slow sender's own traffic is the round's time: many assignments are optimal.
NON_UNIQUE = [
    ([0.32, 0.55, 0.44], None),
    ([1.0, 2.0, 3.0], None),
    ([100.0, 200.0, 300.0, 400.0], None),
    ([1.0, 4.0, 4.0, 6.0, 2.0], None),
    ([0.5, 3.0, 2.0, 1.0], [True, True, False, True]),
]


@pytest.mark.parametrize("bandwidths, senders", NON_UNIQUE)
def test_where_the_optimum_is_not_unique_the_most_balanced_one_is_picked(bandwidths, senders):
    fractions = optimize_fractions(bandwidths, senders)
    times = peer_times(fractions, bandwidths, senders)
    senders_ = [True] * len(bandwidths) if senders is None else senders
    own = [2.0 * int(s) / b for b, s in zip(bandwidths, senders_, strict=True)]  # w = 0
    level = max(t for t, w in zip(times, fractions, strict=True) if w > 0)
    assert max(times) > level  # the optimum is held up by a peer that reduces nothing
    for w, t, t_own in zip(fractions, times, own, strict=True):
        if w > 0:  # everyone who reduces finishes together ...
            assert t == pytest.approx(level, rel=1e-12)
        else:  # ... and a peer left out could not have finished by then anyway
            assert t_own >= level * (1 - 1e-12)
    # every other optimal point is less balanced: its times, sorted from the latest, compare
    # lexicographically greater (checked on random points of the optimal face: far ones, and
    # ours moved a little)
    rng = random.Random(1)
    ours = sorted(times, reverse=True)
    cost = max(times)
    can_help = [t_own < cost for t_own in own]  # the others must reduce nothing
    found = 0
    for attempt in range(4000):
        if attempt % 2:
            raw = [rng.random() ** 3 if ok else 0.0 for ok in can_help]
        else:
            raw = [
                max(0.0, w + rng.uniform(-0.02, 0.02)) if ok else 0.0
                for w, ok in zip(fractions, can_help, strict=True)
            ]
        point = [x / sum(raw) for x in raw]
        other = peer_times(point, bandwidths, senders)
        if max(other) > cost * (1 + 1e-12):
            continue
        found += 1
        assert ours <= [t + 1e-12 for t in sorted(other, reverse=True)]
    assert found > 100


def test_hivemind_example_with_a_non_unique_optimum_gives_hivemind_integers():
    # hivemind's interior-point solver lands in the middle of the optimal face; an arbitrary
    # point of the same face gave (0, 39, 21)
    assert load_balance_peers(60, [0.32, 0.55, 0.44], min_size=10) == (0, 40, 20)
    assert optimize_fractions([0.32, 0.55, 0.44]) == pytest.approx([0, 2 / 3, 1 / 3])
    assert load_balance_peers(1000, [1, 2, 3]) == (0, 200, 800)


def test_fractions_follow_the_peers_when_they_are_reordered():
    rng = random.Random(2)
    for _ in range(50):
        n = rng.randint(2, 7)
        bandwidths = [rng.choice([0.0, rng.uniform(0.1, 10)]) for _ in range(n)] + [1.0]
        senders = [rng.random() < 0.8 for _ in bandwidths]
        fractions = optimize_fractions(bandwidths, senders)
        order = list(range(len(bandwidths)))
        rng.shuffle(order)
        shuffled = optimize_fractions([bandwidths[i] for i in order], [senders[i] for i in order])
        assert shuffled == pytest.approx([fractions[i] for i in order], abs=1e-12)


def capped_brute_force(bandwidths, max_share, steps=40):
    best = float("inf")
    n = len(bandwidths)
    for combo in itertools.product(range(steps + 1), repeat=n - 1):
        if sum(combo) > steps:
            continue
        fractions = [c / steps for c in combo] + [(steps - sum(combo)) / steps]
        if max(fractions) > max_share + 1e-12:
            continue
        best = min(best, butterfly_cost(fractions, bandwidths))
    return best


@pytest.mark.parametrize(
    "bandwidths",
    [[1.0, 2.0, 3.0], [100.0, 200.0, 300.0, 400.0], [100.0, 100.0, 400.0], [12.5, 5.0, 20.0]],
)
def test_bounded_load_balance_is_the_fastest_round_under_its_cap(bandwidths):
    counts = bounded_load_balance(1000, bandwidths)
    assert max(counts) <= 500 and sum(counts) == 1000
    cost = butterfly_cost([x / 1000 for x in counts], bandwidths)
    assert cost <= capped_brute_force(bandwidths, MAX_SHARE) * (1 + 2e-3)  # integer rounding
    # where the unbounded optimum is not unique, the cap costs nothing
    if bandwidths in ([1.0, 2.0, 3.0], [100.0, 200.0, 300.0, 400.0]):
        unbounded = butterfly_cost(optimize_fractions(bandwidths), bandwidths)
        assert cost == pytest.approx(unbounded, rel=1e-12)
