"""Counting the pseudo-gradient bytes a DiLoCo peer sends in its all-reduce rounds.

The averaging layer does not report traffic, so :class:`CountingCompression` wraps the codec
the all-reduce uses: every part this peer sends to another reducer passes through its
``compress``, which records the payload size. That half is *counted* (payload bytes exactly as
written into the part messages; protobuf, yamux and Noise framing excluded, a few dozen bytes
per part).

The other half, the averaged deltas this peer returns as a reducer, is serialized by the
all-reduce itself (by codec type, not through our codec object), so it is *computed*:
:meth:`RoundBytes.reducer_estimate` takes the slice we reduced (the fragment's values minus
those we sent to others), times the bytes per value we measured on the sender side, times
the number of other senders in the group (it assumes each of them completed the round).
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

    def reducer_estimate(self, total_values: int, group_size: int, bytes_per_value: float) -> int:
        """Bytes of averaged deltas we sent back to the ``group_size - 1`` other senders.

        :param total_values: values (numel) of all the tensors averaged in the round
        :param bytes_per_value: the codec's wire bytes per value (used if we sent nothing)
        """
        if group_size < 2:
            return 0
        if self.values > 0:
            bytes_per_value = self.payload / self.values
        own_slice = max(0, total_values - self.values)
        return round(own_slice * bytes_per_value * (group_size - 1))


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
