"""Where the optimizer's torch work at an epoch end runs: on the loop when it is small.

A thread hop (``trio.to_thread``: wake a worker, then wake the loop again) costs 2-46 ms on a
busy box (RESULTS: "epoch-end hops"), far more than an optimizer step or a copy of a small CPU
model; an epoch end took four of them. Small CPU work therefore runs in place, on the loop (as
the averager's small copies do: ``async_averager.INLINE_COPY_MAX_BYTES``); anything else
(GPU tensors, larger models) still runs in a worker thread, so the loop keeps serving peers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import trio

__all__ = ["INLINE_TORCH_MAX_BYTES", "run_torch_work", "torch_work_on_loop"]

T = TypeVar("T")

#: CPU tensors of up to this many bytes in all (parameters, or the optimizer's copies): their
#: optimizer step and copies run on the loop (Adam on 256k fp32 values: well under 1 ms)
INLINE_TORCH_MAX_BYTES = 1 << 20


def torch_work_on_loop(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether torch work over ``tensors`` runs on the loop: all on CPU, small in all."""
    nbytes = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            return False
        nbytes += tensor.numel() * tensor.element_size()
    return nbytes <= INLINE_TORCH_MAX_BYTES


async def run_torch_work(on_loop: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` here (``on_loop``: no thread hop; still a cancellation point before it
    starts, like ``trio.to_thread.run_sync``) or in a worker thread."""
    if on_loop:
        await trio.lowlevel.checkpoint_if_cancelled()
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)
