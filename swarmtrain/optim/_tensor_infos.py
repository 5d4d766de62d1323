"""Give a codec selector the key and role of each averaged tensor.

All-reduce names a tensor by its position only (``CompressionInfo.key`` is the index into the
averaged tensors, the role is UNSPECIFIED). The optimizer averagers know more: which tensors
are parameters, gradients or optimizer statistics, and their names. ``tag_compression`` wraps a
selector (``RoleAdaptiveCompression``, ``PerTensorCompression``, ...) so that it sees that;
plain codecs ignore ``info`` and are returned as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from swarmtrain.compression import AdaptiveCompressionBase, CompressionBase, CompressionInfo
from swarmtrain.compression.wire import Message

__all__ = ["TaggedCompression", "tag_compression"]


class TaggedCompression(CompressionBase):
    """``inner``, called with ``infos[i]``'s key and role for the tensor at index ``i``."""

    def __init__(self, inner: CompressionBase, infos: Sequence[CompressionInfo]):
        self.inner = inner
        self.infos = tuple(infos)

    def _tag(self, info: CompressionInfo | None) -> CompressionInfo | None:
        if info is None:
            return None
        index = info.key
        if isinstance(index, bool) or not isinstance(index, int):
            return info
        if not 0 <= index < len(self.infos):
            return info
        known = self.infos[index]
        return dataclasses.replace(info, key=known.key, role=known.role)

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> Message:
        return self.inner.compress(tensor, self._tag(info), allow_inplace)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        tagged = self._tag(info)
        assert tagged is not None  # _tag maps an info to an info
        return self.inner.estimate_compression_ratio(tagged)

    def __repr__(self) -> str:
        return f"{self.inner!r} (tagged with {len(self.infos)} tensor roles)"


def tag_compression(codec: CompressionBase, infos: Sequence[CompressionInfo]) -> CompressionBase:
    """``codec`` wrapped in :class:`TaggedCompression` if it is a selector, else ``codec``."""
    if isinstance(codec, AdaptiveCompressionBase):
        return TaggedCompression(codec, infos)
    return codec
