"""Tensor wire format: dtype table, receiver limits and header validation.

A ``swarmtrain.Tensor`` message carries ``dtype`` (a torch dtype name), ``size`` (the shape),
``requires_grad``, ``compression`` and ``buffer`` (the codec payload, little-endian).
:func:`check_header` validates everything a receiver must know *before* it allocates:
dtype, rank, element count, decoded size and payload size against a :class:`WireLimits`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import torch

from swarmtrain.compression.errors import WireFormatError, WireLimitError
from swarmtrain.proto import tensor_pb2

__all__ = [
    "DEFAULT_LIMITS",
    "CompressionType",
    "Message",
    "TensorMessage",
    "TensorHeader",
    "WireLimits",
    "check_header",
    "dtype_from_name",
    "dtype_name",
    "make_message",
    "tensor_to_numpy",
]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("swarmtrain.compression assumes a little-endian host")

_MAX_DIM = 1 << 62


class CompressionType(IntEnum):
    """Codec identifiers; values equal ``swarmtrain.CompressionType`` in proto/tensor.proto."""

    NONE = 0
    FLOAT16 = 1
    MEANSTD_16BIT = 2
    UNIFORM_8BIT = 3
    QUANTILE_8BIT = 4
    BLOCKWISE_8BIT = 5
    BLOCKWISE_4BIT = 6
    TOPK = 7

    # The protobuf enum helpers hivemind's CompressionType (a protobuf enum) offers.
    @classmethod
    def values(cls) -> list[CompressionType]:
        """Every codec identifier, in value order."""
        return list(cls)

    @classmethod
    def keys(cls) -> list[str]:
        """Every codec name, in value order."""
        return [member.name for member in cls]

    @classmethod
    def items(cls) -> list[tuple[str, CompressionType]]:
        return [(member.name, member) for member in cls]

    @classmethod
    def Name(cls, number: int) -> str:  # protobuf enum spelling
        """The name of codec ``number`` (``ValueError`` if there is none)."""
        return cls(number).name

    @classmethod
    def Value(cls, name: str) -> CompressionType:  # protobuf enum spelling
        """The codec called ``name`` (``ValueError`` if there is none)."""
        try:
            return cls[name]
        except KeyError:
            raise ValueError(f"no CompressionType named {name!r}") from None


@dataclasses.dataclass(eq=False)
class TensorMessage:
    """One encoded tensor: the ``swarmtrain.Tensor`` header fields plus the payload.

    The payload is a flat uint8 numpy array rather than ``bytes`` inside a protobuf: numpy
    allocates large buffers in huge pages, while a fresh multi-megabyte ``bytes`` object costs a
    page fault per 4 KiB (75 ms for 64 MB here).  Convert with :meth:`to_proto` /
    :meth:`from_proto`, or stream it with ``split_for_streaming``.
    """

    buffer: np.ndarray
    size: tuple[int, ...]
    dtype: str
    #: a CompressionType value; as received, any int (check_header turns it into the enum)
    compression: int
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return int(self.buffer.nbytes)

    def to_proto(self) -> tensor_pb2.Tensor:
        """A whole (not chunked) protobuf message; copies the payload."""
        return tensor_pb2.Tensor(
            buffer=self.buffer.tobytes(),
            size=self.size,
            dtype=self.dtype,
            # protoc's .pyi types enum fields as their enum class, whose values are plain ints
            compression=int(self.compression),  # type: ignore[arg-type]
            requires_grad=self.requires_grad,
        )

    @classmethod
    def from_proto(cls, message: tensor_pb2.Tensor) -> TensorMessage:
        """Wrap a whole protobuf message (its payload becomes a read-only array).

        :raises WireFormatError: the message is one chunk of a stream
        """
        if message.chunks > 1 or message.chunk_index:
            raise WireFormatError(
                "message is one chunk of a stream; reassemble it with TensorAssembler first"
            )
        return cls(
            np.frombuffer(message.buffer, dtype=np.uint8),
            tuple(message.size),
            message.dtype,
            message.compression,  # validated by check_header
            message.requires_grad,
        )


Message = TensorMessage


# name -> (torch dtype, numpy dtype with the same bytes); bfloat16 travels as its raw 16 bits
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "complex128": (torch.complex128, np.dtype("<c16")),
    "complex64": (torch.complex64, np.dtype("<c8")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; raises WireFormatError for dtypes the wire does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WireFormatError(f"dtype {dtype} is not supported on the wire") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype for a wire name; raises WireFormatError for unknown names."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise WireFormatError(f"unknown dtype {name[:40]!r} in tensor header") from None


def numpy_dtype(name: str) -> np.dtype:
    """Numpy dtype with the same bytes as the wire dtype (int16 for bfloat16)."""
    return _DTYPES[name][1]


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's bytes (bfloat16 viewed as int16)."""
    tensor = tensor.detach().reshape(-1)
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts; checked before anything is allocated.

    :param max_bytes: largest decoded tensor, in bytes
    :param max_buffer_bytes: largest codec payload (the sum of all chunks), in bytes
    :param max_ndim: largest rank
    :param max_chunks: most chunks in one streamed tensor
    :param dtypes: dtype names accepted (None: every wire dtype)
    :param compressions: codecs accepted (None: every codec)
    """

    max_bytes: int = 1 << 31
    max_buffer_bytes: int = (1 << 31) + (1 << 20)
    max_ndim: int = 32
    max_chunks: int = 1 << 20
    dtypes: frozenset[str] | None = None
    compressions: frozenset[CompressionType] | None = None

    def __post_init__(self) -> None:
        for field in ("max_bytes", "max_buffer_bytes", "max_ndim", "max_chunks"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"WireLimits.{field} must be a non-negative int, got {value!r}")


DEFAULT_LIMITS = WireLimits()


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """A validated tensor header."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dtype_name: str
    compression: CompressionType
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPES[self.dtype_name][1].itemsize


