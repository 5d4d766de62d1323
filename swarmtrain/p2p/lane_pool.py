"""The caller's pool of idle bulk streams: each data lane is reused for its own reuse time.

A lane is kept as long as its callee keeps it idle (the ticket's ``idle_timeout``, minutes;
an older callee's 30 s: longer the dearer it was to open), so it outlives the gaps between
slow rounds; a libp2p stream is not dear to open. The pool's outer bound is
``LANE_REUSE_LIMIT``; a stream is reused only while it has been idle for less than its own
``reuse_time`` (``lane_books.lane_reuse_time``; a libp2p stream and a lane without one:
``default_reuse_time``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import trio

from swarmtrain.p2p.lane_books import MAX_LANE_IDLE_TIMEOUT
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME
from swarmtrain.p2p.rpc_client import OpenStream, StreamPool
from swarmtrain.p2p.rpc_stream import RPCStream

#: no idle stream of the bulk pool is reused after this long (the longest idle timeout a
#: callee's ticket may grant)
LANE_REUSE_LIMIT = MAX_LANE_IDLE_TIMEOUT


class BulkStreamPool(StreamPool):
    """``StreamPool`` whose idle streams are reused each for its own time (see the module)."""

    def __init__(
        self,
        open_stream: OpenStream,
        *,
        preferred: Callable[[RPCStream], bool] | None = None,
        still_fitting: Callable[[Any, RPCStream], bool] | None = None,
        default_reuse_time: float = CALLER_STREAM_REUSE_TIME,
    ):
        super().__init__(
            open_stream,
            reuse_time=LANE_REUSE_LIMIT,
            preferred=preferred,
            still_fitting=self._fresh_enough,
        )
        self._fits = still_fitting
        self.default_reuse_time = default_reuse_time
        self._idle_since: weakref.WeakKeyDictionary[RPCStream, float] = weakref.WeakKeyDictionary()

    def release(self, peer_id, stream: RPCStream) -> bool:
        kept = super().release(peer_id, stream)
        if kept:
            self._idle_since[stream] = trio.current_time()
        return kept

    def reuse_time_of(self, stream: RPCStream) -> float:
        """How long ``stream`` may idle and still be reused."""
        own = getattr(stream.stream, "reuse_time", None)
        return self.default_reuse_time if own is None else min(own, LANE_REUSE_LIMIT)

    def _fresh_enough(self, peer_id, stream: RPCStream) -> bool:
        since = self._idle_since.pop(stream, None)
        if since is None or trio.current_time() - since > self.reuse_time_of(stream):
            return False
        return self._fits is None or self._fits(peer_id, stream)
