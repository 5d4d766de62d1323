"""Cache-sized passes over large tensors.

Full-size elementwise passes each stream the whole tensor through memory (about 8 ms per
64 MB here) and need full-size float32 scratch.  The codecs instead run their few elementwise
steps on one CHUNK-sized slice at a time, in a scratch block that stays in L2 cache, so a
tensor is read from memory once per pass and written once.

Each step is a single-threaded numpy ufunc with ``out=``.  Measured on the shared 2-core
machines: torch's OpenMP parallel regions over small slices stall whenever the other core is
busy (1-8 ms per region), and splitting chunks among Python threads lost to one thread under
load (GIL hand-offs between the short steps).  The one step numpy lacks, a vectorized
float32 <-> float16 cast, goes through torch on pieces below its 32768-element parallel grain,
so that it too runs in the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from swarmtrain.compression._buffers import scratch

__all__ = ["CHUNK", "HALF_PIECE", "blocks", "cast", "copy", "map_all", "map_chunks", "spans"]

CHUNK = 1 << 16  # elements per pass step: 256 KiB of float32
HALF_PIECE = 1 << 14  # elements per torch cast: below torch's parallel grain (32768)

Item = TypeVar("Item")
Result = TypeVar("Result")


def spans(count: int, size: int = CHUNK) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of at most ``size`` covering ``range(count)``."""
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def blocks(rows: int, last: int) -> list[tuple[int, int, int, int]]:
    """``(r0, r1, c0, c1)`` blocks of about CHUNK values of a rows x last array, in order:
    groups of whole rows, or pieces of one row when rows are longer than CHUNK."""
    if last >= CHUNK:
        return [(row, row + 1, c0, c1) for row in range(rows) for c0, c1 in spans(last)]
    if not last:
        return []
    return [(r0, r1, 0, last) for r0, r1 in spans(rows, CHUNK // last)]


def cast(source: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = source`` for flat arrays, any dtype conversion, in the calling thread."""
    for start in range(0, len(source), HALF_PIECE):
        stop = start + HALF_PIECE
        torch.from_numpy(out[start:stop]).copy_(torch.from_numpy(source[start:stop]))


def copy(source: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(source)`` for contiguous CPU tensors of one size, in the calling thread."""
    source, out = source.reshape(-1), out.view(-1)
    for start in range(0, len(source), HALF_PIECE):
        out[start : start + HALF_PIECE].copy_(source[start : start + HALF_PIECE])


def map_all(
    task: Callable[[Item, np.ndarray], Result],
    items: Sequence[Item],
    work_items: int = CHUNK,
) -> list[Result]:
    """``[task(item, work) for item in items]`` in the calling thread, every item (a task
    that returns False does not stop it); ``work`` as in :func:`map_chunks`."""
    if not items:
        return []
    with scratch(work_items) as work_t, np.errstate(all="ignore"):
        work = work_t.numpy()
        return [task(item, work) for item in items]


def map_chunks(
    task: Callable[[Item, np.ndarray], Result],
    items: Sequence[Item],
    work_items: int = CHUNK,
) -> list[Result | None]:
    """``[task(item, work) for item in items]`` in the calling thread.

    ``work`` is a float32 scratch array of ``work_items`` values; tasks run with numpy's
    floating-point warnings off.  A task returning ``False`` stops the loop; the items not run
    get None.
    """
    results: list[Result | None] = [None] * len(items)
    if not items:
        return results
    with scratch(work_items) as work_t, np.errstate(all="ignore"):
        work = work_t.numpy()
        for index, item in enumerate(items):
            result = results[index] = task(item, work)
            if result is False:
                break
    return results
