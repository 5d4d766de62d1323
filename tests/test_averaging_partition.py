"""Partitioning, reassembly and weighted reduction of tensor parts (pure, no network)."""

import math

import pytest
import torch

from swarmtrain.averaging import partition
from swarmtrain.averaging.part_reducer import TensorPartReducer
from swarmtrain.averaging.partition import (
    PART_LAYOUTS,
    TensorPartContainer,
    apportion,
    difference,
    partition_tensors,
)


@pytest.mark.parametrize(
    "total, fractions",
    [
        (10, [1, 1, 1]),
        (7, [0.5, 0, 0.5]),
        (1000, [0.1, 0.2, 0.3, 0.4]),
        (0, [1, 2]),
        (3, [1, 1, 1, 1, 1]),
        (123457, [1e-9, 1, 3.3]),
    ],
)
def test_apportion_sums_and_is_proportional(total, fractions):
    sizes = apportion(total, fractions)
    assert sum(sizes) == total
    norm = sum(fractions)
    for size, f in zip(sizes, fractions, strict=True):
        assert abs(size - total * f / norm) < 1.0
        if f == 0:
            assert size == 0


def test_apportion_rejects_bad_fractions():
    for bad in ([0, 0], [-1, 2], [math.nan], [math.inf, 1], []):
        with pytest.raises(ValueError):
            apportion(10, bad)


