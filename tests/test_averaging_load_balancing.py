"""Load balancing is exact: compared with brute force over a grid of the simplex."""

import itertools
import random

import numpy as np
import pytest

from swarmtrain.averaging.load_balancing import (
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
