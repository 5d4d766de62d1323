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
