"""The peers one matchmaking round may ask to lead it (sans-IO; part of
:class:`~swarmtrain.averaging.matchmaking_core.MatchmakingCore`): the last read of the group
key ranked by :func:`~swarmtrain.averaging.matchmaking_rules.leader_candidates`, and the
declarations (peer, expiration) asked already."""

from __future__ import annotations

from collections.abc import Set

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking_declaration import OwnDeclaration
from swarmtrain.averaging.matchmaking_rules import leader_candidates, may_lead
from swarmtrain.averaging.matchmaking_types import Declaration, PeerId

__all__ = ["LeaderCandidates"]


class LeaderCandidates:
    """The leaders we may ask next, best first (``len`` counts them), for a core's
    ``peer_id``, ``schema_hash``, ``mode``, ``banned`` peers and declaration."""

    def __init__(
        self,
        peer_id: PeerId,
        schema_hash: bytes,
        mode: AveragingMode,
        banned: Set[PeerId],
        own: OwnDeclaration,
    ) -> None:
        self.peer_id, self.schema_hash, self.mode = peer_id, schema_hash, mode
        self.banned, self.own = banned, own
        self.queue: list[Declaration] = []
        self.last_read: list[Declaration] = []  # the last read, to re-rank on renewal
        self.tried: set[tuple[PeerId, float]] = set()

    def __len__(self) -> int:
        return len(self.queue)

    def read(self, declarations: list[Declaration], now: float) -> None:
        """Rank a new read of the group key."""
        self.last_read = declarations
        self.queue = self.rank(declarations, now)

    def rerank(self, now: float) -> None:
        """Rank the last read again (after we declared again)."""
        self.queue = self.rank(self.last_read, now)

    def clear(self) -> None:
        self.queue.clear()

    def rank(self, declarations: list[Declaration], now: float) -> list[Declaration]:
        """``declarations`` that may lead us, best first (:func:`leader_candidates`)."""
        return leader_candidates(
            declarations,
            self.peer_id,
            self.own.expiration,
            self.schema_hash,
            now,
            self.tried,
            self.mode,
            legacy_expiration=self.own.seen_by_legacy_peers(),
        )

    def next_leader(self, now: float) -> PeerId | None:
        """The next candidate that may still lead us and that we did not ask yet (counted as
        asked now), or None."""
        while self.queue:
            candidate = self.queue.pop(0)
            if candidate.readable_until <= now or not may_lead(
                candidate.peer_id,
                candidate.expiration,
                self.peer_id,
                self.own.toward(candidate.legacy),
                self.mode,
            ):
                continue
            if (candidate.peer_id, candidate.expiration) in self.tried:
                continue
            if candidate.peer_id in self.banned:
                continue
            self.tried.add((candidate.peer_id, candidate.expiration))
            return candidate.peer_id
        return None
