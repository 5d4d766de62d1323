"""Cache-blocked codec passes: results across chunk boundaries, rows longer than a chunk,
non-finite values in later chunks, and non-float32 inputs on the chunked paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swarmtrain.compression import (
    Float16Compression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)
from swarmtrain.compression._chunks import CHUNK, HALF_PIECE, blocks, spans
from swarmtrain.compression.quantization import SAMPLE_SIZE, _sample_positions
from swarmtrain.compression.wire import TensorMessage

SIZES = [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def round_trip(codec, tensor):
    return codec.extract(codec.compress(tensor))


def test_spans_and_blocks_cover_every_value_once():
    assert spans(0) == [] and spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    for rows, last in [(1, 3 * CHUNK + 1), (3, CHUNK), (1000, 100), (7, CHUNK - 1), (4, 0)]:
        seen = np.zeros((rows, last), dtype=np.int64)
        for r0, r1, c0, c1 in blocks(rows, last):
            assert (r1 - r0) * (c1 - c0) <= CHUNK and (r1 - r0 == 1 or (c0, c1) == (0, last))
            seen[r0:r1, c0:c1] += 1
        assert (seen == 1).all()


@pytest.mark.parametrize("numel", SIZES)
def test_float16_is_the_plain_cast_at_chunk_boundaries(numel):
    tensor = randn(numel)
    tensor[numel // 2] = 1e6  # saturates, in a later chunk for the larger sizes
    tensor[-1] = -math.inf
    tensor[HALF_PIECE + 1] = math.nan
    restored = round_trip(Float16Compression(), tensor)
    expected = tensor.half().float()
    expected[numel // 2] = 65504.0
    assert torch.allclose(restored, expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape", [(3 * CHUNK + 5,), (2, CHUNK + 7), (CHUNK // 100 + 3, 100), (5, CHUNK - 1)], ids=str
)
def test_scaled_float16_row_statistics_match_float64(shape):
    tensor = randn(*shape, seed=1) * 3 + 10
    codec = ScaledFloat16Compression()
    message = codec.compress(tensor)
    numel = tensor.numel()
    rows = numel // shape[-1]
    means = np.frombuffer(message.buffer, "<f4", rows, 2 * numel)
    stds = np.frombuffer(message.buffer, "<f4", rows, 2 * numel + 4 * rows)
    reference = tensor.double().reshape(rows, -1).numpy()
    np.testing.assert_allclose(means, reference.mean(1), rtol=1e-6)
    np.testing.assert_allclose(stds, reference.std(1), rtol=1e-5)
    half = np.frombuffer(message.buffer, "<f2", numel).reshape(rows, -1)
    scaled = (reference - means[:, None]) / stds[:, None]
    assert np.abs(half - scaled).max() < 2e-3 * np.abs(scaled).max()
    restored = codec.extract(message)
    assert float(((restored - tensor).double() ** 2).mean()) < 5e-8 * 9


def test_scaled_float16_poisons_a_long_row_from_any_block():
    tensor = randn(3, 2 * CHUNK + 3)
    tensor[1, CHUNK + 10] = math.inf
    restored = round_trip(ScaledFloat16Compression(), tensor)
    assert torch.isnan(restored[1]).all()
    assert torch.isfinite(restored[[0, 2]]).all()


def test_scaled_float16_large_constant_rows_do_not_overflow():
    tensor = torch.full((2, CHUNK + 1), -3e30)
    tensor[1] = 1e-30
    restored = round_trip(ScaledFloat16Compression(), tensor)
    assert torch.allclose(restored, tensor, rtol=1e-3, atol=0)


@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Quantile8BitQuantization()], ids=repr)
@pytest.mark.parametrize("numel", [*SIZES, SAMPLE_SIZE + CHUNK + 3])
def test_codebook_codecs_are_monotonic_across_chunks(codec, numel):
    tensor = randn(numel, seed=numel)
    message = codec.compress(tensor)
    indices = torch.from_numpy(message.buffer[8 + 4 * 256 :].copy()).long()
    order = torch.argsort(tensor)
    assert (indices[order].diff() >= 0).all()  # one function of the value for every chunk
    assert float(((codec.extract(message) - tensor) ** 2).mean()) < 8e-4


@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Quantile8BitQuantization()], ids=repr)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_codebook_codecs_find_non_finite_values_outside_the_sample(codec, bad):
    numel = 4 * SAMPLE_SIZE
    tensor = randn(numel)
    sampled = np.zeros(numel, dtype=bool)
    sampled[_sample_positions(numel)] = True
    position = int(np.flatnonzero(~sampled[3 * CHUNK :])[0]) + 3 * CHUNK
    tensor[position] = bad
    assert torch.isnan(round_trip(codec, tensor)).all()


@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Quantile8BitQuantization()], ids=repr)
def test_codebook_codecs_large_finite_values_are_not_mistaken_for_infinite(codec):
    tensor = randn(2 * CHUNK)
    tensor[CHUNK : CHUNK + 100] = 3e37  # their float32 sum overflows
    restored = round_trip(codec, tensor)
    assert torch.isfinite(restored).all()
    assert torch.allclose(restored[CHUNK : CHUNK + 100], tensor[CHUNK : CHUNK + 100], rtol=1e-2)


@pytest.mark.parametrize(
    "codec",
    [
        Float16Compression(),
        ScaledFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
    ],
    ids=repr,
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_other_float_dtypes_on_the_chunked_paths(codec, dtype):
    tensor = randn(2, CHUNK + 9, seed=5).to(dtype)
    restored = round_trip(codec, tensor)
    assert restored.dtype == dtype and restored.shape == tensor.shape
    bound = 5e-6 if isinstance(codec, (Float16Compression, ScaledFloat16Compression)) else 8e-4
    if dtype == torch.bfloat16 and type(codec) is Float16Compression:
        bound = 0.0  # bfloat16 travels uncompressed
    assert float(((restored.double() - tensor.double()) ** 2).mean()) <= bound


@pytest.mark.parametrize(
    "codec",
    [
        Float16Compression(),
        ScaledFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
    ],
    ids=repr,
)
def test_read_only_payloads_decode_like_writable_ones(codec):
    tensor = randn(3, CHUNK + 1, seed=7)
    message = codec.compress(tensor)
    frozen = TensorMessage(
        np.frombuffer(message.buffer.tobytes(), dtype=np.uint8),
        message.size,
        message.dtype,
        message.compression,
    )
    assert not frozen.buffer.flags.writeable
    assert torch.equal(codec.extract(frozen), codec.extract(message))


def test_encoding_is_deterministic():
    tensor = randn(SAMPLE_SIZE + 3 * CHUNK, seed=9)
    for codec in (
        ScaledFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
    ):
        assert np.array_equal(codec.compress(tensor).buffer, codec.compress(tensor).buffer)
