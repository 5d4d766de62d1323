"""Vectorized table lookups: decode 8-bit and 4-bit indices through a codebook.

numpy's ``take`` converts its whole index array to intp first; looking up in cache-sized slices
avoids that allocation, and looking up *pairs* of 8-bit indices in a 65536-entry table of
float32 pairs halves the number of lookups.
"""

from __future__ import annotations

import numpy as np

__all__ = ["decode_4bit", "decode_8bit", "gather"]

_SLICE = 1 << 15


def gather(table: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = table[indices[i]]`` for flat arrays, in cache-sized slices."""
    count = len(indices)
    for start in range(0, count, _SLICE):
        stop = min(start + _SLICE, count)
        # every index is in range by construction; mode="clip" skips numpy's buffered out
        np.take(table, indices[start:stop], out=out[start:stop], mode="clip")


def decode_8bit(codebook: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = codebook[indices[i]]`` for 256 float32 codes, uint8 indices, float32 out."""
    count = len(indices)
    pairs = count // 2
    if pairs:
        codes = codebook.astype(np.float32)
        table = np.empty((256, 256, 2), dtype=np.float32)
        table[:, :, 0] = codes[None, :]  # little-endian: the first index is the low byte
        table[:, :, 1] = codes[:, None]
        gather(
            table.reshape(-1).view(np.uint64),
            indices[: 2 * pairs].view(np.uint16),
            out[: 2 * pairs].view(np.uint64),
        )
    if count % 2:
        out[-1] = codebook[indices[-1]]


def decode_4bit(codebook: np.ndarray, packed: np.ndarray, out: np.ndarray) -> None:
    """Unpack two 4-bit indices per byte (low nibble first) through 16 float32 codes."""
    count = len(out)
    pairs = count // 2
    codes = codebook.astype(np.float32)
    table = np.empty((16, 16, 2), dtype=np.float32)
    table[:, :, 0] = codes[None, :]
    table[:, :, 1] = codes[:, None]
    pair_codes = table.reshape(-1).view(np.uint64)
    if pairs:
        gather(pair_codes, packed[:pairs], out[: 2 * pairs].view(np.uint64))
    if count % 2:
        out[-1] = codes[packed[pairs] & 0x0F]
