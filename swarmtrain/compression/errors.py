"""Exceptions raised by swarmtrain.compression."""

from __future__ import annotations

__all__ = ["CompressionError", "WireFormatError", "WireLimitError"]


class CompressionError(ValueError):
    """A codec cannot encode the given tensor (wrong device, unsupported dtype, bad option)."""


class WireFormatError(ValueError):
    """A message or stream is malformed: bad header, wrong payload size, truncated or corrupted."""


class WireLimitError(WireFormatError):
    """A well-formed header asks for more than the receiver's WireLimits allow."""
