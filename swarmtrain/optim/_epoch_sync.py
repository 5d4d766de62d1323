"""When an ``Optimizer`` peer is behind the swarm and must catch up (a pure rule, no I/O).

A peer in epoch ``e`` that sees the swarm in ``e + 1`` is usually fine: the swarm has just
reached its target and this peer ends ``e`` with the swarm's gradient round at its next step.
It is *behind* when

- the swarm is two or more epochs ahead; or
- the swarm was already past ``e`` when this peer first looked at ``e`` (it entered an epoch the
  swarm had left, e.g. after its gradient round failed with "the swarm moved past epoch ..."):
  the round that ends ``e`` is over, so it would end ``e`` alone and enter ``e + 1`` just as the
  swarm enters ``e + 2``, one epoch behind for good (its gradients never averaged again).

A peer that is behind catches up (``Optimizer``: it loads the state from peers, or adopts the
swarm's epoch when no peer can serve one). The first look at an epoch is the first
:meth:`EpochSync.must_catch_up` call with that local epoch, usually the first step after the
epoch began; epoch changes reach the tracker by gossip at once, so that view is current.

A catch-up that fails and leaves the peer behind (every donor failed, or an auxiliary peer that
found none) is not retried at the next step: :class:`CatchUpBackoff` waits
``CATCH_UP_FIRST_DELAY`` seconds, doubling after each failure up to ``CATCH_UP_MAX_DELAY``, so a
peer whose donors all fail neither retries in a busy loop nor warns at every step (it warns once
per attempt). A success, or no longer being behind, ends the back-off.

A gradient round still looking for a group after the swarm moved past its epoch is given up
(:func:`left_behind_grace` says when). It used to look on for ``matchmaking_time`` in every
case: a peer that missed one round then entered the next epoch that long after the others, too
late for their next round (its matchmaking had started seconds earlier), failed it the same
way, and stayed one epoch behind for good (seen behind NATs: 5 of 22 epochs). It now gives up
at once when no other peer present is in the round's epoch any more (nobody is left to meet),
so it enters the next epoch with the others and joins their next round.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "CATCH_UP_FIRST_DELAY",
    "CATCH_UP_MAX_DELAY",
    "LATE_START_GRACE",
    "CatchUpBackoff",
    "EpochSync",
    "expected_round_size",
    "left_behind_grace",
]

#: seconds before the first retry of a failed catch-up
CATCH_UP_FIRST_DELAY = 1.0
#: the longest wait between two catch-up attempts
CATCH_UP_MAX_DELAY = 60.0
#: how long a round begun after the swarm had left its epoch may look for a group
LATE_START_GRACE = 0.3


def left_behind_grace(
    matchmaking_time: float,
    round_epoch: int,
    left_at: int,
    other_epochs: Collection[int] | None,
    begun_after_left: bool,
) -> float:
    """Seconds the gradient round that ends ``round_epoch`` may go on looking for a group once
    the swarm's epoch is past ``left_at`` (the last epoch in which its peers may still run it:
    ``round_epoch``, or the next one with delayed updates).

    ``other_epochs``: the epochs the other peers present last published (None: unknown). When
    none of them is from ``round_epoch`` to ``left_at``, no peer that could still join this
    round is left (those ahead finished it; those behind catch up by loading the state): 0,
    give up now. Else other late peers may still meet here: ``matchmaking_time``, or
    ``LATE_START_GRACE`` for a round begun after the swarm had left."""
    if other_epochs is not None and not any(round_epoch <= e <= left_at for e in other_epochs):
        return 0.0
    return min(matchmaking_time, LATE_START_GRACE) if begun_after_left else matchmaking_time


class EpochSync:
    """Remembers, per local epoch, whether the swarm was past it when this peer entered it."""

    def __init__(self) -> None:
        self._epoch: int | None = None  # the local epoch of the last look
        self._entered_late = False  # the swarm was past ``_epoch`` at its first look

    def must_catch_up(self, local_epoch: int, swarm_epoch: int) -> bool:
        """Whether a peer in ``local_epoch`` that sees the swarm in ``swarm_epoch`` is behind
        (see the module docstring); call it at every step, before accumulating."""
        if local_epoch != self._epoch:  # the first look at this epoch
            self._epoch = local_epoch
            self._entered_late = swarm_epoch > local_epoch
        behind = swarm_epoch - local_epoch
        return behind >= 2 or (behind == 1 and self._entered_late)


class CatchUpBackoff:
    """When a peer behind may try to catch up again (see the module docstring); pure: the caller
    passes ``now`` (any monotonic clock, in seconds)."""

    def __init__(self, first: float = CATCH_UP_FIRST_DELAY, cap: float = CATCH_UP_MAX_DELAY):
        if not 0 < first <= cap:
            raise ValueError(f"need 0 < first <= cap, got first={first}, cap={cap}")
        self.first, self.cap = float(first), float(cap)
        self._delay = self.first  # the wait after the next failure
        self._next: float | None = None  # no attempt before this time (None: any time)

    def due(self, now: float) -> bool:
        """Whether an attempt may start now."""
        return self._next is None or now >= self._next

    def failed(self, now: float) -> float:
        """An attempt failed at ``now``: returns the seconds until the next one may start."""
        delay = self._delay
        self._next = now + delay
        self._delay = min(2 * delay, self.cap)
        return delay

    def reset(self) -> None:
        """Caught up (or no longer behind): the next attempt may start at once."""
        self._delay, self._next = self.first, None


def expected_round_size(
    num_peers: int,
    last_group_size: int,
    epoch: int | None = None,
    other_epochs: Collection[int] | None = None,
) -> int | None:
    """How many peers a gradient round tells matchmaking to expect (``expected_group_size``: a
    leader assembles once that many are in, and at its expiration holds a smaller group open
    once while its followers wait); None: no expectation.

    After a round succeeded (``last_group_size``): the tracker's count ``num_peers`` (counting
    this peer), or the last group's size if larger (auxiliary peers publish no progress).

    The first round (epoch 0, or a newcomer's first): the trackers' counts may still grow, so
    the count must not let a leader assemble early (a peer whose record arrives later would be
    left out). One more than the peers seen in this round's epoch (``other_epochs``: the other
    peers' epochs, if known) is an upper estimate: a leader assembles before its expiration
    only when a peer beyond those seen joins, and at its expiration it holds for the peers it
    has not heard from yet (a declaration that reached it late: the epoch-0 miss behind NATs).
    None when no other peer is seen in this epoch."""
    if last_group_size:
        return max(num_peers, last_group_size)
    if other_epochs is None or epoch is None:
        seen = num_peers
    else:
        seen = 1 + sum(1 for other in other_epochs if other == epoch)
    return seen + 1 if seen >= 2 else None
