"""Blockwise absmax quantization: 8-bit (bitsandbytes-compatible) and 4-bit.

Payload: uint32 block size, uint32 code size (256 or 16), the float32 code, one float32 absmax
per block of ``block size`` values, then the indices (uint8; for 4 bits two per byte, low nibble
first).  A value decodes as ``code[index] * absmax[block]``, whoever encoded it: bitsandbytes'
dynamic code and our linear code share this layout, so either side decodes the other.

Backends of :class:`BlockwiseQuantization`: ``"bitsandbytes"`` (its quantize_blockwise; fast
on CUDA, 0.17-0.6 GB/s on CPU), ``"torch"`` (linear int8, vectorized torch/numpy, CPU), and
``"auto"``: bitsandbytes for CUDA tensors when it is importable, the torch path otherwise.

A block holding NaN or +-Inf decodes as all NaN (on both backends); on the torch backend, a
block whose values are all below ``levels / float32 max`` (~4e-37 for 8 bits) decodes as zeros.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import struct
import warnings
from typing import Any, Literal

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor, payload_view, scratch, small_array
from swarmtrain.compression._lut import decode_4bit, decode_8bit
from swarmtrain.compression.base import CompressionInfo, WireCodec, cpu_contiguous
from swarmtrain.compression.errors import CompressionError, WireFormatError
from swarmtrain.compression.wire import CompressionType, Message, TensorHeader, make_message

__all__ = ["Blockwise4BitQuantization", "BlockwiseQuantization", "bitsandbytes_available"]

MAGIC = 1.5 * 2**23
MIN_BLOCK, MAX_BLOCK = 16, 1 << 24
_PREFIX = struct.Struct("<II")
# linear codes: the 8-bit index is the int8 value's byte, the 4-bit index is value + 8
LINEAR_CODE_8BIT = (np.arange(256, dtype=np.uint8).view(np.int8) / np.float32(127)).astype(
    np.float32
)
LINEAR_CODE_4BIT = ((np.arange(16) - 8) / np.float32(7)).astype(np.float32)


@functools.cache
def _bitsandbytes() -> Any:
    try:
        if importlib.util.find_spec("bitsandbytes") is None:
            return None
    except (ImportError, ValueError):  # e.g. blocked with sys.modules["bitsandbytes"] = None
        return None
    with warnings.catch_warnings():  # it warns about optional CPU kernels on import
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module("bitsandbytes.functional")
        except Exception:  # a broken install counts as absent
            return None


def bitsandbytes_available() -> bool:
    """Whether bitsandbytes imports here."""
    return _bitsandbytes() is not None


class _Blockwise(WireCodec):
    code_size: int
    bits: int

    def __init__(self, block_size: int):
        if not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size & (block_size - 1) == 0):
            raise ValueError(f"block_size must be a power of two in [16, 2**24], got {block_size}")
        self.block_size = block_size

    def _message(self, tensor, code, absmax, indices) -> Message:
        prefix = _PREFIX.pack(self.block_size, self.code_size)
        return make_message(
            [prefix, code, absmax, indices],
            tensor.shape,
            tensor.dtype,
            self.compression_type,
            tensor.requires_grad,
        )

    def _index_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        numel = header.numel
        fixed = _PREFIX.size + 4 * self.code_size + self._index_bytes(numel)
        return fixed + 4 * _blocks(numel, MAX_BLOCK), fixed + 4 * _blocks(numel, MIN_BLOCK)

    def _parse(
        self, header: TensorHeader, buffer: np.ndarray
    ) -> tuple[int, np.ndarray, np.ndarray]:
        block_size, code_size = _PREFIX.unpack_from(buffer.data)
        name = header.compression.name
        if code_size != self.code_size:
            raise WireFormatError(f"{name} code size {code_size}, expected {self.code_size}")
        if not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size & (block_size - 1) == 0):
            raise WireFormatError(f"{name} block size {block_size} is not a power of two in range")
        blocks = _blocks(header.numel, block_size)
        expected = _PREFIX.size + 4 * (code_size + blocks) + self._index_bytes(header.numel)
        if len(buffer) != expected:
            raise WireFormatError(
                f"{name} payload is {len(buffer)} bytes, expected {expected} for block size "
                f"{block_size} and shape {list(header.shape)}"
            )
        code = small_array(buffer, _PREFIX.size, code_size, np.dtype("<f4"))
        absmax = small_array(buffer, _PREFIX.size + 4 * code_size, blocks, np.dtype("<f4"))
        return block_size, code, absmax

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        bits = torch.finfo(info.descriptor.dtype).bits
        return (self.bits + 32 / self.block_size) / bits

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


class BlockwiseQuantization(_Blockwise):
    """8-bit blockwise absmax quantization (bitsandbytes' format; see the module docstring)."""

    compression_type = CompressionType.BLOCKWISE_8BIT
    code_size, bits = 256, 8

    def __init__(
        self,
        block_size: int = 4096,
        backend: Literal["auto", "torch", "bitsandbytes"] = "auto",
    ):
        super().__init__(block_size)
        if backend not in ("auto", "torch", "bitsandbytes"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'bitsandbytes', got {backend!r}")
        if backend == "bitsandbytes" and not bitsandbytes_available():
            raise CompressionError("backend='bitsandbytes' but bitsandbytes is not importable")
        self.backend = backend

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        use_bnb = self.backend == "bitsandbytes" or (
            self.backend == "auto" and tensor.is_cuda and bitsandbytes_available()
        )
        if use_bnb and tensor.numel():
            return self._encode_bitsandbytes(tensor)
        source = cpu_contiguous(tensor).reshape(-1)
        numel = source.numel()
        absmax = np.empty(_blocks(numel, self.block_size), dtype=np.float32)
        indices = np.empty(numel, dtype=np.int8)
        with scratch(numel if source.dtype != torch.float32 else 0) as converted:
            values = source if source.dtype == torch.float32 else converted.copy_(source)
            _quantize_linear(values, self.block_size, 127, absmax, torch.from_numpy(indices))
        return self._message(tensor, LINEAR_CODE_8BIT, absmax, indices)

    def _encode_bitsandbytes(self, tensor: torch.Tensor) -> Message:
        functional = _bitsandbytes()
        source = tensor.detach().contiguous().reshape(-1)
        if source.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            source = source.float()
        indices, state = functional.quantize_blockwise(source, blocksize=self.block_size)
        absmax = state.absmax.float()
        finite = torch.isfinite(source)
        if not bool(finite.all()):  # bitsandbytes ignores NaN inside a block: make it explicit
            padded = torch.ones(absmax.numel() * self.block_size, dtype=torch.bool)
            padded[: source.numel()] = finite.cpu()
            absmax = absmax.cpu()
            absmax[~padded.view(-1, self.block_size).all(dim=1)] = math.nan
        return self._message(
            tensor,
            state.code.float().cpu().numpy(),
            absmax.cpu().numpy(),
            indices.cpu().numpy(),
        )

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        block_size, code, absmax = self._parse(header, buffer)
        numel = header.numel
        offset = len(buffer) - numel
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        if numel == 0:
            return result
        with scratch(numel if header.dtype != torch.float32 else 0) as work:
            target = result.view(-1) if header.dtype == torch.float32 else work
            if np.array_equal(code, LINEAR_CODE_8BIT):
                with payload_view(buffer, offset, numel, torch.int8) as quantized:
                    target.copy_(quantized)
                _scale_blocks(target, torch.from_numpy(absmax / np.float32(127)), block_size)
            else:
                indices = np.frombuffer(buffer, dtype=np.uint8, count=numel, offset=offset)
                decode_8bit(code, indices, target.numpy())
                _scale_blocks(target, torch.from_numpy(absmax), block_size)
            if target is work:
                result.view(-1).copy_(work)
        return result


class Blockwise4BitQuantization(_Blockwise):
    """4-bit blockwise absmax quantization (linear code -7..7), e.g. for DiLoCo pseudo-gradients.

    About 4.5 bits per value with the default 64-value blocks.
    """

    compression_type = CompressionType.BLOCKWISE_4BIT
    code_size, bits = 16, 4

    def __init__(self, block_size: int = 64):
        super().__init__(block_size)

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        source = cpu_contiguous(tensor).reshape(-1)
        numel = source.numel()
        absmax = np.empty(_blocks(numel, self.block_size), dtype=np.float32)
        packed = np.zeros((numel + 1) // 2, dtype=np.uint8)
        if numel:
            with (
                scratch(numel if source.dtype != torch.float32 else 0) as converted,
                scratch(2 * len(packed), torch.uint8) as nibbles,
            ):
                values = source if source.dtype == torch.float32 else converted.copy_(source)
                nibbles[-1] = 8  # the pad nibble of an odd count decodes as 0
                _quantize_linear(values, self.block_size, 7, absmax, nibbles[:numel], offset=8)
                pairs = nibbles.numpy().reshape(-1, 2)
                np.left_shift(pairs[:, 1], 4, out=packed)
                np.bitwise_or(packed, pairs[:, 0], out=packed)
        return self._message(tensor, LINEAR_CODE_4BIT, absmax, packed)

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        block_size, code, absmax = self._parse(header, buffer)
        numel = header.numel
        count = (numel + 1) // 2
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        if numel == 0:
            return result
        packed = np.frombuffer(buffer, dtype=np.uint8, count=count, offset=len(buffer) - count)
        with scratch(numel if header.dtype != torch.float32 else 0) as work:
            target = result.view(-1) if header.dtype == torch.float32 else work
            decode_4bit(code, packed, target.numpy())
            _scale_blocks(target, torch.from_numpy(absmax), block_size)
            if target is work:
                result.view(-1).copy_(work)
        return result


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _quantize_linear(
    values: torch.Tensor,
    block_size: int,
    levels: int,
    absmax: np.ndarray,
    out: torch.Tensor,
    offset: int = 0,
) -> None:
    """out = round(x * levels / absmax[block]) + offset (as bytes); fills ``absmax``."""
    numel = values.numel()
    full = numel // block_size
    body = values[: full * block_size].view(full, block_size)
    with scratch(numel) as work:
        if full and block_size >= 1024:  # numpy's SIMD reductions are fastest on long rows
            rows = body.numpy()
            np.maximum(rows.max(axis=1), -rows.min(axis=1), out=absmax[:full])
        elif full:
            magnitudes = torch.abs(body, out=work[: full * block_size].view(full, block_size))
            torch.amax(magnitudes, dim=1, out=torch.from_numpy(absmax[:full]))
        if numel > full * block_size:
            absmax[full] = np.abs(values[full * block_size :].numpy()).max()
        absmax[~np.isfinite(absmax)] = np.nan  # the whole block decodes as NaN
        # levels / absmax would overflow float32: such a block (all values below ~4e-37)
        # decodes as zeros
        absmax[absmax < np.float32(levels) / np.finfo(np.float32).max] = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(absmax > 0, np.float32(levels) / absmax, np.float32(0))
            inverse[np.isnan(absmax)] = np.nan
        scales = torch.from_numpy(inverse.astype(np.float32))
        magic = torch.tensor(MAGIC + offset)
        if full:
            work_body = work[: full * block_size].view(full, block_size)
            torch.addcmul(magic, body, scales[:full, None], out=work_body)
        if numel > full * block_size:
            tail = values[full * block_size :]
            torch.addcmul(magic, tail, scales[full], out=work[full * block_size :])
        out.copy_(work.view(torch.int32))


def _scale_blocks(values: torch.Tensor, scale: torch.Tensor, block_size: int) -> None:
    numel = values.numel()
    full = numel // block_size
    if full:
        values[: full * block_size].view(full, block_size).mul_(scale[:full, None])
    if numel > full * block_size:
        values[full * block_size :].mul_(scale[full])
