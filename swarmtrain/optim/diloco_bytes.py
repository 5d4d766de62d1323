"""Counting the pseudo-gradient bytes a DiLoCo peer sends in its all-reduce rounds.

:class:`CountingCompression` wraps the codec the all-reduce uses: every part this peer sends to
another reducer passes through its ``compress``, which records the payload size (payload bytes
exactly as written into the part messages; protobuf, yamux and Noise framing excluded, a few
dozen bytes per part). The averager reports everything it sent
(``DecentralizedAverager.payload_bytes_sent``): the rest is the averaged deltas this peer
returned as a reducer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from swarmtrain.compression import CompressionBase, CompressionInfo

__all__ = ["CountingCompression", "RoundBytes"]


@dataclass(frozen=True)
class RoundBytes:
    """What one all-reduce round wrote as a sender: ``payload`` bytes carrying ``values``."""

    payload: int = 0
    values: int = 0

    def __sub__(self, other: RoundBytes) -> RoundBytes:
        return RoundBytes(self.payload - other.payload, self.values - other.values)


class CountingCompression(CompressionBase):
    """``codec`` for everything, and a thread-safe count of what its ``compress`` produced.

    Decoding goes through the wire format's codec registry, so a peer that uses this wrapper
    averages with peers that use ``codec`` itself.
    """

    def __init__(self, codec: CompressionBase):
        if not isinstance(codec, CompressionBase):
            raise TypeError("codec must be a swarmtrain.compression codec")
        self.codec = codec
        self._lock = threading.Lock()
        self._payload = 0
        self._values = 0

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ):
        message = self.codec.compress(tensor, info, allow_inplace)
        with self._lock:
            self._payload += message.nbytes
            self._values += tensor.numel()
        return message

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.estimate_compression_ratio(info)

    def snapshot(self) -> RoundBytes:
        """Totals so far; subtract two snapshots to get one round's."""
        with self._lock:
            return RoundBytes(self._payload, self._values)

    def __repr__(self) -> str:
        return f"CountingCompression({self.codec!r})"
