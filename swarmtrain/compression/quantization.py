"""8-bit codebook quantization over a whole tensor (hivemind's UNIFORM_8BIT / QUANTILE_8BIT).

Payload: int64 codebook size (always 256), 256 float32 codes, then one uint8 index per value.
Each code is the mean of the values assigned to it (hivemind's ``average_buckets``).  Tensors
above SAMPLE_SIZE values take their statistics (mean, std, quantiles, bucket means) from a
fixed-seed sample of SAMPLE_SIZE values (the quantile grid spans the sample's range; values
beyond it land in the outer buckets).  Encoding reads the tensor once, in cache-sized chunks
(see ``_chunks``).  A tensor holding NaN or +-Inf decodes as all NaN (its statistics are
undefined).

Rounding uses the float32 "magic number" trick: adding 1.5 * 2**23 to a value in [-2**22, 2**22]
rounds it to an integer held in the low mantissa bits, so one add plus an integer narrowing
replaces round + cast passes.
"""

from __future__ import annotations

import functools
import math
from abc import abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor, scratch
from swarmtrain.compression._chunks import CHUNK, copy, map_chunks, spans
from swarmtrain.compression._lut import decode_8bit
from swarmtrain.compression.base import CompressionInfo, WireCodec, cpu_contiguous
from swarmtrain.compression.errors import WireFormatError
from swarmtrain.compression.wire import (
    CompressionType,
    Message,
    TensorHeader,
    TensorMessage,
    dtype_name,
)

__all__ = ["Quantile8BitQuantization", "Quantization", "Uniform8BitQuantization"]

MAGIC = 1.5 * 2**23  # float32 values in [2**23, 2**24) have an ulp of exactly 1
MAGIC_BITS = int(np.float32(MAGIC).view(np.int32))
FP32_MAX = float(np.finfo(np.float32).max)
N_BINS = 256
_HEADER = 8 + 4 * N_BINS


class Quantization(WireCodec):
    """Shared payload layout, encoding pass and decoder of the 8-bit codebook codecs."""

    n_bits = 8
    n_bins = N_BINS

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        source = cpu_contiguous(tensor).reshape(-1)
        numel = source.numel()
        buffer = np.empty(_HEADER + numel, dtype=np.uint8)  # the payload, written in place
        buffer[:8].view("<i8")[0] = N_BINS
        codebook = buffer[8:_HEADER].view(np.float32)
        indices = buffer[_HEADER:]
        codebook.fill(0)
        if numel:
            with scratch(numel if source.dtype != torch.float32 else 0) as converted:
                if source.dtype != torch.float32:
                    copy(source, converted)
                array = (source if source.dtype == torch.float32 else converted).numpy()
                positions = _sample_positions(numel)
                sample = array if positions is None else array[positions]
                finite = bool(np.isfinite(sample).all())
                if finite:
                    quantize = self._quantizer(sample)
                    finite = _quantize_all(quantize, array, indices)
                if finite:
                    sample_indices = indices
                    if positions is not None:  # the same function, so the same buckets
                        sample_indices = np.empty(len(sample), dtype=np.uint8)
                        _quantize_all(quantize, sample, sample_indices, check=False)
                    codebook[:] = bucket_means(sample, sample_indices)
                else:
                    codebook.fill(math.nan)
                    indices.fill(0)
        return TensorMessage(
            buffer,
            tuple(tensor.shape),
            dtype_name(tensor.dtype),
            self.compression_type,
            tensor.requires_grad,
        )

    @abstractmethod
    def _quantizer(self, sample: np.ndarray) -> Quantizer:
        """A function writing the uint8 bucket of each finite float32 value of a chunk.

        ``sample`` (finite) is every value for small tensors, else a fixed-seed sample of
        SAMPLE_SIZE.  The function is called as ``quantize(values, work, out)`` for chunks of at
        most CHUNK values, ``work`` being 3 * CHUNK float32 values of scratch.
        """

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        (size,) = np.frombuffer(buffer, dtype="<i8", count=1)
        if size != N_BINS:
            raise WireFormatError(f"{header.compression.name} codebook size {size}, expected 256")
        codebook = np.frombuffer(buffer, dtype="<f4", count=N_BINS, offset=8)
        indices = np.frombuffer(buffer, dtype=np.uint8, count=header.numel, offset=_HEADER)
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        if header.dtype == torch.float32:
            decode_8bit(codebook, indices, result.numpy().reshape(-1))
        else:
            with scratch(header.numel) as work:
                decode_8bit(codebook, indices, work.numpy())
                copy(work, result)
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        return _HEADER + header.numel, _HEADER + header.numel

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.n_bits / torch.finfo(info.descriptor.dtype).bits


