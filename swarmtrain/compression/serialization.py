"""Codec registry and hivemind-style ``serialize_torch_tensor`` / ``deserialize_torch_tensor``."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from swarmtrain.compression.base import CompressionInfo, WireCodec
from swarmtrain.compression.errors import WireFormatError
from swarmtrain.compression.wire import (
    DEFAULT_LIMITS,
    CompressionType,
    Message,
    WireLimits,
    check_header,
)
from swarmtrain.proto import tensor_pb2

__all__ = ["deserialize_torch_tensor", "get_codec", "serialize_torch_tensor"]


@functools.cache
def _registry() -> dict[CompressionType, WireCodec]:
    from swarmtrain.compression.base import NoCompression
    from swarmtrain.compression.blockwise import Blockwise4BitQuantization, BlockwiseQuantization
    from swarmtrain.compression.floating import Float16Compression, ScaledFloat16Compression
    from swarmtrain.compression.quantization import (
        Quantile8BitQuantization,
        Uniform8BitQuantization,
    )
    from swarmtrain.compression.topk import TopKSparsification

    codecs: list[WireCodec] = [
        NoCompression(),
        Float16Compression(),
        ScaledFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
        BlockwiseQuantization(),
        Blockwise4BitQuantization(),
        TopKSparsification(),
    ]
    registry = {codec.compression_type: codec for codec in codecs}
    missing = set(CompressionType) - set(registry)
    if missing:  # pragma: no cover - guards against adding an enum value without a codec
        raise RuntimeError(f"no codec registered for {sorted(missing)}")
    return registry


def get_codec(compression: CompressionType | int) -> WireCodec:
    """The codec that decodes messages of a compression type."""
    try:
        return _registry()[CompressionType(compression)]
    except ValueError:
        raise WireFormatError(f"unknown compression type {compression}") from None


def serialize_torch_tensor(
    tensor: torch.Tensor,
    compression_type: CompressionType | int = CompressionType.NONE,
    info: CompressionInfo | None = None,
    allow_inplace: bool = False,
) -> Message:
    """Encode a tensor with the default codec of ``compression_type``."""
    return get_codec(compression_type).compress(tensor, info, allow_inplace)


def deserialize_torch_tensor(
    message: Message | tensor_pb2.Tensor,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    expected_shape: Sequence[int] | None = None,
    expected_dtype: torch.dtype | None = None,
    as_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a message, validating it against ``limits`` and expectations before allocating.

    :param expected_shape: reject a message of any other shape
    :param expected_dtype: reject a message of any other dtype
    :param as_dtype: convert the result (e.g. ``torch.float32`` to upcast bfloat16); by default
      the sender's dtype is kept
    :param out: decode into this contiguous CPU tensor of the message's shape and dtype
    """
    if isinstance(message, tensor_pb2.Tensor):
        message = Message.from_proto(message)
    check_header(message, limits, expected_shape=expected_shape, expected_dtype=expected_dtype)
    tensor = get_codec(message.compression).extract(message, limits=limits, out=out)
    if as_dtype is not None and as_dtype != tensor.dtype:
        tensor = tensor.detach().to(as_dtype).requires_grad_(tensor.requires_grad)
    return tensor
