"""The finiteness guard of all-reduce (one sum per tensor, the exact check only when it fails)."""

import math

import pytest
import torch

from swarmtrain.averaging.finite import all_finite, first_non_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_any_nan_or_inf_is_found(dtype, bad):
    tensor = torch.ones(1000, dtype=dtype)
    assert all_finite(tensor)
    tensor[517] = bad
    assert not all_finite(tensor)
    assert not all_finite(tensor[1::2])  # a strided view (no numpy view: the torch path)
    assert all_finite(tensor[::2])


def test_sums_that_overflow_are_not_mistaken_for_inf():
    assert all_finite(torch.full((10,), 3e38))  # the fp32 sum is inf: the exact check says no
    assert all_finite(torch.full((100_000,), 60000.0, dtype=torch.float16))
    both = torch.tensor([1.0, math.inf, -math.inf])  # inf - inf sums to NaN: still found
    assert not all_finite(both)


def test_integers_empties_and_the_first_bad_tensor():
    assert all_finite(torch.tensor([1, 2, 3])) and all_finite(torch.empty(0))
    tensors = [torch.zeros(3), torch.tensor([0.0, math.nan]), torch.tensor([math.inf])]
    assert first_non_finite(tensors) == 1
    assert first_non_finite(tensors[:1]) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_many_tensors_are_checked_together_and_the_bad_one_is_still_named(dtype):
    torch.manual_seed(0)
    grads = [torch.randn(n, dtype=dtype) for n in (7, 300, 1, 64, 5000)]
    mixed = [*grads, torch.arange(5), torch.empty(0)]  # integers and empties are finite
    assert first_non_finite(mixed) is None
    for index in range(len(grads)):
        for bad in (math.nan, math.inf, -math.inf):
            broken = [g.clone() for g in mixed]
            broken[index].view(-1)[-1] = bad
            assert first_non_finite(broken) == index
    # norms that overflow their dtype fall back to the exact check: still finite
    huge = [torch.full((100,), 6e4 if dtype == torch.float16 else 3e38, dtype=dtype)] * 3
    assert first_non_finite(huge) is None


def test_complex_tensors_take_the_per_tensor_path_and_large_sets_are_checked_together():
    import swarmtrain.averaging.finite as finite

    assert finite._all_finite_together([torch.ones(3, dtype=torch.complex64)]) is False
    big = [torch.ones(1 << 21), torch.ones(1)]
    assert finite._all_finite_together(big) is True
    assert first_non_finite(big) is None
    big[1][0] = math.nan
    assert finite._all_finite_together(big) is False
    assert first_non_finite(big) == 1


def test_a_norm_that_overflows_falls_back_to_the_exact_check():
    import swarmtrain.averaging.finite as finite

    # each tensor is finite, but the sum of squares overflows fp32: the fused check cannot
    # prove it, the per-tensor check does
    huge = [torch.full((4,), 3e38), torch.full((4,), -3e38)]
    assert finite._all_finite_together(huge) is False
    assert first_non_finite(huge) is None
    huge[1][2] = math.inf
    assert first_non_finite(huge) == 1
