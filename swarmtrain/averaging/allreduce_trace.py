"""An optional timeline of all-reduce rounds: when each part and delta was handed to the
transport, written, received and reduced, per peer of the group (``AllReduceService.trace``).

Off by default (``AllReduceService.trace`` is None: the runner records nothing). The WAN
benchmark (``benchmarks/benchmark_wan.py --trace``) turns it on in every peer and merges the
peers' timelines (wall-clock stamps: comparable between processes on one machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["AllReduceTrace", "TraceEvent"]

#: events one trace keeps (older ones are dropped first): a bounded buffer
DEFAULT_MAX_EVENTS = 200_000


@dataclass(frozen=True)
class TraceEvent:
    """One stamp. ``kind``:

    - as a sender: ``part_queued`` (part ``part`` for reducer ``peer`` handed to the call),
      ``part_written`` (the transport took it), ``delta_received`` (its delta arrived);
    - as a reducer: ``part_received`` (from sender ``peer``), ``part_reduced`` (every sender's
      part ``part`` is in; ``peer`` is our own index), ``delta_queued`` / ``delta_written``
      (the delta for sender ``peer``);
    - ``round_began`` / ``round_ended`` (``peer``: our index, ``part``: -1).
    """

    time: float
    group: str
    kind: str
    peer: int
    part: int
    nbytes: int = 0

    def as_dict(self) -> dict:
        return {
            "time": self.time,
            "group": self.group,
            "kind": self.kind,
            "peer": self.peer,
            "part": self.part,
            "nbytes": self.nbytes,
        }


class AllReduceTrace:
    """A bounded list of :class:`TraceEvent` (wall-clock ``time.time()`` stamps)."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS):
        self.max_events = max_events
        self.events: list[TraceEvent] = []
        self.dropped = 0

    def record(self, group: bytes, kind: str, peer: int, part: int, nbytes: int = 0) -> None:
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append(TraceEvent(time.time(), group.hex()[:16], kind, peer, part, nbytes))

    def take(self) -> list[TraceEvent]:
        """The events so far (and forget them)."""
        events, self.events = self.events, []
        return events
