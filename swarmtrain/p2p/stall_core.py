"""Sans-IO rules that tell a slow path from a stalled one (no I/O, no clock: ``now`` comes in).

- ``ProgressDeadline``: a wait for a message whose deadline moves out while its bytes keep
  arriving ("bytes still arriving = not stalled"), at most by ``received / min_rate``: a peer
  that sends nothing still misses the first deadline, one that trickles bytes to hold a wait
  open buys one second per ``min_rate`` bytes, no more.
- ``FrameSizer``: the largest yamux frame a connection should write, from how fast its
  socket took the frames that had to wait for room. A 1 MiB frame on a lossy long path
  (~40 KB/s) holds the connection's write lock ~25 s, so the window updates, stream opens and
  small calls queued behind it miss their deadlines, and a stock py-libp2p receiver gives up
  on a frame body that takes over 60 s; frames of ~``target_seconds`` of the measured rate
  keep those waits short, and fast paths keep 1 MiB frames.
"""

from __future__ import annotations

import math

#: the slowest average rate (bytes/s since a wait began) that still counts as progress
DEFAULT_MIN_RATE = 4 * 1024


class ProgressDeadline:
    """The deadline of one wait that bytes arriving keep alive.

    ``deadline`` starts at ``first_deadline`` (what a fast path allows, e.g. a part's
    ``sender_timeout``); each ``on_bytes(count, now)`` moves it to ``now + patience`` when that
    is later, but never past ``first_deadline + received / min_rate``."""

    __slots__ = ("_first", "deadline", "min_rate", "patience", "received")

    def __init__(self, first_deadline: float, patience: float, min_rate: float = DEFAULT_MIN_RATE):
        if not patience > 0 or not min_rate > 0:
            raise ValueError("patience and min_rate must be positive")
        self._first = self.deadline = first_deadline
        self.patience, self.min_rate = patience, min_rate
        self.received = 0

    def on_bytes(self, count: int, now: float) -> float:
        """``count`` bytes arrived at ``now``; returns the (maybe later) deadline."""
        if count <= 0:
            return self.deadline
        self.received += count
        cap = self._first + self.received / self.min_rate
        self.deadline = max(self.deadline, min(now + self.patience, cap))
        return self.deadline

    def expired(self, now: float) -> bool:
        return now >= self.deadline


#: frames never get smaller than this (a yamux frame header is 12 bytes; py-libp2p's is 64 KiB)
MIN_FRAME_SIZE = 16 * 1024
#: a socket write that took less than this did not wait for room: it says nothing of the rate
BLOCKED_WRITE_SECONDS = 0.005


class FrameSizer:
    """Frame size for one connection: ``frame_size`` follows ``on_write(nbytes, seconds)``.

    A write that waited (``seconds >= BLOCKED_WRITE_SECONDS``) measured the path: the frame
    size becomes ``rate x target_seconds`` (a power of two within ``[MIN_FRAME_SIZE,
    max_size]``; writes smaller than ``min_size`` measure nothing); a full-sized write that
    did not wait lets it double back up (the socket had room)."""

    __slots__ = ("frame_size", "max_size", "min_size", "rate", "target_seconds")

    def __init__(self, max_size: int, target_seconds: float = 0.25, min_size: int = MIN_FRAME_SIZE):
        if not 0 < min_size <= max_size or not target_seconds > 0:
            raise ValueError("need 0 < min_size <= max_size and a positive target_seconds")
        self.max_size, self.min_size, self.target_seconds = max_size, min_size, target_seconds
        self.frame_size = max_size
        self.rate: float | None = None  # bytes/s of the last write that waited

    def on_write(self, nbytes: int, seconds: float) -> int:
        """A frame of ``nbytes`` took ``seconds`` to enter the socket; returns the new size."""
        if seconds < BLOCKED_WRITE_SECONDS:
            if nbytes >= self.frame_size // 2:  # a full-sized frame went straight in
                self.frame_size = min(self.max_size, 2 * self.frame_size)
            return self.frame_size
        if nbytes < self.min_size:  # a small write waited for room others freed: no rate
            return self.frame_size
        self.rate = nbytes / seconds
        wanted = self.rate * self.target_seconds
        size = self.min_size
        if wanted > size:
            size = min(self.max_size, 1 << int(math.log2(wanted)))
        self.frame_size = max(self.min_size, size)
        return self.frame_size
