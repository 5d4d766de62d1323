"""Codec interface, tensor metadata and the lossless codec.

Every codec turns a tensor into a ``swarmtrain.Tensor`` message with :meth:`compress` and back
with :meth:`extract`.  ``extract`` validates the header against :class:`WireLimits` first and
decodes whatever codec the message names, so any codec instance can decode any message.

Non-finite values (documented per codec, tested in tests/test_compression_edge.py):
lossless and float16 codecs keep NaN and +-Inf; codecs that share one statistic over a group of
values (a block, a row, the whole tensor) decode that whole group as NaN when it holds NaN or Inf.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
import torch

from swarmtrain.compression._buffers import empty_tensor
from swarmtrain.compression.errors import CompressionError, WireFormatError
from swarmtrain.compression.wire import (
    DEFAULT_LIMITS,
    CompressionType,
    Message,
    TensorHeader,
    WireLimits,
    check_header,
    dtype_name,
    make_message,
    numpy_dtype,
    tensor_to_numpy,
)
from swarmtrain.proto import tensor_pb2

__all__ = [
    "CompressionBase",
    "CompressionInfo",
    "Key",
    "NoCompression",
    "TensorDescriptor",
    "TensorRole",
    "WireCodec",
]

Key = Hashable


class TensorRole(enum.Enum):
    """What a tensor is to the model; RoleAdaptiveCompression picks a codec by it."""

    ACTIVATION = enum.auto()
    PARAMETER = enum.auto()
    GRADIENT = enum.auto()
    OPTIMIZER = enum.auto()
    UNSPECIFIED = enum.auto()


@dataclasses.dataclass(frozen=True)
class TensorDescriptor:
    """Shape, dtype and requires_grad of a tensor, without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDescriptor:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class CompressionInfo:
    """What a selector needs to choose a codec for one tensor (or one part of it).

    :param key: name or index of the tensor (parameter name, optimizer-state index, ...)
    :param descriptor: shape and dtype of the *whole* tensor, even when a part is compressed
    :param role: the tensor's role in training
    :param part_index: index of this part when the tensor is split into parts
    :param part_size: the largest number of values in one part, if split
    :param part_offset: where this part starts in the flattened tensor, if split (identifies
      the part across calls, e.g. for error feedback, even when part indices are per peer)
    """

    key: Key
    descriptor: TensorDescriptor
    role: TensorRole = TensorRole.UNSPECIFIED
    part_index: int = 0
    part_size: int | None = None
    part_offset: int | None = None

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        key: Key = None,
        descriptor: TensorDescriptor | None = None,
        **kwargs: Any,
    ) -> CompressionInfo:
        return cls(key, descriptor or TensorDescriptor.from_tensor(tensor), **kwargs)

    def get_part(self, part_index: int, part_size: int | None) -> CompressionInfo:
        return dataclasses.replace(self, part_index=part_index, part_size=part_size)


class CompressionBase(ABC):
    """A compression strategy: ``compress(tensor, info=None) -> message``, ``extract(message)``.

    Codecs and selectors hold no per-call state, so one instance may serve several threads.
    """

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> Message:
        """Encode ``tensor`` (any device; the message is built on the CPU).

        :param info: metadata about the tensor; selectors use it, plain codecs ignore it
        :param allow_inplace: the codec may overwrite ``tensor`` to save memory
        """

    def extract(
        self,
        message: Message | tensor_pb2.Tensor,
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode a message from any codec, checking it against ``limits`` before allocating.

        :param out: a contiguous CPU tensor of the message's shape and dtype to decode into
        :raises WireFormatError: malformed message (WireLimitError: over ``limits``)
        """
        from swarmtrain.compression.serialization import get_codec

        if isinstance(message, tensor_pb2.Tensor):
            message = Message.from_proto(message)
        header = check_header(message, limits)
        if out is not None:
            _check_out(out, header)
        tensor = get_codec(header.compression)._decode(header, message.buffer, out)
        if header.requires_grad:
            tensor.requires_grad_(True)
        return tensor

    @abstractmethod
    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Approximate wire size over raw size; lower is better."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class WireCodec(CompressionBase):
    """A codec with its own CompressionType and payload layout.

    Subclasses implement :meth:`_encode`, :meth:`_decode` and :meth:`payload_bounds`.
    """

    compression_type: ClassVar[CompressionType]
    #: lossy codecs send integer, bool and complex tensors uncompressed instead of failing
    floating_only: ClassVar[bool] = True

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> Message:
        if not isinstance(tensor, torch.Tensor):
            raise CompressionError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        try:
            dtype_name(tensor.dtype)
        except WireFormatError as e:
            raise CompressionError(str(e)) from None
        if self.floating_only and not tensor.dtype.is_floating_point:
            return NoCompression()._encode(tensor, allow_inplace)
        return self._encode(tensor, allow_inplace)

    @abstractmethod
    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        """Encode a tensor of a supported dtype (floating point unless ``floating_only``)."""

    @abstractmethod
    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Decode a payload whose size :meth:`payload_bounds` accepted; validate the rest."""

    @abstractmethod
    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        """The smallest and largest valid payload size for a header, in bytes."""


class NoCompression(WireCodec):
    """Lossless: the tensor's own bytes, for every wire dtype (bfloat16 stays 16-bit)."""

    compression_type = CompressionType.NONE
    floating_only = False

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Message:
        source = cpu_contiguous(tensor)
        return make_message(
            [tensor_to_numpy(source)],
            tensor.shape,
            tensor.dtype,
            self.compression_type,
            tensor.requires_grad,
        )

    def _decode(
        self, header: TensorHeader, buffer: np.ndarray, out: torch.Tensor | None
    ) -> torch.Tensor:
        if header.dtype == torch.bool:
            check_bool_bytes(buffer)
        result = out if out is not None else empty_tensor(header.shape, header.dtype)
        if header.numel:
            source = np.frombuffer(buffer, dtype=numpy_dtype(header.dtype_name))
            np.copyto(tensor_to_numpy(result), source)
        return result

    def payload_bounds(self, header: TensorHeader) -> tuple[int, int]:
        return header.nbytes, header.nbytes

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


def check_bool_bytes(data: np.ndarray) -> None:
    """Raise WireFormatError unless every byte is 0 or 1 (a torch.bool tensor holding any other
    byte behaves inconsistently: ``t == True`` is False, ``t.sum()`` counts the byte)."""
    values = np.frombuffer(data, dtype=np.uint8)
    if values.size and int(values.max()) > 1:
        raise WireFormatError("a bool tensor's payload holds a byte other than 0 and 1")


def cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, on the CPU and contiguous (a view when it already is)."""
    return tensor.detach().cpu().contiguous()


def _check_out(out: torch.Tensor, header: TensorHeader) -> None:
    if (
        tuple(out.shape) != header.shape
        or out.dtype != header.dtype
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous CPU tensor of shape {header.shape} and dtype "
            f"{header.dtype}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.requires_grad:
        raise ValueError("out must not require grad")
