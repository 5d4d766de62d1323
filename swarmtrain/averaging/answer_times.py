"""How long a joiner waits for a leader's answer: learned from the answers it got (sans-IO).

A fixed ``request_timeout`` is too short on slow paths: through a relay on a loaded machine a
leader's first answer took up to 3.9 s (``docs/reliability.md``), so a joiner with a 2.5 s
timeout left a leader that had already counted it, and the group's all-reduce ran without it.
:class:`AnswerTimes` remembers, per leader, the slowest answer seen recently (and the waits
that ended without one: the answer is slower than that), and gives a timeout a few times that
long: ``request_timeout`` on fast paths, more on slow ones, never beyond ``max_timeout``.
A path that is not known to be direct (relayed, or no connection yet: the dial is part of the
wait) starts at ``relayed_factor`` times ``request_timeout``.

Every method takes ``now``; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["AnswerTimes"]


class AnswerTimes:
    """Per-peer answer times and the timeouts derived from them.

    :param request_timeout: the shortest timeout (a direct path with fast answers)
    :param max_timeout: the longest timeout (e.g. a matchmaking window)
    :param factor: the timeout is this many times the slowest recent answer
    :param relayed_factor: a path not known to be direct waits at least this many times
      ``request_timeout``
    :param half_life: a remembered answer time halves every ``half_life`` seconds, so a slow
      spell is forgotten once answers are fast again
    :param max_peers: peers remembered (the least recently updated are forgotten first)
    """

    def __init__(
        self,
        request_timeout: float,
        max_timeout: float,
        *,
        factor: float = 2.0,
        relayed_factor: float = 2.0,
        half_life: float = 60.0,
        max_peers: int = 1024,
    ):
        for name, value in (
            ("request_timeout", request_timeout),
            ("max_timeout", max_timeout),
            ("factor", factor),
            ("relayed_factor", relayed_factor),
            ("half_life", half_life),
        ):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
            raise ValueError(f"max_peers must be a positive int, got {max_peers!r}")
        self.request_timeout = float(request_timeout)
        self.max_timeout = max(float(max_timeout), self.request_timeout)
        self.factor = float(factor)
        self.relayed_factor = float(relayed_factor)
        self.half_life = float(half_life)
        self.max_peers = max_peers
        self._slowest: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # (s, when)

    def __len__(self) -> int:
        return len(self._slowest)

    def peers(self) -> list[Hashable]:
        """The peers remembered, least recently updated first."""
        return list(self._slowest)

    def slowest(self, peer: Hashable, now: float) -> float:
        """The slowest recent answer time of ``peer`` (decayed; 0.0 when unknown)."""
        entry = self._slowest.get(peer)
        if entry is None:
            return 0.0
        seconds, when = entry
        return seconds * 0.5 ** (max(0.0, now - when) / self.half_life)

    def observe(self, peer: Hashable, seconds: float, now: float) -> None:
        """``peer`` answered after ``seconds``, or (a wait that ended without an answer) had
        not answered after ``seconds``: its answer time is at least that."""
        if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            return
        slowest = max(float(seconds), self.slowest(peer, now))
        self._slowest[peer] = (slowest, now)
        self._slowest.move_to_end(peer)
        while len(self._slowest) > self.max_peers:
            self._slowest.popitem(last=False)

    def timeout(self, peer: Hashable, now: float, *, direct: bool) -> float:
        """How long to wait for ``peer``'s answer (``direct``: we hold a direct connection)."""
        floor = self.request_timeout if direct else self.request_timeout * self.relayed_factor
        wanted = max(floor, self.factor * self.slowest(peer, now))
        return min(wanted, self.max_timeout)
