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
"""

from __future__ import annotations

__all__ = ["EpochSync"]


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
