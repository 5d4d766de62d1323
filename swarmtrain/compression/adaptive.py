"""Selectors that pick a codec per tensor: by size, by role, or by key."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import SupportsIndex

import torch

from swarmtrain.compression.base import (
    CompressionBase,
    CompressionInfo,
    Key,
    NoCompression,
    TensorRole,
)
from swarmtrain.compression.errors import CompressionError
from swarmtrain.compression.wire import Message

__all__ = [
    "AdaptiveCompressionBase",
    "PerTensorCompression",
    "RoleAdaptiveCompression",
    "SizeAdaptiveCompression",
]


class AdaptiveCompressionBase(CompressionBase):
    """Compress with the codec :meth:`choose` returns; decode any message (see ``extract``)."""

    def choose(self, info: CompressionInfo) -> CompressionBase:
        """The codec for a tensor described by ``info``."""
        raise NotImplementedError

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> Message:
        info = info if info is not None else CompressionInfo.from_tensor(tensor)
        return self.choose(info).compress(tensor, info, allow_inplace)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.choose(info).estimate_compression_ratio(info)


class SizeAdaptiveCompression(AdaptiveCompressionBase):
    """``greater_equal`` for tensors of at least ``threshold`` values, ``less`` otherwise.

    The size is that of the whole tensor (``info.descriptor``), so every part of a split tensor
    uses the same codec.
    """

    def __init__(self, threshold: int, less: CompressionBase, greater_equal: CompressionBase):
        self.threshold, self.less, self.greater_equal = threshold, less, greater_equal

    def choose(self, info: CompressionInfo) -> CompressionBase:
        return self.greater_equal if info.descriptor.numel() >= self.threshold else self.less

    def __repr__(self) -> str:
        return (
            f"SizeAdaptiveCompression({self.threshold}, less={self.less!r}, "
            f"greater_equal={self.greater_equal!r})"
        )


class RoleAdaptiveCompression(AdaptiveCompressionBase):
    """A codec per TensorRole; roles left unset (and UNSPECIFIED) use ``default``."""

    def __init__(
        self,
        *,
        activation: CompressionBase | None = None,
        parameter: CompressionBase | None = None,
        gradient: CompressionBase | None = None,
        optimizer: CompressionBase | None = None,
        default: CompressionBase | None = None,
    ):
        default = default if default is not None else NoCompression()
        self.role_compressions = {
            TensorRole.ACTIVATION: activation or default,
            TensorRole.PARAMETER: parameter or default,
            TensorRole.GRADIENT: gradient or default,
            TensorRole.OPTIMIZER: optimizer or default,
            TensorRole.UNSPECIFIED: default,
        }

    def choose(self, info: CompressionInfo) -> CompressionBase:
        return self.role_compressions[info.role]


class PerTensorCompression(AdaptiveCompressionBase):
    """A codec per tensor key: a sequence indexed by position or a mapping by name."""

    def __init__(
        self, tensor_compressions: Sequence[CompressionBase] | Mapping[Key, CompressionBase]
    ):
        self.tensor_compressions = tensor_compressions

    def choose(self, info: CompressionInfo) -> CompressionBase:
        codecs, key = self.tensor_compressions, info.key
        try:
            if isinstance(codecs, Sequence) and isinstance(key, SupportsIndex):
                return codecs[operator.index(key)]
            if isinstance(codecs, Mapping):
                return codecs[key]
        except (KeyError, IndexError, TypeError):
            pass
        raise CompressionError(f"PerTensorCompression has no codec for key {key!r}")
