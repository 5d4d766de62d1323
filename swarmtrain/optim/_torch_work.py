"""Where the optimizer's torch work at an epoch end runs: in place when it is small.

A thread hop (``trio.to_thread``: wake a worker, then wake the loop again) costs 2-46 ms on a
busy box, far more than an optimizer step or a copy of a small CPU model (RESULTS: "epoch-end
hops"), and an epoch end took four of them. :class:`TorchWork` runs such work in place, on the
loop (as the averager's small copies do: ``async_averager.INLINE_COPY_MAX_BYTES``), when the
tensors are small CPU tensors and none of the locks guarding them is held at that moment; else
(GPU tensors, larger models, a lock held by a thread, a lock that cannot say whether it is held,
e.g. a helper process's) in a worker thread, so the loop never waits for a lock or for long
work. Lock holders are short torch work that never waits for the loop, so a thread that takes
a lock between the check and the work delays the loop by that work at most.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import trio

__all__ = ["INLINE_TORCH_MAX_BYTES", "TorchWork", "small_cpu_tensors"]

T = TypeVar("T")

#: CPU tensors of up to this many bytes in all (the parameters and the optimizer's copies):
#: their optimizer step and copies run in place (Adam on 256k fp32 values: well under 1 ms)
INLINE_TORCH_MAX_BYTES = 1 << 20


def small_cpu_tensors(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether ``tensors`` are all on CPU and at most ``INLINE_TORCH_MAX_BYTES`` in all."""
    nbytes = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            return False
        nbytes += tensor.numel() * tensor.element_size()
    return nbytes <= INLINE_TORCH_MAX_BYTES


def _free(lock: Any) -> bool:
    locked = getattr(lock, "locked", None)
    return locked is not None and not locked()


class TorchWork:
    """Runs torch work for the loop: in place if ``in_place`` and every lock of ``locks`` is
    free now, else in a worker thread (``TorchWork()``: always a thread)."""

    def __init__(self, in_place: bool = False, locks: Sequence[Any] = ()):
        self.in_place, self.locks = in_place, tuple(locks)
        self.ran_in_place = 0  #: calls that ran in place (statistics)
        self.ran_in_thread = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``; a cancellation point before it starts, like ``trio.to_thread``."""
        if self.in_place and all(_free(lock) for lock in self.locks):
            await trio.lowlevel.checkpoint_if_cancelled()
            self.ran_in_place += 1
            return fn(*args)
        self.ran_in_thread += 1
        return await trio.to_thread.run_sync(fn, *args)