def test_partition_covers_every_value_once_without_crossing_tensors():
    numels, sizes = [1000, 1, 0, 4097, 333], [4, 2, 4, 8, 4]
    layout = partition_tensors(numels, sizes, [0.3, 0.0, 0.2, 0.5], part_size_bytes=1024)
    assert len(layout) == 4 and layout[1] == ()
    covered = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for parts in layout:
        for part in parts:
            assert 0 < part.numel <= max(1, 1024 // sizes[part.tensor_index])
            covered[part.tensor_index][part.start : part.stop] += 1
    assert all(bool((c == 1).all()) for c in covered)
    slice_sizes = [sum(p.numel for p in parts) for parts in layout]
    assert slice_sizes == list(apportion(sum(numels), [0.3, 0.0, 0.2, 0.5]))


def test_parts_of_large_slices_grow_up_to_the_cap():
    mib = 1 << 20
    # 4 peers x 64 MiB of float32: 16 MiB slices -> 8 parts of 2 MiB each
    layout = partition_tensors([16 * mib], [4], [1, 1, 1, 1], mib // 2, 2 * mib)
    for parts in layout:
        assert len(parts) == 8 and all(p.numel * 4 == 2 * mib for p in parts)
    # 8 peers x 16 MiB: 2 MiB slices -> parts stay at part_size_bytes (4 of 512 KiB)
    layout = partition_tensors([4 * mib], [4], [1] * 8, mib // 2, 2 * mib)
    assert all(len(parts) == 4 for parts in layout)
    # in between: about PARTS_PER_SLICE parts; no growth without a cap or with a small cap
    layout = partition_tensors([6 * mib], [4], [1, 1], mib // 2, 2 * mib)
    assert all(len(parts) == 8 for parts in layout)
    assert partition_tensors([16 * mib], [4], [1] * 4, mib // 2) == partition_tensors(
        [16 * mib], [4], [1] * 4, mib // 2, mib // 4
    )


def test_part_layout_1_cuts_slices_of_up_to_2_mib_into_one_part():
    mib = 1 << 20
    one = PART_LAYOUTS[1]
    # 8 peers x 16 MiB: one part of 2 MiB per slice (layout 0: 4 of 512 KiB, above)
    layout = partition_tensors([4 * mib], [4], [1] * 8, mib // 2, 2 * mib, one)
    assert all(len(parts) == 1 and parts[0].numel * 4 == 2 * mib for parts in layout)
    # larger slices: parts of 2 MiB, as in layout 0
    layout = partition_tensors([16 * mib], [4], [1, 1, 1, 1], mib // 2, 2 * mib, one)
    assert all(len(parts) == 8 for parts in layout)
    # small slices and parts: one part each, still never across a tensor boundary
    layout = partition_tensors([100, 7], [4, 4], [1, 1], 64, 2 * mib, one)
    assert [len(parts) for parts in layout] == [1, 2]
    assert partition_tensors([100, 7], [4, 4], [1, 1], 64, 2 * mib) != layout
    with pytest.raises(ValueError):
        partition_tensors([100], [4], [1], 64, 2 * mib, 0)


def test_partition_is_deterministic():
    args = ([5000, 77], [4, 4], [0.123456789, 0.3, 0.576543211], 512)
    assert partition_tensors(*args) == partition_tensors(*args)


def test_container_splits_and_reassembles_deltas():
    tensors = [torch.randn(30, 40), torch.randn(17, dtype=torch.float64), torch.randn(5, 5, 5)]
    container = TensorPartContainer(tensors, [1, 2, 0, 1], part_size_bytes=256)
    assert container.num_parts_by_peer[2] == 0
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    joined = torch.cat([p.double() for peer in range(4) for p in container.input_parts(peer)])
    assert torch.equal(joined, flat)

    target = [torch.randn_like(t) for t in tensors]
    target_container = TensorPartContainer(target, [1, 2, 0, 1], part_size_bytes=256)
    for peer in (0, 1, 3):
        for k, part in enumerate(container.input_parts(peer)):
            container.register_delta(peer, k, target_container.input_part(peer, k) - part)
    assert container.finished
    for t, want, delta in zip(tensors, target, container.deltas(), strict=True):
        assert delta.shape == t.shape and delta.dtype == t.dtype
        torch.testing.assert_close(t + delta, want)


def test_container_failed_reducer_keeps_local_values():
    tensors = [torch.randn(1000)]
    container = TensorPartContainer(tensors, [1, 1], part_size_bytes=400)
    container.register_delta(0, 0, torch.ones(100))
    assert container.register_failed_reducer(1) == container.num_parts_by_peer[1]
    assert not container.finished
    for k in range(1, container.num_parts_by_peer[0]):
        container.register_delta(0, k, None)  # unchanged
    assert container.finished
    delta = container.deltas()[0]
    assert torch.equal(delta[:100], torch.ones(100))
    assert torch.equal(delta[100:], torch.zeros(900))
    with pytest.raises(ValueError):
        container.register_delta(1, 0, torch.ones(100))  # the reducer failed
    with pytest.raises(ValueError):
        container.register_delta(0, 0, torch.ones(100))  # twice


def test_container_reused_delta_buffers_never_leak_old_values():
    tensors = [torch.randn(1000), torch.randn(10, 10, dtype=torch.float64)]
    stale = [torch.full((1000,), float("nan")), torch.full((100,), 7.0, dtype=torch.float64)]
    container = TensorPartContainer(tensors, [1, 1], part_size_bytes=400, delta_buffers=stale)
    assert [b.data_ptr() for b in container.delta_buffers] == [b.data_ptr() for b in stale]
    container.register_delta(0, 0, torch.ones(100))
    container.register_delta(0, 1, None)  # unchanged: zero, not the stale NaN
    container.register_failed_reducer(1)  # its parts keep the local values
    deltas = container.deltas()
    flat = torch.cat([d.reshape(-1).double() for d in deltas])
    assert torch.equal(flat[:100], torch.ones(100, dtype=torch.float64))
    assert not flat.isnan().any()
    for peer, parts in enumerate(container.layout):  # every other part is exactly zero
        for k, spec in enumerate(parts):
            if (peer, k) == (0, 0):
                continue
            assert not deltas[spec.tensor_index].reshape(-1)[spec.start : spec.stop].any()
    with pytest.raises(ValueError, match="does not fit"):
        TensorPartContainer(tensors, [1, 1], delta_buffers=[torch.zeros(999), stale[1]])
    with pytest.raises(ValueError, match="2 tensors"):
        TensorPartContainer(tensors, [1, 1], delta_buffers=stale[:1])


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused"])
def test_container_zeroes_delta_regions_written_in_place_but_never_registered(reuse):
    tensors = [torch.randn(1000)]
    buffers = [torch.full((1000,), 5.0)] if reuse else None
    container = TensorPartContainer(tensors, [1, 1], part_size_bytes=400, delta_buffers=buffers)
    n0 = container.num_parts_by_peer[0]
    region = container.delta_target(0, 0)  # decoded straight into place, then registered
    region.fill_(2.0)
    container.register_delta(0, 0, region)
    assert container.delta_target(0, 0) is None  # registered already
    container.delta_target(0, 1).fill_(3.0)  # a decode that failed midway: never registered
    container.delta_target(1, 0).fill_(4.0)  # its reducer then failed
    container.register_failed_reducer(1)
    assert container.delta_target(1, 1) is None  # a failed reducer gets no more regions
    container.delta_target(0, 2).fill_(6.0)
    container.register_delta(0, 2, None)  # then "unchanged": zero, not the bytes written
    for k in range(3, n0):
        container.register_delta(0, k, torch.ones(container.part_spec(0, k).numel))
    delta = container.deltas()[0]
    assert torch.equal(delta[:100], torch.full((100,), 2.0))
    assert not delta[100:300].any()  # parts 1 and 2 of reducer 0
    assert torch.equal(delta[300:500], torch.ones(200))
    assert not delta[500:].any()  # reducer 1's slice keeps the local values


def test_difference_in_place_and_into_another_dtype():
    average = torch.tensor([1.0, 2.0, 3.0])
    local = torch.tensor([0.5, 0.5, 0.5])
    assert difference(average, local, out=local) is local
    assert torch.equal(local, torch.tensor([0.5, 1.5, 2.5]))
    half = torch.tensor([0.25, 0.5, 1.0], dtype=torch.float16)
    difference(average, half, out=half)  # computed in float32, stored as float16
    assert half.dtype == torch.float16 and torch.equal(half.float(), torch.tensor([0.75, 1.5, 2.0]))
    bf16 = torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16)  # no numpy dtype: torch path
    difference(average, bf16, out=bf16)
    assert torch.equal(bf16.float(), torch.tensor([0.0, 1.0, 2.0]))


def test_container_rejects_wrong_delta_size_and_bad_tensors():
    container = TensorPartContainer([torch.zeros(10)], [1])
    with pytest.raises(ValueError):
        container.register_delta(0, 0, torch.zeros(11))
    with pytest.raises(ValueError):
        container.register_delta(0, 5, torch.zeros(10))
    with pytest.raises(TypeError):
        TensorPartContainer([torch.zeros(3, dtype=torch.int64)], [1])
    with pytest.raises(ValueError):
        TensorPartContainer([], [1])


def test_reducer_weighted_mean_and_completion_order():
    reducer = TensorPartReducer([3, 2], [torch.float32, torch.float16], num_senders=3)
    a, b, c = torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1]), torch.tensor([0.0, 0, 6])
    assert reducer.accumulate(0, 0, a, 1.0) == ()
    assert reducer.accumulate(2, 0, c, 2.0) == ()
    assert reducer.accumulate(1, 1, torch.ones(2, dtype=torch.float16), 1.0) == ()
    assert reducer.accumulate(1, 0, b, 1.0) == (0,)
    torch.testing.assert_close(reducer.result(0), (a + b + 2 * c) / 4)
    assert not reducer.is_complete(1)
    with pytest.raises(ValueError):
        reducer.result(1)


def test_reducer_ban_completes_parts_and_rejects_the_banned():
    reducer = TensorPartReducer([2, 2, 2], [torch.float32] * 3, num_senders=3)
    reducer.accumulate(0, 0, torch.ones(2), 1.0)
    reducer.accumulate(1, 0, torch.zeros(2), 1.0)
    reducer.accumulate(2, 0, torch.full((2,), 5.0), 1.0)  # part 0 includes sender 2
    reducer.accumulate(0, 1, torch.ones(2), 1.0)
    reducer.accumulate(1, 1, torch.full((2,), 3.0), 1.0)
    assert reducer.ban(2) == (1,)
    torch.testing.assert_close(reducer.result(0), torch.full((2,), 2.0))
    torch.testing.assert_close(reducer.result(1), torch.full((2,), 2.0))
    assert reducer.ban(2) == ()
    with pytest.raises(ValueError):
        reducer.accumulate(2, 2, torch.ones(2), 1.0)
    reducer.accumulate(0, 2, torch.ones(2), 1.0)
    assert reducer.ban(1) == (2,)
    assert reducer.finished and reducer.banned == {1, 2}


def test_reducer_zero_total_weight_gives_no_nan():
    reducer = TensorPartReducer([4], [torch.float32], num_senders=2)
    reducer.accumulate(0, 0, torch.randn(4), 0.0)
    assert reducer.accumulate(1, 0, torch.randn(4), 0.0) == (0,)
    assert reducer.result(0) is None  # every sender keeps its own values
    everyone_banned = TensorPartReducer([4], [torch.float32], num_senders=1)
    assert everyone_banned.ban(0) == (0,) and everyone_banned.result(0) is None


def test_reducer_validates_inputs():
    reducer = TensorPartReducer([4], [torch.float32], num_senders=2)
    for args in [
        (2, 0, torch.zeros(4), 1.0),  # no such sender
        (0, 1, torch.zeros(4), 1.0),  # no such part
        (0, 0, torch.zeros(5), 1.0),  # wrong size
        (0, 0, torch.zeros(4), -1.0),  # negative weight
        (0, 0, torch.zeros(4), math.nan),
    ]:
        with pytest.raises(ValueError):
            reducer.accumulate(*args)
    reducer.accumulate(0, 0, torch.zeros(4), 1.0)
    with pytest.raises(ValueError):
        reducer.accumulate(0, 0, torch.zeros(4), 1.0)  # twice


def test_held_back_by_links_needs_a_large_round_and_compares_its_rate():
    big, rate = partition.MIN_MEASURED_PAYLOAD_BYTES, partition.LINK_BOUND_BYTES_PER_SECOND
    assert partition.held_back_by_links(big - 1, 1000.0) is None  # too small to tell
    assert partition.held_back_by_links(big, 0.0) is None
    assert partition.held_back_by_links(big, 2 * big / rate) is True
    assert partition.held_back_by_links(big, big / rate / 2) is False
    assert partition.held_back_by_links(10 * big, 10 * big / rate) is False  # at the threshold
