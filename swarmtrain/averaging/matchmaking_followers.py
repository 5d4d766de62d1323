"""A leader's followers in one matchmaking round (sans-IO; part of
:class:`~swarmtrain.averaging.matchmaking_core.MatchmakingCore`): the join requests it accepted,
how long each follower waits for its group, the followers to drop or evict, and the group
members they make. Also when a leader assembles at once (:func:`assemble_at`)."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking_rules import _is_viable
from swarmtrain.averaging.matchmaking_types import (
    GroupMember,
    JoinRequest,
    MatchmakingConfig,
    PeerId,
)

__all__ = ["ANSWER_TIME_FACTOR", "FollowerBook", "assemble_at", "request_time"]

#: a message to a joiner may take this many times as long as its join request took (paths
#: under load vary: a NAT run saw a request take 2.2 s and the answer over 2.9 s)
ANSWER_TIME_FACTOR = 1.5


class FollowerBook:
    """The followers a leader accepted, in the order they joined (iterating yields their ids),
    with the patience each said it has."""

    def __init__(self) -> None:
        self._requests: dict[PeerId, JoinRequest] = {}
        # per follower that said its patience: the DHT time it stops waiting for our group, and
        # how long its request took (``request_time``)
        self._gives_up: dict[PeerId, tuple[float, float]] = {}
        #: joiners not counted because they would give up before our answer reached them
        self.joiners_past_patience = 0

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[PeerId]:
        return iter(self._requests)

    def __contains__(self, peer: object) -> bool:
        return peer in self._requests

    def items(self) -> ItemsView[PeerId, JoinRequest]:
        return self._requests.items()

    def accept(self, peer: PeerId, request: JoinRequest, now: float) -> None:
        """Count ``peer`` as a follower (its request arrived at ``now``)."""
        self._requests[peer] = request
        delay = request_time(request, now)
        if request.patience is not None and delay is not None:
            gives_up = max(request.expiration, now) + request.patience
            self._gives_up[peer] = (gives_up, delay)

    def remove(self, peer: PeerId) -> None:
        self._requests.pop(peer, None)
        self._gives_up.pop(peer, None)

    def clear(self) -> None:
        self._requests.clear()
        self._gives_up.clear()

    def past_patience(self, now: float) -> list[PeerId]:
        """Remove and return the followers that said how long they wait and would give up
        before our start message reached them, even as fast as their request: they are not
        counted, the core sends them a ``Disbanded`` (if one still listens, it looks on).
        Followers that did not say (older peers) are kept, as before. (A hold ends earlier,
        allowing ``ANSWER_TIME_FACTOR`` times the request's time: a tick that comes late under
        load does not drop the followers it held for.)"""
        if not self._gives_up:
            return []
        gone = [
            peer for peer, (gives_up, delay) in self._gives_up.items() if now + delay > gives_up
        ]
        for peer in gone:
            del self._requests[peer], self._gives_up[peer]
        self.joiners_past_patience += len(gone)
        return gone

    def members(self) -> list[GroupMember]:
        return [
            GroupMember(p, r.mode, r.bandwidth, r.gather, r.part_layout)
            for p, r in self._requests.items()
        ]

    def auxiliary_to_evict_for(self, request: JoinRequest, own: GroupMember) -> PeerId | None:
        """The auxiliary follower (the latest) that a sender joining our full group replaces,
        when the group has no sender: it could never assemble, and would lock out every peer
        with tensors (None when the joiner is auxiliary too, or the group can average)."""
        if request.mode == AveragingMode.AUX or _is_viable([own, *self.members()]):
            return None
        auxiliary = [p for p, r in self._requests.items() if r.mode == AveragingMode.AUX]
        return auxiliary[-1] if auxiliary else None

    def hold_limit(self, peer: PeerId, request: JoinRequest, request_timeout: float) -> float:
        """The latest time to send ``peer`` the start message while we hold."""
        said = self._gives_up.get(peer)
        if said is None:  # an older joiner: it waits at least request_timeout
            return request.expiration + request_timeout / 2
        gives_up, delay = said
        return gives_up - max(ANSWER_TIME_FACTOR * delay, request_timeout / 2)


def request_time(request: JoinRequest, now: float) -> float | None:
    """How long ``request`` took to arrive (DHT times; clamped to its patience), None when the
    joiner did not say (an older peer). Our messages to the joiner may take
    ``ANSWER_TIME_FACTOR`` times as long."""
    if request.patience is None or request.answer_by is None:
        return None
    sent_at = request.answer_by - request.patience
    return min(max(now - sent_at, 0.0), request.patience)


def assemble_at(config: MatchmakingConfig, expected_group_size: int | None) -> int | None:
    """The group size at which a leader assembles at once (None: only at its expiration)."""
    target = config.target_group_size
    if expected_group_size is None:
        return target
    if isinstance(expected_group_size, bool) or not isinstance(expected_group_size, int):
        raise TypeError(f"expected_group_size must be an int or None, got {expected_group_size!r}")
    if expected_group_size < max(2, config.min_group_size):
        return target  # too small to be a group: no early assembly
    return expected_group_size if target is None else min(target, expected_group_size)