class Uniform8BitQuantization(Quantization):
    """256 equal buckets spanning +-3 standard deviations around the mean (values beyond clip)."""

    compression_type = CompressionType.UNIFORM_8BIT
    RANGE_IN_SIGMAS = 6

    def _quantizer(self, sample: np.ndarray) -> Quantizer:
        mean = float(np.mean(sample, dtype=np.float64))
        std = float(np.std(sample, dtype=np.float64, ddof=1)) if len(sample) > 1 else 0.0
        step = self.RANGE_IN_SIGMAS * std / N_BINS
        inverse = 1.0 / step if step > 0 else 0.0
        if inverse > FP32_MAX:  # a step below float32's range: every value is the mean
            inverse = 0.0
        inverse32 = np.float32(inverse)
        center = np.float32(mean)

        def quantize(values: np.ndarray, work: np.ndarray, out: np.ndarray) -> None:
            # bucket = clamp(round((x - mean) / step) + 128, 0, 255), as hivemind's quint8 path
            scaled = work[: len(values)]
            np.subtract(values, center, out=scaled)
            np.multiply(scaled, inverse32, out=scaled)
            np.add(scaled, np.float32(MAGIC + N_BINS // 2), out=scaled)  # rounds: see above
            np.clip(scaled, np.float32(MAGIC), np.float32(MAGIC + N_BINS - 1), out=scaled)
            np.copyto(out, scaled.view(np.int32), casting="unsafe")  # the low byte: the bucket

        return quantize


class Quantile8BitQuantization(Quantization):
    """256 buckets holding equal shares of the values, from quantiles of a fixed-seed sample.

    Assignment goes through a 65536-step grid between the outer quantiles and a lookup table,
    which is exact up to values within one grid step of a bucket border.
    """

    compression_type = CompressionType.QUANTILE_8BIT
    GRID = 1 << 16
    LLOYD_STEPS = 1

    def _quantizer(self, sample: np.ndarray) -> Quantizer:
        sample = np.sort(sample)
        borders = _sorted_quantiles(sample, np.linspace(0, 1, N_BINS + 1)[1:-1])
        for _ in range(self.LLOYD_STEPS):
            borders = _lloyd_step(sample, borders)
        borders = borders.astype(np.float32)
        pad = float(borders[-1] - borders[0]) / self.GRID
        # the sample's extremes bound the grid: values beyond them land in the outer buckets
        grid_low = max(float(sample[0]), float(borders[0]) - pad)
        grid_high = min(float(sample[-1]), float(borders[-1]) + pad)
        scale = (self.GRID - 1) / (grid_high - grid_low) if grid_high > grid_low else 0.0
        if scale > FP32_MAX:
            scale = 0.0
        centers = grid_low + np.arange(self.GRID, dtype=np.float64) / (scale or 1.0)
        table = np.searchsorted(borders, centers, side="left").clip(0, N_BINS - 1)
        table = table.astype(np.uint8)
        low, step_scale = np.float32(grid_low), np.float32(scale)

        def quantize(values: np.ndarray, work: np.ndarray, out: np.ndarray) -> None:
            scaled = work[: len(values)]
            steps = work[CHUNK : CHUNK + 2 * len(values)].view(np.intp)
            np.subtract(values, low, out=scaled)
            np.multiply(scaled, step_scale, out=scaled)
            np.add(scaled, np.float32(MAGIC), out=scaled)  # rounds: see the module docstring
            np.clip(scaled, np.float32(MAGIC), np.float32(MAGIC + self.GRID - 1), out=scaled)
            np.subtract(scaled.view(np.int32), MAGIC_BITS, out=steps)  # the grid step
            np.take(table, steps, out=out, mode="clip")  # steps are in range: no buffered out

        return quantize


Quantizer = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def _quantize_all(
    quantize: Quantizer, values: np.ndarray, out: np.ndarray, check: bool = True
) -> bool:
    """Run ``quantize`` over cache-sized chunks; False (stopping early) on NaN or +-Inf."""

    def run(span: tuple[int, int], work: np.ndarray) -> bool:
        start, stop = span
        chunk = values[start:stop]
        # a finite sum means finite values; an infinite one may be overflow, so look closer
        if check and not math.isfinite(np.add.reduce(chunk)):
            low, high = np.minimum.reduce(chunk), np.maximum.reduce(chunk)
            if not (math.isfinite(low) and math.isfinite(high)):
                return False
        quantize(chunk, work, out[start:stop])
        return True

    return all(map_chunks(run, spans(len(values)), work_items=3 * CHUNK))


SAMPLE_SIZE = 1 << 18


@functools.lru_cache(maxsize=16)
def _sample_positions(numel: int) -> np.ndarray | None:
    """Fixed-seed positions of SAMPLE_SIZE values (ascending, read-only), or None when every
    value is the sample."""
    if numel <= SAMPLE_SIZE:
        return None
    positions = np.sort(np.random.default_rng(numel).integers(0, numel, SAMPLE_SIZE))
    positions.setflags(write=False)
    return positions


def bucket_means(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Mean of the values in each of the 256 buckets (0 for empty buckets)."""
    sums = np.bincount(indices, weights=values, minlength=N_BINS)
    counts = np.bincount(indices, minlength=N_BINS)
    return (sums / np.maximum(counts, 1)).astype(np.float32)


def _sorted_quantiles(sorted_sample: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """``np.quantile(sorted_sample, levels)`` (linear method) without re-partitioning."""
    position = levels * (len(sorted_sample) - 1)
    below = np.floor(position).astype(np.intp)
    above = np.minimum(below + 1, len(sorted_sample) - 1)
    low = sorted_sample[below].astype(np.float64)
    high = sorted_sample[above].astype(np.float64)
    fraction = position - below
    # numpy's lerp: from the nearer end, so that equal ends give exactly that value
    return np.where(
        fraction < 0.5, low + (high - low) * fraction, high - (high - low) * (1 - fraction)
    )


def _lloyd_step(sorted_sample: np.ndarray, borders: np.ndarray) -> np.ndarray:
    """Move each border to the midpoint of the sample means of its two buckets."""
    positions = np.searchsorted(sorted_sample, borders, side="right")
    edges = np.concatenate(([0], positions, [len(sorted_sample)]))
    sums = np.concatenate(([0.0], np.cumsum(sorted_sample, dtype=np.float64)))
    counts = np.diff(edges)
    means = (sums[edges[1:]] - sums[edges[:-1]]) / np.maximum(counts, 1)
    means = np.where(counts > 0, means, np.concatenate(([borders[0]], borders)))
    refined = (means[:-1] + means[1:]) / 2
    return np.maximum.accumulate(refined)
