"""How one all-reduce part travels: encoded from a tensor (a view of its memory when lossless),
as a v1 protobuf part or a v2 header plus attachment, decoded against the expected shape, and
received into reused buffers. Used by :mod:`swarmtrain.averaging.allreduce`."""

from __future__ import annotations

import anyio.lowlevel
import anyio.to_thread
import numpy as np
import torch

from swarmtrain.compression import (
    CompressionBase,
    CompressionType,
    Float16Compression,
    NoCompression,
    WireFormatError,
    deserialize_torch_tensor,
)
from swarmtrain.compression.wire import (
    TensorMessage,
    check_header,
    dtype_name,
    numpy_dtype,
    tensor_to_numpy,
)
from swarmtrain.p2p import Attached
from swarmtrain.proto import averaging_pb2

# Codecs cheap enough (a memcpy or a cast) to run on the loop for parts up to this size. Exact
# types only: a subclass or a selector may do anything, including block.
INLINE_CODECS = (NoCompression, Float16Compression)
INLINE_WIRE_TYPES = frozenset({int(CompressionType.NONE), int(CompressionType.FLOAT16)})
INLINE_MAX_BYTES = 4 << 20


def part_to_proto(message: TensorMessage) -> averaging_pb2.AveragingTensorPart:
    """A v1 part: the payload inside the protobuf."""
    return averaging_pb2.AveragingTensorPart(
        buffer=message.buffer.tobytes(),
        size=message.size,
        dtype=message.dtype,
        compression=int(message.compression),
    )


def part_header(message: TensorMessage) -> averaging_pb2.AveragingTensorPart:
    """A v2 part: the header only (the payload travels as the attachment)."""
    return averaging_pb2.AveragingTensorPart(
        size=message.size, dtype=message.dtype, compression=int(message.compression)
    )


def unwrap(item) -> tuple:
    """``(message, attachment or None)`` of a received item."""
    if isinstance(item, Attached):
        return item.message, item.attachment
    return item, None


def encode_part(codec: CompressionBase, part: torch.Tensor, info=None) -> TensorMessage:
    """Encode a part; lossless parts of a contiguous CPU tensor are a view of its memory (for
    attachments, which are sent from memory that stays unchanged until they are out)."""
    if type(codec) is NoCompression and part.device.type == "cpu" and part.is_contiguous():
        payload = tensor_to_numpy(part).view(np.uint8)
        return TensorMessage(
            payload, tuple(part.shape), dtype_name(part.dtype), CompressionType.NONE
        )
    return codec.compress(part, info)


def decode_part(
    part: averaging_pb2.AveragingTensorPart,
    payload,
    shape,
    dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode a part against the shape and dtype we expect; None if it does not fit.

    :param payload: its bytes (an attachment), or None for the protobuf's own ``buffer``
    :param out: decode into this tensor; else a lossless payload in writable, aligned memory
      (an attachment) becomes the tensor itself, without a copy
    """
    if payload is None:
        payload = part.buffer
    buffer = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
    message = TensorMessage(buffer, tuple(part.size), part.dtype, part.compression)
    try:
        if out is None and part.compression == CompressionType.NONE and buffer.flags.writeable:
            header = check_header(message, expected_shape=shape, expected_dtype=dtype)
            values = numpy_dtype(header.dtype_name)
            if buffer.ctypes.data % values.itemsize == 0:
                tensor = torch.from_numpy(buffer.view(values))
                return tensor.view(dtype) if tensor.dtype != dtype else tensor
        return deserialize_torch_tensor(
            message, expected_shape=shape, expected_dtype=dtype, out=out
        )
    except (WireFormatError, ValueError):
        return None


async def run_codec(inline: bool, function, *args):
    """``function(*args)`` on the loop (after a checkpoint, as a thread hop would give) if
    ``inline``, else in a worker thread."""
    if inline:
        await anyio.lowlevel.checkpoint()
        return function(*args)
    return await anyio.to_thread.run_sync(function, *args)


def inline_encode(codec: CompressionBase, part: torch.Tensor) -> bool:
    return type(codec) in INLINE_CODECS and part.numel() * part.element_size() <= INLINE_MAX_BYTES


def inline_decode(part: averaging_pb2.AveragingTensorPart, numel: int) -> bool:
    """Whether to decode on the loop (``numel``: what we expect; a part of another size fails)."""
    return part.compression in INLINE_WIRE_TYPES and numel * 8 <= INLINE_MAX_BYTES


class BufferPool:
    """Spare uint8 arrays by size, for received parts: a fresh multi-megabyte array costs a
    page fault per 4 KiB on first touch, one reused from an earlier part none."""

    def __init__(self, max_cached_bytes: int):
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._cached_bytes = 0

    def take(self, size: int) -> np.ndarray:
        spare = self._free.get(size)
        if spare:
            self._cached_bytes -= size
            return spare.pop()
        return np.empty(size, dtype=np.uint8)

    def give(self, buffer) -> None:
        """Keep ``buffer`` for a later part (its contents are no longer read by anyone)."""
        if not isinstance(buffer, np.ndarray) or buffer.base is not None:
            return  # not one of ours (a view, or the protobuf's bytes)
        if self._cached_bytes + buffer.nbytes <= self.max_cached_bytes:
            self._free.setdefault(buffer.nbytes, []).append(buffer)
            self._cached_bytes += buffer.nbytes
