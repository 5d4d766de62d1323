"""What one peer saw of the others in a matchmaking round, and why no group formed (sans-IO;
part of :class:`~swarmtrain.averaging.matchmaking_core.MatchmakingCore`): the peers it could
average with, lead or follow, the leaders that never answered, the peers of another schema and
the declarations it read late."""

from __future__ import annotations

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking_types import (
    Declaration,
    FailureReason,
    PeerId,
    Phase,
    RejectReason,
)

__all__ = ["PeerSightings"]

#: late declarations remembered per round (for statistics; a bound against a flood of records)
_MAX_LATE_SEEN = 4096


class PeerSightings:
    """The peers one matchmaking round saw (a core's ``peer_id``, ``schema_hash``,
    ``group_key``, ``mode`` and its config's ``min_group_size``)."""

    def __init__(
        self,
        peer_id: PeerId,
        schema_hash: bytes,
        group_key: str,
        mode: AveragingMode,
        min_group_size: int,
    ) -> None:
        self.peer_id, self.schema_hash, self.group_key = peer_id, schema_hash, group_key
        self.mode, self.min_group_size = mode, min_group_size
        # peers whose last read record is an older peer's (no expiration in its value): they
        # take our DHT expiration for our expiration, so we compare and ask with that one
        self.legacy_peers: set[PeerId] = set()
        self.late_seen: set[tuple[PeerId, float]] = set()  # read after their expiration
        self.seen_current: set[PeerId] = set()  # peers of a declaration read before it expired
        self.moved_on: set[PeerId] = set()  # known from late declarations, said NOT_LOOKING
        self.leaders_seen: set[PeerId] = set()  # NODE/AUX declarations of our schema (or blank)
        self.senders_seen: set[PeerId] = set()  # NODE declarations, NODE/CLIENT joiners
        self.unreachable: set[PeerId] = set()  # asked, never answered (failed or timed out)
        self.compatible_seen: set[PeerId] = set()
        self.schema_mismatches: set[PeerId] = set()

    def note_declaration(self, d: Declaration, now: float) -> None:
        """A declaration read from the group key (expired ones and our own are skipped)."""
        if d.peer_id == self.peer_id or not d.looking_for_group or d.readable_until <= now:
            return
        if d.legacy:
            self.legacy_peers.add(d.peer_id)
        else:
            self.legacy_peers.discard(d.peer_id)
        if d.expiration > now:
            self.seen_current.add(d.peer_id)
            self.moved_on.discard(d.peer_id)
        elif d.peer_id in self.moved_on:
            return  # its group assembled (or its round ended) after this declaration
        elif len(self.late_seen) < _MAX_LATE_SEEN:
            self.late_seen.add((d.peer_id, d.expiration))
        if d.schema_hash == self.schema_hash:
            self.compatible_seen.add(d.peer_id)
        elif d.schema_hash:  # an empty hash is unknown: a join request will tell
            self.schema_mismatches.add(d.peer_id)
            return
        if d.mode != AveragingMode.CLIENT:
            self.leaders_seen.add(d.peer_id)
        if d.mode == AveragingMode.NODE:
            self.senders_seen.add(d.peer_id)

    def note_joiner(self, peer: PeerId, mode: AveragingMode) -> None:
        """A joiner we accepted as a follower."""
        self.compatible_seen.add(peer)
        if mode != AveragingMode.AUX:
            self.senders_seen.add(peer)

    def note_rejection(self, leader: PeerId, reason: RejectReason) -> None:
        """A leader we asked rejected us for ``reason``."""
        if reason == RejectReason.BAD_SCHEMA_HASH:
            self.compatible_seen.discard(leader)
            self.schema_mismatches.add(leader)
        elif reason == RejectReason.NOT_LOOKING and leader not in self.seen_current:
            # known only from a late declaration (an assembled member leaves its own to
            # expire) and not looking: not a peer we could have averaged with this round
            self.moved_on.add(leader)
            for seen in (self.compatible_seen, self.leaders_seen, self.senders_seen):
                seen.discard(leader)

    def cannot_average(
        self, phase: Phase, leader: PeerId | None, num_followers: int
    ) -> tuple[FailureReason, str] | None:
        """Why no group can form, judged once our first declaration window is over and we wait
        on no leader (the leader we wait on may know of peers we cannot see); else None. The
        core asks only then (``phase`` is SEARCHING)."""
        key = self.group_key
        if self.mode == AveragingMode.CLIENT:
            reachable = self.leaders_seen - self.unreachable
            if reachable:
                return None
            if not self.leaders_seen and self.schema_mismatches:
                # SCHEMA_MISMATCH: say so, not "no leader"
                return self.failure_reason(phase, leader, num_followers)
            if self.leaders_seen:
                return FailureReason.NO_LEADER, (
                    f"could not reach any of the {len(self.leaders_seen)} peer(s) under {key} "
                    "that can lead a group (client-mode peers cannot lead, and nobody can "
                    "dial them)"
                )
            return FailureReason.NO_LEADER, (
                f"no peer that can lead a group (a node or an auxiliary peer) declared under {key}"
                " by the end of our first matchmaking window; client-mode peers cannot lead"
            )
        if self.mode == AveragingMode.AUX and not self.senders_seen:
            if not self.compatible_seen and self.schema_mismatches:
                return self.failure_reason(phase, leader, num_followers)
            return FailureReason.AUXILIARY_ONLY, (
                f"no peer under {key} contributes tensors: only auxiliary peers (which only "
                "help others average) showed up by the end of our first matchmaking window"
            )
        return None

    def failure_reason(
        self, phase: Phase, leader: PeerId | None, num_followers: int
    ) -> tuple[FailureReason, str]:
        """Why no group formed: a schema mismatch, too few peers, or the deadline."""
        need = self.min_group_size
        seen = len(self.compatible_seen) + 1
        key = self.group_key
        if not self.compatible_seen and self.schema_mismatches:
            return FailureReason.SCHEMA_MISMATCH, (
                f"{len(self.schema_mismatches)} peer(s) under {key} average another schema "
                "(different tensor shapes, dtypes or names); none average ours"
            )
        if seen < need:
            return FailureReason.TOO_FEW_PEERS, (
                f"found {seen} peer(s) under {key} counting us, need min_group_size={need}"
            )
        if num_followers:
            return FailureReason.TOO_FEW_PEERS, (
                f"only {num_followers + 1} peer(s) joined our group under {key} by the "
                f"deadline, need min_group_size={need}"
            )
        if phase == Phase.FOLLOWING:
            return FailureReason.DEADLINE, (
                f"leader {leader!r} did not begin all-reduce before the deadline"
            )
        return FailureReason.DEADLINE, (
            f"saw {seen - 1} other peer(s) under {key} but formed no group before the deadline"
        )
