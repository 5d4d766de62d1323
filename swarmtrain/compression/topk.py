"""Top-k sparsification and an error-feedback wrapper for any codec.

TopKSparsification payload: uint64 k, uint32 index width (4 or 8), uint32 zero, ``k`` strictly
ascending indices into the flattened tensor, then ``k`` values in the tensor's dtype.  Values
travel exactly, so NaN and +-Inf among them survive; ``torch.topk`` ranks NaN above any number.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Any

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor
from swarmtrain.compression.base import (
    CompressionBase,
    CompressionInfo,
    Key,
    WireCodec,
    check_bool_bytes,
    cpu_contiguous,
)
from swarmtrain.compression.errors import WireFormatError
from swarmtrain.compression.wire import (
    CompressionType,
    Message,
    TensorHeader,
    make_message,
    numpy_dtype,
    tensor_to_numpy,
)

__all__ = ["ErrorFeedback", "TopKSparsification"]

_PREFIX = struct.Struct("<QII")


class TopKSparsification(WireCodec):
    """Send the ``ratio`` share of values with the largest magnitude (at least ``min_k``)."""

    compression_type = CompressionType.TOPK

    def __init__(self, ratio: float = 0.01, min_k: int = 1):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        if min_k < 1:
            raise ValueError(f"min_k must be >= 1, got {min_k}")
        self.ratio, self.min_k = ratio, min_k

    def k_for(self, numel: int) -> int:
        """How many values a tensor of ``numel`` values keeps."""
        return min(numel, max(self.min_k, math.ceil(self.ratio * numel)))

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        flat = cpu_contiguous(tensor).reshape(-1)
        numel = flat.numel()
        k = self.k_for(numel)
        width = 4 if numel <= 2**32 else 8
        if k == numel:
            indices = torch.arange(numel, dtype=torch.int64)
        else:
            magnitudes = flat.abs() if flat.dtype != torch.float16 else flat.float().abs()
            indices = torch.topk(magnitudes, k, sorted=False).indices.sort().values
        values = tensor_to_numpy(flat[indices])
        index_array = indices.numpy().astype(np.uint32 if width == 4 else np.uint64)
        return make_message(
            [_PREFIX.pack(k, width, 0), index_array, values],
            tensor.shape,
            tensor.dtype,
            self.compression_type,
            tensor.requires_grad,
        )

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        k, width, reserved = _PREFIX.unpack_from(buffer.data)
        numel = header.numel
        itemsize = numpy_dtype(header.dtype_name).itemsize
        if width not in (4, 8) or reserved or k > numel:
            raise WireFormatError(f"TOPK header k={k} width={width} is invalid for {numel} values")
        if len(buffer) != _PREFIX.size + k * (width + itemsize):
            raise WireFormatError(f"TOPK payload is {len(buffer)} bytes, does not match k={k}")
        indices = np.frombuffer(buffer, dtype=f"<u{width}", count=k, offset=_PREFIX.size)
        if k and (indices[-1] >= numel or np.any(indices[1:] <= indices[:-1])):
            raise WireFormatError("TOPK indices must be strictly ascending and below numel")
        values = np.frombuffer(
            buffer, dtype=numpy_dtype(header.dtype_name), count=k, offset=_PREFIX.size + k * width
        )
        if header.dtype == torch.bool:
            check_bool_bytes(values)
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        flat = tensor_to_numpy(result)
        flat.fill(0)
        flat[indices.astype(np.intp)] = values
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        itemsize = numpy_dtype(header.dtype_name).itemsize
        return _PREFIX.size, _PREFIX.size + header.numel * (8 + itemsize)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        itemsize = info.descriptor.dtype.itemsize
        return self.ratio * (4 + itemsize) / itemsize

    def __repr__(self) -> str:
        return f"TopKSparsification(ratio={self.ratio}, min_k={self.min_k})"


class ErrorFeedback(CompressionBase):
    """Wrap a lossy codec so each tensor's compression error is added back next time.

    Residuals are float32 and kept per ``info.key`` (``None`` when no info is given), and per
    ``info.part_offset`` for parts of a split tensor (all-reduce sends several parts of one
    tensor); a residual whose shape no longer matches is dropped.  Decoding is the wrapped
    codec's.
    """

    def __init__(self, compression: CompressionBase):
        self.compression = compression
        self._residuals: dict[Key, torch.Tensor] = {}
        self._lock = threading.Lock()

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> Message:
        key = _residual_key(info)
        corrected = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
        with self._lock:
            residual = self._residuals.pop(key, None)
        if residual is not None and residual.shape == corrected.shape:
            corrected.add_(residual)
        message = self.compression.compress(corrected.to(tensor.dtype), info)
        message.requires_grad = tensor.requires_grad
        decoded = self.compression.extract(message).detach().float()
        with self._lock:
            self._residuals[key] = corrected.sub_(decoded)
        return message

    def residual(self, key: Key = None, part_offset: int | None = None) -> torch.Tensor | None:
        """The error carried over for ``key`` (its part at ``part_offset``), if any."""
        with self._lock:
            return self._residuals.get(key if part_offset is None else (key, part_offset))

    @property
    def num_residuals(self) -> int:
        """How many tensors or parts have a residual."""
        with self._lock:
            return len(self._residuals)

    def reset(self) -> None:
        """Forget every residual."""
        with self._lock:
            self._residuals.clear()

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.compression.estimate_compression_ratio(info)

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compression!r})"


def _residual_key(info: CompressionInfo | None) -> Any:
    if info is None:
        return None
    return info.key if info.part_offset is None else (info.key, info.part_offset)
