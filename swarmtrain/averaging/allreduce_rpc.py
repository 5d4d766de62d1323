"""What both sides of an all-reduce round use: the runner's members they share
(:class:`RunnerSide`, their base), responses, and reads that wait for the next message with a
deadline that arriving bytes move out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import anyio

from swarmtrain.averaging.allreduce_core import AllReduceCore, AllReduceGroup
from swarmtrain.p2p import PeerID
from swarmtrain.p2p.stall_core import ProgressDeadline
from swarmtrain.proto import averaging_pb2

if TYPE_CHECKING:
    from swarmtrain.averaging.allreduce import AllReduceService

__all__ = ["Code", "RunnerSide"]

Code = averaging_pb2.AveragingCode


class RunnerSide:
    """The members of ``AllReduceRunner`` that its sender and reducer sides share."""

    # set by AllReduceRunner.__init__
    service: AllReduceService
    group: AllReduceGroup[PeerID]

    if TYPE_CHECKING:  # AllReduceRunner's members that both sides use

        @property
        def core(self) -> AllReduceCore: ...

        def _trace(self, kind: str, peer: int, part: int, nbytes: int = 0) -> None: ...

        def _notify(self, completed: tuple[int, ...] = ()) -> None: ...


def _response(
    code: averaging_pb2.AveragingCode, detail: str = "", **kwargs
) -> averaging_pb2.AveragingResponse:
    return averaging_pb2.AveragingResponse(code=code, detail=detail[:1024], **kwargs)


@contextmanager
def _progress_deadline(iterator, deadline: float, patience: float) -> Iterator[anyio.CancelScope]:
    """A cancel scope ending at ``deadline`` that bytes arriving for ``iterator`` (an RPC's
    requests or responses) move out while they keep coming (``ProgressDeadline``: up to
    ``patience`` after the last read, at most one second per ``min_rate`` bytes): a part that
    crawls over a lossy path is not a stalled sender; one that sends nothing still misses
    ``deadline``."""
    guard = ProgressDeadline(deadline, patience)
    with anyio.CancelScope(deadline=deadline) as scope:

        def on_bytes(count: int) -> None:
            scope.deadline = guard.on_bytes(count, anyio.current_time())

        watch = getattr(iterator, "set_on_bytes", None)
        if watch is not None:
            watch(on_bytes)
        try:
            yield scope
        finally:
            if watch is not None:
                watch(None)


async def _next_or_none(iterator):
    """The next item of an async iterator, or None at its end."""
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
