"""Async helpers that run codec work in a worker thread, off the event loop (anyio)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable

import anyio
import anyio.to_thread
import torch

from swarmtrain.compression.base import CompressionBase, CompressionInfo, NoCompression
from swarmtrain.compression.chunking import TensorAssembler
from swarmtrain.compression.wire import DEFAULT_LIMITS, Message, WireLimits
from swarmtrain.proto.tensor_pb2 import Tensor as Chunk

__all__ = ["compress_async", "extract_async", "receive_tensor"]


async def compress_async(
    compression: CompressionBase,
    tensor: torch.Tensor,
    info: CompressionInfo | None = None,
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> Message:
    """``compression.compress(tensor, info)`` in a worker thread."""
    return await anyio.to_thread.run_sync(compression.compress, tensor, info, limiter=limiter)


async def extract_async(
    message: Message | Chunk,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    limiter: anyio.CapacityLimiter | None = None,
) -> torch.Tensor:
    """Decode ``message`` (any codec) in a worker thread, checking ``limits`` first."""
    extract = functools.partial(NoCompression().extract, message, limits=limits)
    return await anyio.to_thread.run_sync(extract, limiter=limiter)


async def receive_tensor(
    chunks: AsyncIterable[Chunk],
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    limiter: anyio.CapacityLimiter | None = None,
) -> torch.Tensor:
    """Reassemble one chunked tensor (validated before allocating) and decode it off the loop.

    Reading stops after the tensor's last chunk, so a stream may carry several tensors.
    """
    assembler = TensorAssembler(limits)
    message = None
    async for chunk in chunks:
        message = assembler.feed(chunk)
        if message is not None:
            break
    assembler.finish()  # raises when the stream ended early
    if message is None:
        raise RuntimeError("unreachable: an incomplete stream raised above")
    return await extract_async(message, limits=limits, limiter=limiter)
