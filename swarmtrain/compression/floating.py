"""16-bit codecs: float16 casting and per-row mean/std scaling before the cast.

Float16Compression payload: ``numel`` float16 values.  Finite values outside the float16 range
saturate to +-65504; NaN and +-Inf are kept.  float16 inputs travel as they are, and bfloat16
inputs are sent uncompressed (they are 16-bit already and float16 would lose their range).

ScaledFloat16Compression payload: ``numel`` float16 values of ``(x - mean) / std`` over the last
axis, then ``rows`` float32 means, then ``rows`` float32 stds (``rows`` = numel / last dim; 1 for
0-d tensors).  A row holding NaN or +-Inf decodes as all NaN.

float32 tensors are encoded and decoded in cache-sized chunks written straight into the payload
or the output (see ``_chunks``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor, payload_view, scratch, small_array
from swarmtrain.compression._chunks import blocks, cast, copy, map_all, map_chunks, spans
from swarmtrain.compression.base import (
    CompressionInfo,
    NoCompression,
    WireCodec,
    cpu_contiguous,
)
from swarmtrain.compression.wire import (
    CompressionType,
    Message,
    TensorHeader,
    TensorMessage,
    dtype_name,
)

__all__ = ["Float16Compression", "ScaledFloat16Compression"]

FP16_MAX = float(torch.finfo(torch.float16).max)
FP32_EPS = float(torch.finfo(torch.float32).eps)


def _num_bits(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 8
    if dtype.is_floating_point or dtype.is_complex:
        return torch.finfo(dtype).bits * (2 if dtype.is_complex else 1)
    return torch.iinfo(dtype).bits


class Float16Compression(WireCodec):
    """Cast floating-point tensors to float16 (saturating); decode to the original dtype."""

    compression_type = CompressionType.FLOAT16

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        if tensor.dtype == torch.bfloat16:
            return NoCompression()._encode(tensor, allow_inplace)
        source = cpu_contiguous(tensor).reshape(-1)
        buffer = np.empty(2 * source.numel(), dtype=np.uint8)  # the payload, written in place
        half = buffer.view(np.float16)
        if source.dtype == torch.float32:
            _float32_to_float16(source.numpy(), half)
        else:
            to_float16(source, torch.from_numpy(half))
        return _message(buffer, tensor, self.compression_type)

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        with payload_view(buffer, 0, header.numel, torch.float16) as half:
            copy(half, result)
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        return 2 * header.numel, 2 * header.numel

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 16.0 / _num_bits(info.descriptor.dtype)


def to_float16(source: torch.Tensor, half: torch.Tensor) -> None:
    """Write ``source`` as float16 into ``half``: saturate finite overflow, keep NaN and Inf."""
    half.copy_(source)
    if source.numel() == 0:
        return
    low, high = torch.aminmax(source)
    if low >= -FP16_MAX and high <= FP16_MAX:  # false when a NaN is present
        return
    half.clamp_(-FP16_MAX, FP16_MAX)
    infinite = torch.isinf(source)
    if infinite.any():
        half[infinite] = source[infinite].to(torch.float16)


def _float32_to_float16(values: np.ndarray, half: np.ndarray) -> None:
    """:func:`to_float16` for float32, one cache-sized chunk at a time."""

    def convert(span: tuple[int, int], work: np.ndarray) -> None:
        start, stop = span
        chunk = values[start:stop]
        if -FP16_MAX <= np.minimum.reduce(chunk) and np.maximum.reduce(chunk) <= FP16_MAX:
            cast(chunk, half[start:stop])  # the comparisons are false when a NaN is present
            return
        clipped = work[: stop - start]
        np.clip(chunk, -FP16_MAX, FP16_MAX, out=clipped)  # NaN stays NaN
        np.copyto(clipped, chunk, where=np.isinf(chunk))
        cast(clipped, half[start:stop])

    map_chunks(convert, spans(len(values)))


class ScaledFloat16Compression(Float16Compression):
    """Subtract the mean and divide by the std over the last axis, then cast to float16."""

    compression_type = CompressionType.MEANSTD_16BIT

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        source = cpu_contiguous(tensor)
        numel = source.numel()
        rows, last = _rows(tuple(source.shape))
        buffer = np.empty(2 * numel + 8 * rows, dtype=np.uint8)  # the payload, written in place
        means = np.zeros(rows, dtype=np.float32)
        stds = np.ones(rows, dtype=np.float32)
        if numel:
            with scratch(numel if source.dtype != torch.float32 else 0) as converted:
                values = source.reshape(-1)
                if source.dtype != torch.float32:
                    copy(values, converted)
                    values = converted
                _scale_to_float16(
                    values.numpy().reshape(rows, last),
                    means,
                    stds,
                    buffer[: 2 * numel].view(np.float16).reshape(rows, last),
                )
        buffer[2 * numel : 2 * numel + 4 * rows] = means.view(np.uint8)
        buffer[2 * numel + 4 * rows :] = stds.view(np.uint8)
        return _message(buffer, tensor, self.compression_type)

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        numel = header.numel
        rows, last = _rows(header.shape)
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        if numel == 0:
            return result
        means = small_array(buffer, 2 * numel, rows, np.dtype("<f4"))
        stds = small_array(buffer, 2 * numel + 4 * rows, rows, np.dtype("<f4"))
        with payload_view(buffer, 0, numel, torch.float16) as half_t:
            half = half_t.numpy().reshape(rows, last)
            if header.dtype == torch.float32:
                _unscale(result.numpy().reshape(rows, last), half, means, stds)
            else:
                with scratch(numel) as work:
                    _unscale(work.numpy().reshape(rows, last), half, means, stds)
                    copy(work, result)
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        rows, _ = _rows(header.shape)
        size = 2 * header.numel + 8 * rows
        return size, size


def _scale_to_float16(
    values: np.ndarray, means: np.ndarray, stds: np.ndarray, half: np.ndarray
) -> None:
    """Per row of ``values``: fill ``means`` and ``stds``, write (x - mean) / std as float16.

    Two cache-blocked reads of ``values`` and no full-size scratch.  The first gives each
    block's sum and squared deviations from its own mean, which combine exactly into each row's
    (Chan et al.'s parallel variance, in float64 and in block order, so the result does not
    depend on threads); the second writes the output.
    """
    rows, last = values.shape
    parts = blocks(rows, last)

    def moments(block: tuple[int, int, int, int], work: np.ndarray) -> tuple:
        r0, r1, c0, c1 = block
        part = values[r0:r1, c0:c1]
        sums = np.add.reduce(part, axis=1)
        block_means = sums / np.float32(c1 - c0)
        deviations = work[: part.size].reshape(part.shape)
        np.subtract(part, block_means[:, None], out=deviations)
        np.square(deviations, out=deviations)
        return sums, block_means, np.add.reduce(deviations, axis=1)

    results = map_all(moments, parts)
    totals = np.zeros(rows, dtype=np.float64)
    for (r0, r1, _, _), (sums, _, _) in zip(parts, results, strict=True):
        totals[r0:r1] += sums
    squares = np.zeros(rows, dtype=np.float64)
    with np.errstate(all="ignore"):
        row_means = totals / last
        for (r0, r1, c0, c1), (sums, block_means, block_squares) in zip(
            parts, results, strict=True
        ):
            # sum (x - mean)^2 = sum (x - m)^2 + 2 (m - mean) sum (x - m) + n (m - mean)^2
            count = c1 - c0
            shift = block_means - row_means[r0:r1]
            residual = sums - count * block_means.astype(np.float64)
            squares[r0:r1] += block_squares + shift * (2 * residual + count * shift)
        np.maximum(squares, 0.0, out=squares)  # rounding of the correction terms; NaN stays
        means[:] = row_means
        for row in np.flatnonzero(np.isinf(squares) & np.isfinite(means)):
            squares[row] = _float64_squares(values[row], means[row])  # float32 overflow
        np.sqrt(squares / last, out=stds, casting="same_kind")
        np.maximum(stds, np.float32(FP32_EPS), out=stds)  # NaN stays NaN
        means[~(np.isfinite(means) & np.isfinite(stds))] = np.nan  # the row decodes as NaN
        inverse = np.float32(1) / stds
    # |x - mean| / std <= sqrt(last) for every value, so rows below 2**32 values cannot reach
    # float16's 65504 and need no clamp
    saturate = last >= 1 << 30

    def scale(block: tuple[int, int, int, int], work: np.ndarray) -> None:
        r0, r1, c0, c1 = block
        scaled = work[: (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0)
        np.subtract(values[r0:r1, c0:c1], means[r0:r1, None], out=scaled)
        np.multiply(scaled, inverse[r0:r1, None], out=scaled)
        if saturate:
            np.clip(scaled, -FP16_MAX, FP16_MAX, out=scaled)
        cast(scaled.reshape(-1), half[r0:r1, c0:c1].reshape(-1))

    map_chunks(scale, parts)


def _float64_squares(row: np.ndarray, mean: np.float32) -> float:
    total = 0.0
    for start, stop in spans(len(row)):
        deviations = row[start:stop].astype(np.float64) - np.float64(mean)
        total += float(np.add.reduce(deviations * deviations))
    return total


def _unscale(target: np.ndarray, half: np.ndarray, means: np.ndarray, stds: np.ndarray) -> None:
    """``target = half * std + mean`` per row, one cache-sized block at a time."""

    def unscale(block: tuple[int, int, int, int], work: np.ndarray) -> None:
        r0, r1, c0, c1 = block
        part = target[r0:r1, c0:c1]
        cast(half[r0:r1, c0:c1].reshape(-1), part.reshape(-1))
        np.multiply(part, stds[r0:r1, None], out=part)
        np.add(part, means[r0:r1, None], out=part)

    map_chunks(unscale, blocks(*target.shape), work_items=0)


def _message(buffer: np.ndarray, tensor: torch.Tensor, compression: CompressionType) -> Message:
    return TensorMessage(
        buffer, tuple(tensor.shape), dtype_name(tensor.dtype), compression, tensor.requires_grad
    )


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, last) for per-row statistics; a 0-d tensor is one row of one value."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]
