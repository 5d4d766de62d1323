"""Property tests of the pure all-reduce layout: apportion, load balancing over any claims
peers can make (finite, non-negative: extremes included), and the partition of tensors."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.averaging.load_balancing import (
    MAX_SHARE,
    bounded_load_balance,
    load_balance_peers,
    optimize_fractions,
)
from swarmtrain.averaging.partition import apportion, partition_tensors

# every bandwidth a peer can claim on the wire (a finite non-negative double), or unknown
claims = st.none() | st.just(0.0) | st.floats(0.0, allow_infinity=False, allow_nan=False)
fractions = st.lists(st.floats(0.0, 1e300, allow_nan=False), min_size=1, max_size=12)


@given(st.integers(0, 10**12), fractions)
def test_apportion_splits_exactly(total, shares):
    if not any(f > 0 for f in shares):
        return
    sizes = apportion(total, shares)
    assert sum(sizes) == total and all(size >= 0 for size in sizes)
    assert all(size == 0 for size, f in zip(sizes, shares, strict=True) if f == 0)
    top = max(shares)
    norm = math.fsum(f / top for f in shares)
    for size, f in zip(sizes, shares, strict=True):
        assert abs(size - total * (f / top / norm)) <= 1 + total * 1e-12


@given(
    st.integers(0, 10**9),
    st.lists(st.tuples(claims, st.booleans()), min_size=1, max_size=10),
)
def test_load_balancing_takes_any_claims(vector_size, peers):
    bandwidths = [b for b, _ in peers]
    senders = [s for _, s in peers]
    if not any(b is None or b > 0 for b in bandwidths):
        return  # nobody can reduce: a ValueError, by contract
    shares = optimize_fractions(bandwidths, senders)
    assert all(math.isfinite(f) and f >= 0 for f in shares)
    assert math.isclose(math.fsum(shares), 1.0, rel_tol=1e-9)
    for balance in (load_balance_peers, bounded_load_balance):
        sizes = balance(vector_size, bandwidths, senders=senders)
        assert sum(sizes) == vector_size
        assert all(size == 0 for size, b in zip(sizes, bandwidths, strict=True) if b == 0)
    sizes = bounded_load_balance(vector_size, bandwidths, senders=senders)
    eligible = [b for b in bandwidths if b is None or b > 0]
    if len(eligible) >= 2:  # nobody takes more than half while another peer could reduce
        assert max(sizes) <= MAX_SHARE * vector_size + len(sizes)


def test_extreme_claims_are_balanced_not_raised():
    """Found by this module: a denormal claim made 1 / bandwidth infinite (NaN fractions, a
    ValueError for the whole group), claims near 1e308 overflowed a sum (OverflowError)."""
    assert bounded_load_balance(1000, [1e8, 5e-324, 5e-324]) == (500, 250, 250)
    assert load_balance_peers(1000, [1e8, 5e-324, 5e-324]) == (1000, 0, 0)
    assert bounded_load_balance(999, [1e308] * 3) == (333, 333, 333)
    assert load_balance_peers(1000, [1e308, None]) == (500, 500)


@given(
    st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([2, 4, 8])), min_size=1, max_size=6),
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=6),
    st.integers(1, 4096),
    st.sampled_from([None, 2048, 1 << 16]),
    st.integers(1, 8),
)
def test_parts_cover_every_value_once(tensors, shares, part_bytes, max_part, per_slice):
    if not any(f > 0 for f in shares):
        return
    numels = [n for n, _ in tensors]
    sizes = [s for _, s in tensors]
    layout = partition_tensors(numels, sizes, shares, part_bytes, max_part, per_slice)
    assert len(layout) == len(shares)
    flat = [part for peer in layout for part in peer]
    covered = [(p.tensor_index, i) for p in flat for i in range(p.start, p.stop)]
    assert covered == [(t, i) for t, n in enumerate(numels) for i in range(n)]
    largest = max(part_bytes, max_part or 0)
    for part in flat:
        assert part.numel >= 1
        assert part.numel * sizes[part.tensor_index] <= max(largest, sizes[part.tensor_index])
    assert [sum(p.numel for p in peer) for peer in layout] == list(apportion(sum(numels), shares))


def test_apportion_of_huge_fractions():
    """Found by this module: ``total * f`` overflowed (OverflowError from math.floor)."""
    assert apportion(2_537_824_396, [7.083599392045233e298]) == (2_537_824_396,)
    assert apportion(10, [1e308, 1e308]) == (5, 5)
