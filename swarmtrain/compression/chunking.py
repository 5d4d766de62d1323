"""Chunked streaming of one tensor message, and its reassembly.

The first chunk carries the whole header plus ``chunks`` (how many messages), ``buffer_size``
(total payload bytes) and optionally ``crc32``; every chunk carries ``chunk_index`` and a slice
of the payload; later chunks carry nothing else.  :class:`TensorAssembler` is a sans-IO
receiver: it validates the first chunk's header against :class:`WireLimits` *before*
allocating the declared buffer, then rejects out-of-order, oversized, truncated or corrupted
streams with :class:`WireFormatError`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from swarmtrain.compression.errors import WireFormatError, WireLimitError
from swarmtrain.compression.wire import (
    DEFAULT_LIMITS,
    CompressionType,
    TensorMessage,
    WireLimits,
    check_header,
)
from swarmtrain.proto.tensor_pb2 import Tensor as Chunk

__all__ = ["DEFAULT_CHUNK_SIZE", "TensorAssembler", "combine_from_streaming", "split_for_streaming"]

DEFAULT_CHUNK_SIZE = 1 << 20
_HEADER_FIELDS = ("size", "dtype", "compression", "requires_grad", "chunks", "buffer_size")


def split_for_streaming(
    message: TensorMessage | Chunk, chunk_size: int = DEFAULT_CHUNK_SIZE, *, checksum: bool = True
) -> Iterator[Chunk]:
    """Yield ``message`` as protobuf chunks of at most ``chunk_size`` payload bytes (at least one).

    :param checksum: put zlib.crc32 of the payload into the first chunk (about 4 GB/s)
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if isinstance(message, Chunk):
        message = TensorMessage.from_proto(message)
    buffer = message.buffer
    total = buffer.nbytes
    count = max(1, -(-total // chunk_size))
    first = Chunk(
        buffer=buffer[:chunk_size].tobytes(),
        size=message.size,
        dtype=message.dtype,
        # protoc's .pyi types enum fields as their enum class, whose values are plain ints
        compression=int(message.compression),  # type: ignore[arg-type]
        requires_grad=message.requires_grad,
        chunks=count,
        chunk_index=0,
        buffer_size=total,
    )
    if checksum:
        first.crc32 = zlib.crc32(buffer.data)
    yield first
    for index in range(1, count):
        start = index * chunk_size
        yield Chunk(buffer=buffer[start : start + chunk_size].tobytes(), chunk_index=index)


class TensorAssembler:
    """Reassemble one chunked tensor message: ``feed`` chunks until it returns the message.

    :param limits: what the first chunk's header may declare
    :param expected_shape: reject any other shape (checked on the first chunk)
    :param expected_dtype: reject any other dtype (checked on the first chunk)
    """

    def __init__(
        self,
        limits: WireLimits = DEFAULT_LIMITS,
        *,
        expected_shape: Sequence[int] | None = None,
        expected_dtype: torch.dtype | None = None,
    ):
        self.limits = limits
        self._expected_shape, self._expected_dtype = expected_shape, expected_dtype
        self._header: Chunk | None = None
        self._buffer: np.ndarray | None = None
        self._filled = 0
        self._next_index = 0
        self._crc = 0
        self._done = False

    @property
    def done(self) -> bool:
        """Whether the last chunk has arrived."""
        return self._done

    def feed(self, chunk: Chunk) -> TensorMessage | None:
        """Take the next chunk; return the whole message after the last one, else None."""
        if self._done:
            raise WireFormatError("chunk received after the stream was complete")
        if chunk.chunk_index != self._next_index:
            raise WireFormatError(
                f"expected chunk {self._next_index}, got chunk {chunk.chunk_index} (out of order "
                "or lost)"
            )
        if self._header is None:
            return self._first(chunk)
        if chunk.HasField("crc32") or any(getattr(chunk, field) for field in _HEADER_FIELDS):
            raise WireFormatError(f"chunk {chunk.chunk_index} repeats header fields")
        self._append(chunk.buffer)
        return self._maybe_finish()

    def _first(self, chunk: Chunk) -> TensorMessage | None:
        if chunk.chunks == 0:  # a whole message, not chunked
            check_header(chunk, self.limits, **self._expectations())
            self._done = True
            return TensorMessage.from_proto(chunk)
        if chunk.chunks > self.limits.max_chunks:
            raise WireLimitError(f"stream of {chunk.chunks} chunks, limit {self.limits.max_chunks}")
        declared = chunk.buffer_size
        check_header(chunk, self.limits, buffer_size=declared, **self._expectations())
        self._header = chunk
        self._buffer = np.empty(declared, dtype=np.uint8)  # bounded by check_header
        self._append(chunk.buffer)
        return self._maybe_finish()

    def _append(self, data: bytes) -> None:
        if self._buffer is None or self._header is None:
            raise RuntimeError("no stream in progress")
        end = self._filled + len(data)
        if end > self._buffer.nbytes:
            raise WireFormatError(
                f"chunk {self._next_index} overruns the declared buffer_size {self._buffer.nbytes}"
            )
        self._buffer[self._filled : end] = np.frombuffer(data, dtype=np.uint8)
        if self._header.HasField("crc32"):
            self._crc = zlib.crc32(data, self._crc)
        self._filled = end
        self._next_index += 1

    def _maybe_finish(self) -> TensorMessage | None:
        header, buffer = self._header, self._buffer
        if header is None or buffer is None:
            raise RuntimeError("no stream in progress")
        if self._next_index < header.chunks:
            return None
        if self._filled != buffer.nbytes:
            raise WireFormatError(
                f"stream truncated: {self._filled} of {buffer.nbytes} payload bytes in "
                f"{header.chunks} chunks"
            )
        if header.HasField("crc32") and self._crc != header.crc32:
            raise WireFormatError("stream corrupted: payload crc32 does not match")
        self._done = True
        self._buffer = None
        return TensorMessage(
            buffer,
            tuple(header.size),
            header.dtype,
            CompressionType(header.compression),
            header.requires_grad,
        )

    def finish(self) -> None:
        """Call when the stream ends: raises WireFormatError unless the last chunk arrived."""
        if not self._done:
            got = self._next_index
            total = self._header.chunks if self._header is not None else "?"
            raise WireFormatError(f"stream truncated: ended after {got} of {total} chunks")

    def _expectations(self) -> dict:
        return {"expected_shape": self._expected_shape, "expected_dtype": self._expected_dtype}


def combine_from_streaming(
    chunks: Iterable[Chunk],
    limits: WireLimits = DEFAULT_LIMITS,
    *,
    expected_shape: Sequence[int] | None = None,
    expected_dtype: torch.dtype | None = None,
) -> TensorMessage:
    """Reassemble a whole chunk sequence; raises WireFormatError if it is truncated or has extra
    chunks."""
    assembler = TensorAssembler(
        limits, expected_shape=expected_shape, expected_dtype=expected_dtype
    )
    result = None
    for chunk in chunks:
        result = assembler.feed(chunk)
    assembler.finish()
    if result is None:  # unreachable: finish() raised
        raise WireFormatError("stream truncated")
    return result