def check_header(
    message: TensorMessage | tensor_pb2.Tensor,
    limits: WireLimits = DEFAULT_LIMITS,
    *,
    buffer_size: int | None = None,
    expected_shape: Sequence[int] | None = None,
    expected_dtype: torch.dtype | None = None,
) -> TensorHeader:
    """Validate a message's header against ``limits`` (and expectations) without allocating.

    :param buffer_size: payload bytes to check (default: ``len(message.buffer)``)
    :raises WireLimitError: the header is valid but exceeds ``limits``
    :raises WireFormatError: the header is malformed or inconsistent with the payload size
    """
    from swarmtrain.compression.serialization import get_codec  # codecs import this module

    if len(message.size) > limits.max_ndim:
        raise WireLimitError(f"tensor has {len(message.size)} dims, limit is {limits.max_ndim}")
    shape = tuple(int(dim) for dim in message.size)
    if any(dim > _MAX_DIM for dim in shape):
        raise WireLimitError(f"tensor dimension above {_MAX_DIM} in shape {_short(shape)}")
    name = message.dtype
    dtype = dtype_from_name(name)
    if limits.dtypes is not None and name not in limits.dtypes:
        raise WireLimitError(f"dtype {name} is not accepted here")
    try:
        compression = CompressionType(message.compression)
    except ValueError:
        raise WireFormatError(f"unknown compression type {message.compression}") from None
    if limits.compressions is not None and compression not in limits.compressions:
        raise WireLimitError(f"compression {compression.name} is not accepted here")
    header = TensorHeader(shape, dtype, name, compression, bool(message.requires_grad))
    if header.nbytes > limits.max_bytes:
        raise WireLimitError(
            f"tensor of shape {_short(shape)} and dtype {name} needs {header.nbytes} bytes, "
            f"limit is {limits.max_bytes}"
        )
    if header.requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise WireFormatError(f"requires_grad is set on a {name} tensor")
    if expected_shape is not None and shape != tuple(expected_shape):
        raise WireFormatError(f"expected shape {tuple(expected_shape)}, got {_short(shape)}")
    if expected_dtype is not None and dtype != expected_dtype:
        raise WireFormatError(f"expected dtype {expected_dtype}, got {dtype}")
    size = _payload_size(message) if buffer_size is None else buffer_size
    if size > limits.max_buffer_bytes:
        raise WireLimitError(f"payload of {size} bytes, limit is {limits.max_buffer_bytes}")
    low, high = get_codec(compression).payload_bounds(header)
    if not low <= size <= high:
        expected = f"{low}" if low == high else f"{low}..{high}"
        raise WireFormatError(
            f"{compression.name} payload for shape {_short(shape)} ({name}) must be "
            f"{expected} bytes, got {size}"
        )
    return header


def make_message(
    parts: Sequence[bytes | np.ndarray],
    shape: Sequence[int],
    dtype: torch.dtype,
    compression: CompressionType,
    requires_grad: bool,
) -> TensorMessage:
    """Build a message whose payload is ``parts`` concatenated (one copy, numpy memory)."""
    arrays = [
        np.frombuffer(part, dtype=np.uint8) if isinstance(part, bytes) else part for part in parts
    ]
    views = [array.reshape(-1).view(np.uint8) for array in arrays]
    buffer = np.empty(sum(view.nbytes for view in views), dtype=np.uint8)
    position = 0
    for view in views:
        buffer[position : position + view.nbytes] = view
        position += view.nbytes
    return TensorMessage(buffer, tuple(shape), dtype_name(dtype), compression, requires_grad)


def _payload_size(message: TensorMessage | tensor_pb2.Tensor) -> int:
    buffer = message.buffer
    return buffer.nbytes if isinstance(buffer, np.ndarray) else len(buffer)


def _short(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "..."
