"""8-bit codebook quantization over a whole tensor (hivemind's UNIFORM_8BIT / QUANTILE_8BIT).

Payload: int64 codebook size (always 256), 256 float32 codes, then one uint8 index per value.
Each code is the mean of the values assigned to it (hivemind's ``average_buckets``).  Tensors
above SAMPLE_SIZE values take their statistics (mean, std, quantiles, bucket means) from a
fixed-seed sample of SAMPLE_SIZE values, so encoding costs a few passes over the data.
A tensor holding NaN or +-Inf decodes as all NaN (its statistics are undefined).

Rounding uses the float32 "magic number" trick: adding 1.5 * 2**23 to a value in [-2**22, 2**22]
rounds it to an integer held in the low mantissa bits, so one fused multiply-add plus an integer
narrowing replaces round + clamp + cast passes.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor, scratch
from swarmtrain.compression._lut import decode_8bit, gather
from swarmtrain.compression.base import CompressionInfo, WireCodec, cpu_contiguous
from swarmtrain.compression.errors import WireFormatError
from swarmtrain.compression.wire import CompressionType, Message, TensorHeader, make_message

__all__ = ["Quantile8BitQuantization", "Quantization", "Uniform8BitQuantization"]

MAGIC = 1.5 * 2**23  # float32 values in [2**23, 2**24) have an ulp of exactly 1
N_BINS = 256
_HEADER = 8 + 4 * N_BINS


class Quantization(WireCodec):
    """Shared payload layout and decoder of the 8-bit codebook codecs."""

    n_bits = 8
    n_bins = N_BINS

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        source = cpu_contiguous(tensor).reshape(-1)
        numel = source.numel()
        indices = np.empty(numel, dtype=np.uint8)  # np.zeros would page-fault on first write
        codebook = np.zeros(N_BINS, dtype=np.float32)
        if numel:
            with scratch(numel if source.dtype != torch.float32 else 0) as converted:
                values = source
                if source.dtype != torch.float32:
                    values = converted.copy_(source)
                low, high = (float(v) for v in torch.aminmax(values))
                if math.isfinite(low) and math.isfinite(high):
                    array = values.numpy()
                    positions = _sample_positions(numel)
                    sample = array if positions is None else array[positions]
                    self._quantize(values, sample, low, high, torch.from_numpy(indices))
                    sample_indices = indices if positions is None else indices[positions]
                    codebook = bucket_means(sample, sample_indices)
                else:
                    codebook[:] = math.nan
                    indices.fill(0)
        return make_message(
            [np.int64(N_BINS).tobytes(), codebook, indices],
            tensor.shape,
            tensor.dtype,
            self.compression_type,
            tensor.requires_grad,
        )

    @abstractmethod
    def _quantize(
        self, values: torch.Tensor, sample: np.ndarray, low: float, high: float, out: torch.Tensor
    ) -> None:
        """Write a uint8 bucket index for each finite float32 value into ``out``.

        ``sample`` is every value for small tensors, else a fixed-seed sample of SAMPLE_SIZE.
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
                result.view(-1).copy_(work)
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        return _HEADER + header.numel, _HEADER + header.numel

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.n_bits / torch.finfo(info.descriptor.dtype).bits


class Uniform8BitQuantization(Quantization):
    """256 equal buckets spanning +-3 standard deviations around the mean (values beyond clip)."""

    compression_type = CompressionType.UNIFORM_8BIT
    RANGE_IN_SIGMAS = 6

    def _quantize(
        self, values: torch.Tensor, sample: np.ndarray, low: float, high: float, out: torch.Tensor
    ) -> None:
        mean = float(np.mean(sample, dtype=np.float64))
        std = float(np.std(sample, dtype=np.float64, ddof=1)) if len(sample) > 1 else 0.0
        step = self.RANGE_IN_SIGMAS * std / N_BINS
        inverse = 1.0 / step if step > 0 else 0.0
        with scratch(values.numel()) as work:
            # bucket = clamp(round((x - mean) / step) + 128, 0, 255), as hivemind's quint8 path
            offset = torch.tensor(MAGIC + N_BINS // 2 - mean * inverse)
            torch.add(offset, values, alpha=inverse, out=work)
            work.clamp_(MAGIC, MAGIC + N_BINS - 1)
            out.copy_(work.view(torch.int32))


class Quantile8BitQuantization(Quantization):
    """256 buckets holding equal shares of the values, from quantiles of a fixed-seed sample.

    Assignment goes through a 65536-step grid between the outer quantiles and a lookup table,
    which is exact up to values within one grid step of a bucket border.
    """

    compression_type = CompressionType.QUANTILE_8BIT
    GRID = 1 << 16
    LLOYD_STEPS = 1

    def _quantize(
        self, values: torch.Tensor, sample: np.ndarray, low: float, high: float, out: torch.Tensor
    ) -> None:
        numel = values.numel()
        sample = np.sort(sample)
        borders = np.quantile(sample, np.linspace(0, 1, N_BINS + 1)[1:-1])
        for _ in range(self.LLOYD_STEPS):
            borders = _lloyd_step(sample, borders)
        borders = borders.astype(np.float32)
        pad = float(borders[-1] - borders[0]) / self.GRID
        grid_low = max(low, float(borders[0]) - pad)
        grid_high = min(high, float(borders[-1]) + pad)
        scale = (self.GRID - 1) / (grid_high - grid_low) if grid_high > grid_low else 0.0
        centers = grid_low + np.arange(self.GRID, dtype=np.float64) / (scale or 1.0)
        table = np.searchsorted(borders, centers, side="left").clip(0, N_BINS - 1)
        table = table.astype(np.uint8)
        with scratch(numel) as work, scratch(numel, torch.int16) as steps:
            torch.add(torch.tensor(MAGIC - grid_low * scale), values, alpha=scale, out=work)
            work.clamp_(MAGIC, MAGIC + self.GRID - 1)
            steps.copy_(work.view(torch.int32))
            gather(table, steps.numpy().view(np.uint16), out.numpy())


SAMPLE_SIZE = 1 << 18


def _sample_positions(numel: int) -> np.ndarray | None:
    """Fixed-seed positions of SAMPLE_SIZE values, or None when every value is the sample."""
    if numel <= SAMPLE_SIZE:
        return None
    return np.random.default_rng(numel).integers(0, numel, SAMPLE_SIZE)


def bucket_means(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Mean of the values in each of the 256 buckets (0 for empty buckets)."""
    sums = np.bincount(indices, weights=values, minlength=N_BINS)
    counts = np.bincount(indices, minlength=N_BINS)
    return (sums / np.maximum(counts, 1)).astype(np.float32)


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
