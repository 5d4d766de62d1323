"""The order in which a sender hands its parts to the transport (pure, no I/O).

Left alone, a sender's streams to its reducers race: on a shared uplink (a FIFO rate limiter,
a home router) one TCP flow can take most of the rate while another starves, and a reducer
averages part ``k`` only once *every* sender's part ``k`` is in, so the starved flow holds up
that reducer's whole slice (and the deltas it would send back). A :class:`SendSchedule` keeps
the flows in step instead: parts go out round by round (part 0 to every reducer, then part 1,
...), each round visiting the reducers in an order that starts after the sender's own index
(:func:`staggered_order`: senders do not all start with the same reducer), and a part may
be handed over only once every part more than ``window`` places before it in that sequence
was written (or its reducer failed). ``window`` parts may be in flight besides the oldest, so
the uplink stays busy while one stream waits for its socket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["SendSchedule", "staggered_order"]


def staggered_order(local_index: int, reducers: Sequence[int], group_size: int) -> tuple[int, ...]:
    """``reducers`` ordered by their distance after ``local_index`` in a group of
    ``group_size`` (sender 1 of 4 visits 2, 3, 0; sender 2 visits 3, 0, 1)."""
    return tuple(sorted(reducers, key=lambda r: (r - local_index) % group_size))


class SendSchedule:
    """Which of one sender's parts may be handed to the transport now.

    :param parts: number of parts per remote reducer
    :param order: the reducers in the order each round visits them (every key of ``parts``)
    :param window: how many parts may be in flight besides the oldest unwritten one (0: one
      part at a time)
    """

    def __init__(self, parts: Mapping[int, int], order: Sequence[int], window: int = 1):
        if sorted(order) != sorted(parts) or len(set(order)) != len(order):
            raise ValueError("order must name every reducer of parts exactly once")
        if any(n < 0 for n in parts.values()):
            raise ValueError("part counts must be non-negative")
        if window < 0:
            raise ValueError(f"window must be non-negative, got {window}")
        self.window = window
        rounds = max(parts.values(), default=0)
        self._sequence = [(r, k) for k in range(rounds) for r in order if k < parts[r]]
        self._position = {item: i for i, item in enumerate(self._sequence)}
        self._done = [False] * len(self._sequence)
        self._first_open = 0  # position of the oldest part neither written nor dropped

    def __len__(self) -> int:
        return len(self._sequence)

    def may_send(self, reducer: int, part: int) -> bool:
        """Whether ``part`` for ``reducer`` may be handed over now (True for a part the
        schedule does not know, e.g. a re-sent one: the schedule never blocks a retry)."""
        position = self._position.get((reducer, part))
        return position is None or position - self._first_open <= self.window

    def written(self, reducer: int, part: int) -> None:
        """The transport took ``part`` for ``reducer`` (idempotent)."""
        position = self._position.get((reducer, part))
        if position is not None:
            self._done[position] = True
            self._advance()

    def drop(self, reducer: int) -> None:
        """``reducer`` failed or finished early: its unwritten parts hold nobody back."""
        for position, (r, _) in enumerate(self._sequence):
            if r == reducer:
                self._done[position] = True
        self._advance()

    @property
    def finished(self) -> bool:
        return self._first_open == len(self._sequence)

    def _advance(self) -> None:
        while self._first_open < len(self._sequence) and self._done[self._first_open]:
            self._first_open += 1
