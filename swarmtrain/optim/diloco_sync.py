"""Keeping a DiLoCo peer in sync with its run after a round: the divergence repair and the
round catch-up (see ``swarmtrain.optim.diloco``, "Same start" and "Elastic").

- **Divergence repair** (:func:`adopt_reference_state`): each round's gather data carries a
  fingerprint of the shared parameters; a peer whose fingerprint is not that of the class the
  group follows (``diloco_state.reference_peers``) loads the state of that class's peers.
- **Round catch-up** (:func:`catch_up`): a peer that stepped alone while others were present
  and sees from their presence records that they are a round or more ahead loads their state
  (hence their inner step count), so that it meets them in their next round; rounds are keyed
  by their number, so without this it would stay alone in every later round.
- :func:`everyone_done`: whether every other peer already finished a round (a peer that fell
  behind steps alone at once instead of waiting out its matchmaking).

The decisions are plain functions of presence records and gathered data; the two ``async``
functions do the loading through the optimizer (``AsyncDiLoCoOptimizer``, typed by its round
mixin ``DiLoCoRounds``). With ``delay`` > 0
they only warn: donors serve no state while rounds overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from swarmtrain.optim.diloco_peers import Present
from swarmtrain.optim.diloco_state import _peer_order, reference_peers

if TYPE_CHECKING:
    from swarmtrain.optim._diloco_rounds import DiLoCoRounds
    from swarmtrain.optim.diloco_records import PendingRound

__all__ = [
    "adopt_reference_state",
    "catch_up",
    "check_lockstep",
    "diverged_from",
    "everyone_done",
    "peers_ahead",
]

logger = logging.getLogger("swarmtrain.optim.diloco")


def everyone_done(others: Iterable[Present], start_step: int) -> bool:
    """Whether every peer of ``others`` declared the round of ``start_step`` (or a later one)
    finished: nobody will come to that round."""
    return all(peer.step is not None and peer.step >= start_step for peer in others)


def peers_ahead(others: Iterable[Present], start_step: int, inner_steps: int) -> list[Present]:
    """The peers of ``others`` that finished a round at least H inner steps after the round of
    ``start_step``: a round or more ahead of us."""
    return [
        peer for peer in others if peer.step is not None and peer.step >= start_step + inner_steps
    ]


def diverged_from(gathered: dict, ours: bytes) -> tuple[frozenset, int] | None:
    """The reference class of a round's gathered data (``{peer_id: gather}``) if our
    fingerprint is not in it, with the number of fingerprints; None when we follow it (or a
    peer of an older version sent no fingerprint: nothing to compare)."""
    fingerprints = {}
    for peer_id, data in gathered.items():
        if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), list):
            return None
        outer_step = data.get("outer_step", 0)
        outer_step = outer_step if isinstance(outer_step, int) else 0
        fingerprints[peer_id.to_bytes()] = (data["fingerprint"], outer_step)
    reference = reference_peers(fingerprints)
    if ours in reference or ours not in fingerprints:
        return None
    return reference, len(fingerprints)


def check_lockstep(gathered: dict, pending: PendingRound) -> None:
    """Warn if the group averaged peers at other inner steps than ours."""
    steps = {g.get("inner_step") for g in gathered.values() if isinstance(g, dict)} - {
        pending.start_step
    }
    if steps:
        logger.warning(
            "averaged at inner step %d with peers at inner steps %s: their shared "
            "parameters may differ (load_state_from_peers resynchronizes)",
            pending.start_step,
            sorted(s for s in steps if isinstance(s, int)),
        )


async def catch_up(opt: DiLoCoRounds, pending: PendingRound) -> None:
    """After a round we stepped alone in while other peers were present: if some of them are
    already a round further, load their state (see the module docstring)."""
    ahead = peers_ahead(await opt.presence.others(), pending.start_step, opt.inner_steps)
    if not ahead:
        return
    ahead_donors = [peer.peer_id for peer in ahead if peer.donor]
    if opt.schedule.delay > 0 or not ahead_donors:  # (no state served mid-round)
        logger.warning(
            "DiLoCo fragment %d: %d peers are a round or more ahead of this one and serve "
            "no state now; call load_state_from_peers() to rejoin their rounds",
            pending.fragment,
            len(ahead),
        )
        return
    logger.warning(
        "DiLoCo fragment %d: %d peers are a round or more ahead of this one (inner step "
        "%d): loading their state to rejoin their rounds",
        pending.fragment,
        len(ahead),
        pending.start_step,
    )
    timeout = min(opt.load_state_timeout, opt.averaging_timeout)
    if await opt._load_state_from_peers(timeout, donors=sorted(ahead_donors)):
        opt._states_caught_up += 1
    else:
        logger.warning(
            "DiLoCo fragment %d: could not load the state of the peers ahead; this peer "
            "stays behind their rounds",
            pending.fragment,
        )


async def adopt_reference_state(opt: DiLoCoRounds, gathered: dict, pending: PendingRound) -> None:
    """If the round's fingerprints show that our shared parameters differ from the ones the
    group follows (another random init, a joiner that loaded nothing), load them."""
    diverged = diverged_from(gathered, opt.averagers[pending.fragment].peer_id.to_bytes())
    if diverged is None:
        return
    reference, count = diverged
    if opt.schedule.delay > 0:  # donors serve no state while their rounds overlap
        logger.warning(
            "DiLoCo fragment %d: this peer's shared parameters differ from those of %d of "
            "the %d peers in the round (another initialization, a partial round, or a "
            "joiner that loaded no state); with delay > 0 call load_state_from_peers() "
            "when no round is in flight to resynchronize",
            pending.fragment,
            len(reference),
            count,
        )
        return
    logger.warning(
        "DiLoCo fragment %d: this peer's shared parameters differ from those of %d of the "
        "%d peers in the round (another initialization, a partial round, or a joiner that "
        "loaded no state): loading theirs",
        pending.fragment,
        len(reference),
        count,
    )
    timeout = min(opt.load_state_timeout, opt.averaging_timeout)
    if not await opt._load_state_from_peers(timeout, donors=sorted(reference)):
        logger.warning(
            "DiLoCo fragment %d: could not load the shared parameters of peers %s; this "
            "peer keeps its own, which differ",
            pending.fragment,
            sorted(_peer_order(p)[1].hex()[:12] for p in reference),
        )
