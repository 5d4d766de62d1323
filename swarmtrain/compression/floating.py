"""16-bit codecs: float16 casting and per-row mean/std scaling before the cast.

Float16Compression payload: ``numel`` float16 values.  Finite values outside the float16 range
saturate to +-65504; NaN and +-Inf are kept.  float16 inputs travel as they are, and bfloat16
inputs are sent uncompressed (they are 16-bit already and float16 would lose their range).

ScaledFloat16Compression payload: ``numel`` float16 values of ``(x - mean) / std`` over the last
axis, then ``rows`` float32 means, then ``rows`` float32 stds (``rows`` = numel / last dim; 1 for
0-d tensors).  A row holding NaN or +-Inf decodes as all NaN.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor, payload_view, scratch, small_array
from swarmtrain.compression.base import (
    CompressionInfo,
    NoCompression,
    WireCodec,
    cpu_contiguous,
)
from swarmtrain.compression.wire import CompressionType, Message, TensorHeader, make_message

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
        source = cpu_contiguous(tensor)
        half = np.empty(source.numel(), dtype=np.float16)
        to_float16(source.reshape(-1), torch.from_numpy(half))
        return make_message(
            [half], tensor.shape, tensor.dtype, self.compression_type, tensor.requires_grad
        )

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        with payload_view(buffer, 0, header.numel, torch.float16) as half:
            result.view(-1).copy_(half)
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


class ScaledFloat16Compression(Float16Compression):
    """Subtract the mean and divide by the std over the last axis, then cast to float16."""

    compression_type = CompressionType.MEANSTD_16BIT

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        source = cpu_contiguous(tensor)
        numel = source.numel()
        rows, last = _rows(tuple(source.shape))
        half = np.empty(numel, dtype=np.float16)
        means = np.zeros(rows, dtype=np.float32)
        stds = np.ones(rows, dtype=np.float32)
        if numel:
            with scratch(numel) as work:
                work = work.view(rows, last)
                mean_t, std_t = torch.from_numpy(means), torch.from_numpy(stds)
                if source.dtype == torch.float32:
                    torch.sum(source.view(rows, last), dim=1, out=mean_t)
                    mean_t.div_(last)
                    torch.sub(source.view(rows, last), mean_t[:, None], out=work)
                else:
                    work.copy_(source.view(rows, last))
                    torch.sum(work, dim=1, out=mean_t)
                    mean_t.div_(last)
                    work.sub_(mean_t[:, None])
                if rows == 1:
                    std_t[0] = torch.dot(work[0], work[0])
                else:
                    torch.linalg.vector_norm(work, dim=1, out=std_t).square_()
                std_t.div_(last).sqrt_().clamp_min_(FP32_EPS)
                bad = ~torch.isfinite(mean_t) | ~torch.isfinite(std_t)
                if bad.any():
                    mean_t[bad] = math.nan
                work.div_(std_t[:, None])
                halves = torch.from_numpy(half).view(rows, last)
                halves.copy_(work)
                halves.clamp_(-FP16_MAX, FP16_MAX)
        return make_message(
            [half, means, stds],
            tensor.shape,
            tensor.dtype,
            self.compression_type,
            tensor.requires_grad,
        )

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        numel = header.numel
        rows, last = _rows(header.shape)
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        if numel == 0:
            return result
        means = torch.from_numpy(small_array(buffer, 2 * numel, rows, np.dtype("<f4")))
        stds = torch.from_numpy(small_array(buffer, 2 * numel + 4 * rows, rows, np.dtype("<f4")))
        with payload_view(buffer, 0, numel, torch.float16) as half:
            if header.dtype == torch.float32:
                _unscale(result.view(rows, last), half.view(rows, last), means, stds)
            else:
                with scratch(numel) as work:
                    _unscale(work.view(rows, last), half.view(rows, last), means, stds)
                    result.view(-1).copy_(work)
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        rows, _ = _rows(header.shape)
        size = 2 * header.numel + 8 * rows
        return size, size


def _unscale(target: torch.Tensor, half: torch.Tensor, means: torch.Tensor, stds: torch.Tensor):
    target.copy_(half)
    target.mul_(stds[:, None]).add_(means[:, None])


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, last) for per-row statistics; a 0-d tensor is one row of one value."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]
