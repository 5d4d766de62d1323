"""Non-finite and extreme values: the documented behaviour of each codec."""

from __future__ import annotations

import math

import pytest
import torch

from swarmtrain.compression import (
    Blockwise4BitQuantization,
    BlockwiseQuantization,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    TopKSparsification,
    Uniform8BitQuantization,
    bitsandbytes_available,
)

NAN, INF = math.nan, math.inf


def round_trip(codec, tensor):
    return codec.extract(codec.compress(tensor))


@pytest.mark.parametrize("codec", [NoCompression(), Float16Compression()], ids=repr)
def test_lossless_and_float16_keep_nan_and_inf(codec):
    tensor = torch.tensor([NAN, INF, -INF, 1.0, 0.0, -0.0])
    restored = round_trip(codec, tensor)
    assert math.isnan(restored[0]) and restored[1:3].tolist() == [INF, -INF]
    assert restored[3:].tolist() == [1.0, 0.0, -0.0]
    assert math.copysign(1.0, restored[5]) == -1.0


@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Quantile8BitQuantization()], ids=repr)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_whole_tensor_codecs_decode_all_nan_on_non_finite(codec, bad):
    tensor = torch.randn(1000)
    tensor[17] = bad
    assert torch.isnan(round_trip(codec, tensor)).all()


@pytest.mark.parametrize("bad", [NAN, INF])
def test_scaled_float16_poisons_only_the_row(bad):
    tensor = torch.randn(4, 100)
    tensor[2, 5] = bad
    restored = round_trip(ScaledFloat16Compression(), tensor)
    assert torch.isnan(restored[2]).all()
    assert torch.isfinite(restored[[0, 1, 3]]).all()
    assert torch.allclose(restored[[0, 1, 3]], tensor[[0, 1, 3]], atol=1e-2)


BLOCK_CODECS = [BlockwiseQuantization(block_size=64, backend="torch"), Blockwise4BitQuantization()]
if bitsandbytes_available():
    BLOCK_CODECS.append(BlockwiseQuantization(block_size=64, backend="bitsandbytes"))


@pytest.mark.parametrize("codec", BLOCK_CODECS, ids=lambda c: f"{c!r}-{getattr(c, 'backend', '')}")
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_blockwise_poisons_only_the_block(codec, bad):
    tensor = torch.randn(64 * 3 + 5)
    tensor[64 + 7] = bad
    restored = round_trip(codec, tensor)
    assert torch.isnan(restored[64:128]).all()
    assert torch.isfinite(restored[:64]).all() and torch.isfinite(restored[128:]).all()


def test_topk_sends_selected_values_exactly_and_ranks_nan_first():
    tensor = torch.tensor([0.5, NAN, -INF, 2.0, 0.1])
    restored = round_trip(TopKSparsification(ratio=0.6), tensor)
    assert math.isnan(restored[1]) and restored[2] == -INF and restored[3] == 2.0
    assert restored[[0, 4]].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "codec",
    [
        ScaledFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
        BlockwiseQuantization(backend="torch"),
        Blockwise4BitQuantization(),
    ],
    ids=repr,
)
@pytest.mark.parametrize("value", [0.0, 3.25, -1e30, 1e-30])
def test_constant_tensors_decode_exactly_enough(codec, value):
    tensor = torch.full((5000,), value)
    restored = round_trip(codec, tensor)
    assert torch.allclose(restored, tensor, rtol=1e-3, atol=0)


def test_extreme_magnitudes_keep_relative_error():
    tensor = torch.randn(10_000) * 1e30
    for codec in (BlockwiseQuantization(backend="torch"), Uniform8BitQuantization()):
        restored = round_trip(codec, tensor)
        relative = ((restored - tensor).double() ** 2).mean() / (tensor.double() ** 2).mean()
        assert relative < 1e-3
    tiny = torch.randn(10_000) * 1e-30
    restored = round_trip(BlockwiseQuantization(backend="torch"), tiny)
    assert torch.allclose(restored, tiny, atol=1e-31)


def test_outlier_does_not_break_quantile_or_blockwise():
    tensor = torch.randn(100_000)
    tensor[123] = 1e6
    for codec in (Quantile8BitQuantization(), BlockwiseQuantization(backend="torch")):
        restored = round_trip(codec, tensor)
        assert torch.isfinite(restored).all()
    quantile = round_trip(Quantile8BitQuantization(), tensor)
    keep = torch.ones_like(tensor, dtype=torch.bool)
    keep[123] = False
    assert ((quantile - tensor)[keep] ** 2).mean() < 2e-3
    assert quantile[123] == 1e6  # the Lloyd step gives the outlier a bucket of its own


@pytest.mark.parametrize(
    "codec", [BlockwiseQuantization(backend="torch"), Blockwise4BitQuantization()], ids=repr
)
def test_blockwise_blocks_of_tiny_values_decode_as_zeros_without_overflow(codec):
    """Found by tests/test_fuzz_codecs.py: 127 / 1.1755e-38 overflowed float32 (a
    RuntimeWarning, and the block's indices came from inf). Such blocks decode as zeros."""
    tiny = torch.tensor([1.1755e-38, -5e-39, 3e-39] + [0.0] * 61)
    normal = torch.linspace(-1, 1, 64)
    decoded = round_trip(codec, torch.cat([tiny, normal]))
    assert torch.equal(decoded[:64], torch.zeros(64))
    assert torch.allclose(decoded[64:], normal, atol=0.08)


@pytest.mark.parametrize("codec", [NoCompression(), TopKSparsification(ratio=1.0)], ids=repr)
def test_bool_payload_bytes_other_than_0_and_1_are_malformed(codec):
    """Found by tests/test_fuzz_codecs.py: a bool payload byte of 2 became a torch.bool tensor
    holding 2 (``t == True`` was False)."""
    from swarmtrain.compression import WireFormatError

    flags = torch.tensor([True, False, True])
    message = codec.compress(flags)
    assert torch.equal(codec.extract(message), flags)
    message.buffer[-1] = 2  # the last value's byte
    with pytest.raises(WireFormatError, match="0 and 1"):
        codec.extract(message)
