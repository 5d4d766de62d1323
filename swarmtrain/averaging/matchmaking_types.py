"""Matchmaking for one averaging round, without I/O (sans-IO core).

One :class:`MatchmakingCore` is one peer looking for a group in one round. The async shell
(``swarmtrain.averaging.matchmaking``) feeds it events and carries out the actions it returns;
no method waits, and every method that depends on time takes ``now``.

Protocol (hivemind's, with its gaps closed):

- Every peer that can lead (NODE and AUX peers; CLIENT peers cannot be reached) *declares*
  itself under the group key ``{prefix}.0b{group_bits}``: a DHT record with subkey = its peer id,
  value = a :class:`Declaration` with the time by which it means to start averaging
  (``expiration``, at least ``min_matchmaking_time`` from now, at most the deadline). The
  record's DHT expiration is ``declaration_linger`` later: a DHT read slower than a matchmaking
  window (a loaded machine, a relay) still finds it, and the peer, if it has not found a group,
  has declared again meanwhile. (Older peers wrote no expiration into the value: their DHT
  expiration was the expiration; see :class:`Declaration`.)
- Peers are totally ordered by *priority* ``(expiration, peer_id)``: lower goes first. A peer
  asks only peers of higher priority to lead it, the highest first; a leader accepts only
  joiners of lower priority. So a peer follows leaders that expire *no later* than itself: the
  leader assembles at its own expiration, while its followers are still looking, and no cycle
  of peers can wait on each other. (hivemind's ``BAD_EXPIRATION_TIME`` rule, plus the peer-id
  tie break that makes the order total when expirations are equal.)
- A client never leads, so it stands outside that order: it does not keep the expiration of its
  step's start but recomputes it for every candidate list and request (``max(scheduled_time,
  now + min_matchmaking_time)``, at most the deadline), and may join any leader expiring no later
  (a client that stepped before every leader would otherwise be eligible for none of them).
- A leader accepts joiners until the group has ``target_group_size`` members (then assembles at
  once) or until its expiration; then it assembles if it has at least ``min_group_size``
  members, or disbands its followers and declares again with a new expiration. A full group
  that cannot average (auxiliary peers only) lets a joiner with tensors replace its latest
  auxiliary follower (``Disbanded``) instead of answering ``GROUP_FULL``.
- A peer waiting for its own leader's answer may still accept followers; once a leader accepts
  it, it disbands them with a redirect to that leader (``Disbanded(suggested_leader=...)``) and
  answers later joiners ``NOT_A_LEADER`` with the same suggestion. While it waits for that
  first answer it does not assemble a group of its own (not when the group fills, not at its
  expiration): the leader may have accepted it already and assemble with it (the acceptance on
  its way). It acts once the answer came or its timeout ran out.
- A leader that refuses a joiner ranking before it (``BAD_EXPIRATION``) and is asking nobody
  asks that joiner to lead it at once (the request carried the joiner's current expiration).
- A follower waits ``request_timeout`` for the first answer and then until its own expiration
  plus ``request_timeout`` for the group (longer for a leader on a slow path: the shell's
  ``request_timeouts``, learned from that leader's answer times); a rejection, a disband, a
  failed stream or a timeout sends it to the next candidate (or to the suggested leader, at
  most ``max_redirects`` times in a row). It keeps looking until the deadline.
- A leader told how many peers to expect (``expected_group_size``) that has fewer at its
  expiration holds its group open once, declaring the hold's end as its new expiration: until
  its earliest follower's expiration plus half a ``request_timeout`` (its followers still wait
  then). A peer whose expiration passed without a group declares again and at once asks the
  peers of its last read that now rank before it (a new read can take seconds under load).
- A declaration that reaches us after its expiration but while the DHT still keeps it (a read
  slower than a window) stays a candidate, asked after the current ones: its peer, if it found
  no group, has declared again since, and its answer tells (it accepts us, or rejects with
  ``BAD_EXPIRATION`` / ``NOT_LOOKING``). An older peer reads a record's DHT expiration as its
  expiration, so against an older peer's (legacy) record we compare, and ask with, our DHT
  expiration: the order stays the one that peer sees. A peer known only from a late
  declaration that answers ``NOT_LOOKING`` (an assembled member leaves its declaration to
  expire) is not counted as seen until it declares again.
- A group needs a peer that contributes tensors (NODE or CLIENT) and one that can lead (NODE
  or AUX). By the end of its first declaration window (its first expiration) a peer that is not
  waiting on a leader fails at once with ``AUXILIARY_ONLY`` (an AUX peer that saw no NODE
  declaration and no NODE or CLIENT joiner) or ``NO_LEADER`` (a client that saw no NODE or AUX
  declaration, or could reach none of them), instead of waiting for the deadline.
- The round ends with exactly one terminal action: :class:`GroupAssembled` or
  :class:`MatchmakingFailed` with a :class:`FailureReason`.

Phases (``Phase``) and what moves between them::

    NEW ──start──> SEARCHING ──SendJoinRequest──> REQUESTING ──Accepted──> FOLLOWING
    SEARCHING <── Rejected / Disbanded / request_failed / request_timeout ── REQUESTING|FOLLOWING
    REQUESTING|FOLLOWING ── Rejected / Disbanded with a suggestion ──> REQUESTING (redirect)
    FOLLOWING ──BeginAllReduce──> ASSEMBLED
    SEARCHING|REQUESTING ── group full, or enough members at the expiration ──> ASSEMBLED
    any but ASSEMBLED ── deadline / cancel ──> FAILED

The leader role runs alongside SEARCHING and REQUESTING (followers may join while we look for
our own leader) and ends on entering FOLLOWING, ASSEMBLED or FAILED.

Moshpit: :func:`next_group_bits` moves each member of a group to a different bucket for the
next round, so repeated rounds in small groups average the whole swarm (see its docstring).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Union

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.dht.owned_keys import GROUP_KEY_PATTERN

PeerId = bytes
#: every group key, of any run: declarations under them are owned per peer (PeerRecordValidator)
_GROUP_KEY = GROUP_KEY_PATTERN
_GROUP_ID_DOMAIN = b"swarmtrain/matchmaking/group-id/v1"
_ORDER_DOMAIN = b"swarmtrain/matchmaking/order/v1"
_MOSHPIT_DOMAIN = b"swarmtrain/matchmaking/moshpit/v1"
#: seconds a declaration stays readable past its expiration (``MatchmakingConfig``): as long as
#: the averager's DHT reads may take (``dht_timeout``, 5 s or ``min_matchmaking_time``)
DEFAULT_DECLARATION_LINGER = 5.0


# ---------------------------------------------------------------------------------- group keys


def make_group_key(prefix: str, group_bits: str) -> str:
    """``{prefix}.0b{group_bits}``, the DHT key under which a bucket's peers declare."""
    key = f"{prefix}.0b{group_bits}"
    if not is_valid_group_key(key):
        raise ValueError(
            f"bad group key {key!r}: prefix must be non-empty without '.', bits only 0 and 1"
        )
    return key


def is_valid_group_key(key: str) -> bool:
    return isinstance(key, str) and _GROUP_KEY.fullmatch(key) is not None


# ---------------------------------------------------------------------------------- enums


class RejectReason(enum.Enum):
    """Why a peer refuses to lead a joiner (mirrors MatchmakingCode in matchmaking.proto)."""

    NOT_LOOKING = "not_looking"  # not matchmaking now (not started, or the round is over)
    NOT_DECLARED = "not_declared"  # a client, or between two declarations: cannot lead
    BAD_GROUP_KEY = "bad_group_key"  # the joiner looks for a group under another key
    BAD_SCHEMA_HASH = "bad_schema_hash"  # the joiner averages tensors of another schema
    NOT_A_LEADER = "not_a_leader"  # we follow someone: ask suggested_leader instead
    DUPLICATE = "duplicate"  # the joiner is already our follower, or is us
    BAD_EXPIRATION = "bad_expiration"  # the joiner has higher priority: it should lead us
    GROUP_FULL = "group_full"  # target_group_size reached
    PROTOCOL_VIOLATION = "protocol_violation"  # a malformed request


class FailureReason(enum.Enum):
    """Why a round of matchmaking ended without a group."""

    TOO_FEW_PEERS = "too_few_peers"  # fewer than min_group_size compatible peers showed up
    SCHEMA_MISMATCH = "schema_mismatch"  # peers showed up, but all average another schema
    DEADLINE = "deadline"  # peers were there but no group formed in time (slow leader, ...)
    CANCELLED = "cancelled"  # the caller gave up
    # Found out by the end of our first declaration window, not at the deadline:
    NO_LEADER = "no_leader"  # a client saw no reachable peer that can lead (only clients)
    AUXILIARY_ONLY = "auxiliary_only"  # an auxiliary peer saw no peer that contributes tensors

    @property
    def retryable(self) -> bool:
        """Whether another attempt in the same step may succeed (the fast failures say the
        swarm cannot average now: a retry would only wait again)."""
        return self not in (
            FailureReason.CANCELLED,
            FailureReason.NO_LEADER,
            FailureReason.AUXILIARY_ONLY,
        )


class Phase(enum.Enum):
    NEW = "new"
    SEARCHING = "searching"  # no outgoing request; may lead followers
    REQUESTING = "requesting"  # waiting for a potential leader's first answer; may lead
    FOLLOWING = "following"  # accepted by a leader, waiting for its group
    ASSEMBLED = "assembled"
    FAILED = "failed"


_LOOKING = (Phase.SEARCHING, Phase.REQUESTING, Phase.FOLLOWING)
_TERMINAL = (Phase.ASSEMBLED, Phase.FAILED)


# ---------------------------------------------------------------------------------- records


def _check_part_layout(part_layout: int) -> None:
    if isinstance(part_layout, bool) or not isinstance(part_layout, int):
        raise TypeError(f"part_layout must be an int, got {part_layout!r}")
    if part_layout < 0:
        raise ValueError(f"part_layout must be non-negative, got {part_layout}")


def _check_bandwidth(bandwidth: float | None) -> float | None:
    if bandwidth is None:
        return None
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)):
        raise TypeError(f"bandwidth must be a number or None, got {bandwidth!r}")
    if not math.isfinite(bandwidth) or bandwidth < 0:
        raise ValueError(f"bandwidth must be finite and non-negative, got {bandwidth}")
    return float(bandwidth)


def _check_peer_id(peer_id: object, what: str = "peer_id") -> None:
    if not isinstance(peer_id, bytes) or not peer_id:
        raise TypeError(f"{what} must be non-empty bytes, got {peer_id!r}")


def _check_mode(mode: object) -> None:
    if not isinstance(mode, AveragingMode):
        raise TypeError(f"mode must be an AveragingMode, got {mode!r}")


@dataclass(frozen=True)
class MatchmakingConfig:
    """Matchmaking settings (hivemind's names).

    :param prefix: the averager's namespace; group keys are ``{prefix}.0b{bits}``
    :param target_group_size: a leader assembles as soon as it has this many members (None: no
      limit, assemble at the expiration)
    :param min_group_size: a leader disbands instead of assembling with fewer members
    :param min_matchmaking_time: a declaration lasts at least this long (hivemind's
      ``averaging_expiration`` / ``min_matchmaking_time``): the window for followers to join
    :param request_timeout: how long to wait for a potential leader's first answer, and for its
      group past our own expiration (at least: a slower path gets longer, see
      ``MatchmakingCore(request_timeouts=...)``); keep it below ``min_matchmaking_time``
    :param refresh_interval: how often to re-read the group key while nobody is left to ask
    :param first_refresh_interval: the first re-read comes this soon, and the wait doubles up to
      ``refresh_interval`` (peers that start at once see each other's declarations only after
      their first read: this finds them in ~0.1-0.3 s instead of a whole ``refresh_interval``)
    :param max_redirects: how many ``suggested_leader`` hops to follow in a row
    :param declaration_linger: how long our declaration stays readable in the DHT past its
      expiration (its DHT expiration is the expiration plus this): a read that takes longer
      than a matchmaking window, begun while the declaration was current, still finds it (reads
      took 1.4-5.4 s on a loaded machine). Readers ask a peer whose declared expiration has
      passed after the current ones (it has declared again if it found no group; if it has,
      it answers ``NOT_LOOKING``). Default ``DEFAULT_DECLARATION_LINGER``; 0: the record expires
      with the declaration, as before.
    """

    prefix: str
    target_group_size: int | None = None
    min_group_size: int = 2
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    refresh_interval: float = 1.0
    first_refresh_interval: float = 0.05
    max_redirects: int = 3
    declaration_linger: float = DEFAULT_DECLARATION_LINGER

    def __post_init__(self):
        make_group_key(self.prefix, "")  # validates the prefix
        for name in ("min_group_size", "max_redirects"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be at least 1, got {self.min_group_size}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be non-negative, got {self.max_redirects}")
        target = self.target_group_size
        if target is not None:
            if isinstance(target, bool) or not isinstance(target, int):
                raise TypeError(f"target_group_size must be an int or None, got {target!r}")
            if target < self.min_group_size:
                raise ValueError(
                    f"target_group_size ({target}) is below min_group_size ({self.min_group_size})"
                )
        for name in (
            "min_matchmaking_time",
            "request_timeout",
            "refresh_interval",
            "first_refresh_interval",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        linger = self.declaration_linger
        if (
            isinstance(linger, bool)
            or not isinstance(linger, (int, float))
            or not math.isfinite(linger)
            or linger < 0
        ):
            raise ValueError(f"declaration_linger must be a non-negative number, got {linger!r}")


@dataclass(frozen=True)
class Declaration:
    """One peer's record under a group key: DHT subkey ``peer_id``, DHT expiration
    ``dht_expiration``, the other fields the value (``MatchmakingDeclaration`` on the wire).

    :param expiration: the time by which the peer means to start averaging (its priority; a
      leader accepts joiners until then)
    :param dht_expiration: until when the record can be read (``expiration`` plus the peer's
      ``declaration_linger``); None: an older peer's record, whose value carries no expiration,
      so its DHT expiration *is* its expiration (a *legacy* record). Older peers read our
      records that way too: to them our expiration is our ``dht_expiration``.

    A peer that stops looking overwrites its record with ``looking_for_group=False`` and a DHT
    expiration just after the one it declared (so the DHT keeps the newer record).
    """

    peer_id: PeerId
    expiration: float
    looking_for_group: bool = True
    schema_hash: bytes = b""
    mode: AveragingMode = AveragingMode.NODE
    bandwidth: float | None = None
    dht_expiration: float | None = None

    def __post_init__(self):
        _check_peer_id(self.peer_id)
        _check_mode(self.mode)
        if not isinstance(self.expiration, (int, float)) or math.isnan(self.expiration):
            raise ValueError(f"expiration must be a number, got {self.expiration!r}")
        object.__setattr__(self, "bandwidth", _check_bandwidth(self.bandwidth))
        if self.dht_expiration is not None:
            dht = self.dht_expiration
            if isinstance(dht, bool) or not isinstance(dht, (int, float)) or math.isnan(dht):
                raise ValueError(f"dht_expiration must be a number, got {dht!r}")
            if dht < self.expiration:
                raise ValueError(
                    f"dht_expiration ({dht!r}) must not precede expiration ({self.expiration!r})"
                )

    @property
    def priority(self) -> tuple[float, PeerId]:
        return (self.expiration, self.peer_id)

    @property
    def legacy(self) -> bool:
        """An older peer's record (no expiration in its value)."""
        return self.dht_expiration is None

    @property
    def readable_until(self) -> float:
        """Until when the DHT keeps the record: a peer that declared it and found no group is
        still looking until then (having declared again meanwhile)."""
        return self.expiration if self.dht_expiration is None else self.dht_expiration


@dataclass(frozen=True)
class JoinRequest:
    """What a joiner sends a potential leader (the joiner's id comes from the transport).

    :param expiration: the joiner's own expiration; the leader must expire no later
    :param gather: opaque bytes the leader hands to every member (``data_for_gather``)
    :param part_layout: the newest all-reduce part layout the joiner speaks (0: unknown, an
      older version)
    :param patience: seconds the joiner waits for the leader's first answer, and for its group
      past the later of its own expiration and the acceptance (None: an older joiner that does
      not say; it waits at least ``MatchmakingConfig.request_timeout``)
    :param answer_by: the DHT time at which the joiner stops waiting for the first answer (its
      request's send time plus ``patience``; None with ``patience``)
    """

    group_key: str
    schema_hash: bytes
    expiration: float
    mode: AveragingMode = AveragingMode.NODE
    bandwidth: float | None = None
    gather: bytes = b""
    part_layout: int = 0
    patience: float | None = None
    answer_by: float | None = None

    def __post_init__(self):
        if not is_valid_group_key(self.group_key):
            raise ValueError(f"bad group key {self.group_key!r}")
        if not isinstance(self.schema_hash, bytes) or not self.schema_hash:
            raise ValueError("schema_hash must be non-empty bytes")
        if not isinstance(self.expiration, (int, float)) or not math.isfinite(self.expiration):
            raise ValueError(f"expiration must be a finite number, got {self.expiration!r}")
        _check_mode(self.mode)
        object.__setattr__(self, "bandwidth", _check_bandwidth(self.bandwidth))
        if not isinstance(self.gather, bytes):
            raise TypeError("gather must be bytes")
        _check_part_layout(self.part_layout)
        if (self.patience is None) != (self.answer_by is None):
            raise ValueError("patience and answer_by come together")
        if self.patience is not None:
            if not isinstance(self.patience, (int, float)) or not 0 < self.patience < math.inf:
                raise ValueError(f"patience must be a positive number, got {self.patience!r}")
            if not isinstance(self.answer_by, (int, float)) or not math.isfinite(self.answer_by):
                raise ValueError(f"answer_by must be a finite number, got {self.answer_by!r}")


@dataclass(frozen=True)
class GroupMember:
    peer_id: PeerId
    mode: AveragingMode = AveragingMode.NODE
    bandwidth: float | None = None
    gather: bytes = b""
    part_layout: int = 0  # the newest part layout the member speaks (see JoinRequest)

    def __post_init__(self):
        _check_peer_id(self.peer_id)
        _check_mode(self.mode)
        object.__setattr__(self, "bandwidth", _check_bandwidth(self.bandwidth))
        if not isinstance(self.gather, bytes):
            raise TypeError("gather must be bytes")
        _check_part_layout(self.part_layout)


@dataclass(frozen=True)
class MatchmakingGroup:
    """An assembled group, the same on every member.

    :param group_id: see :func:`derive_group_id`
    :param members: in group order (see :func:`order_members`); the i-th member reduces the
      i-th slice of the all-reduce
    """

    group_id: bytes
    group_key: str
    leader: PeerId
    members: tuple[GroupMember, ...]

    def __post_init__(self):
        if not isinstance(self.group_id, bytes) or not self.group_id:
            raise ValueError("group_id must be non-empty bytes")
        if not is_valid_group_key(self.group_key):
            raise ValueError(f"bad group key {self.group_key!r}")
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            raise ValueError("a group needs at least one member")
        for member in self.members:
            if not isinstance(member, GroupMember):
                raise TypeError(f"members must be GroupMember, got {member!r}")
        if len(set(self.peer_ids)) != len(self.members):
            raise ValueError("group members must be distinct")
        if self.leader not in self.peer_ids:
            raise ValueError("the leader must be a member of its group")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def peer_ids(self) -> tuple[PeerId, ...]:
        return tuple(m.peer_id for m in self.members)

    @property
    def modes(self) -> tuple[AveragingMode, ...]:
        return tuple(m.mode for m in self.members)

    @property
    def bandwidths(self) -> tuple[float | None, ...]:
        return tuple(m.bandwidth for m in self.members)

    @property
    def part_layout(self) -> int:
        """The all-reduce part layout of the group: the lowest its members speak (a member
        of an older version says 0, and so does every member under a leader that does not
        relay the field), so every member computes the same."""
        return min(m.part_layout for m in self.members)

    @property
    def gathered(self) -> tuple[bytes, ...]:
        return tuple(m.gather for m in self.members)

    def index_of(self, peer_id: PeerId) -> int | None:
        try:
            return self.peer_ids.index(peer_id)
        except ValueError:
            return None

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.peer_ids


# ---------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Accepted:
    """Leader -> joiner: you are a follower now; wait for BeginAllReduce or Disbanded."""


@dataclass(frozen=True)
class Rejected:
    """Leader -> joiner, final: not accepted (``suggested_leader``: ask that peer instead)."""

    reason: RejectReason
    suggested_leader: PeerId | None = None

    def __post_init__(self):
        if not isinstance(self.reason, RejectReason):
            raise TypeError(f"reason must be a RejectReason, got {self.reason!r}")
        if self.suggested_leader is not None:
            _check_peer_id(self.suggested_leader, "suggested_leader")


@dataclass(frozen=True)
class Disbanded:
    """Leader -> follower, final: the group is off (``suggested_leader``: join that peer)."""

    suggested_leader: PeerId | None = None

    def __post_init__(self):
        if self.suggested_leader is not None:
            _check_peer_id(self.suggested_leader, "suggested_leader")


@dataclass(frozen=True)
class BeginAllReduce:
    """Leader -> follower, final: the group is assembled."""

    group: MatchmakingGroup


LeaderMessage = Union[Accepted, Rejected, Disbanded, BeginAllReduce]
_FINAL_MESSAGES = (Rejected, Disbanded, BeginAllReduce)


# ---------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Declare:
    """Store ``declaration`` in the DHT: key ``key``, subkey ``declaration.peer_id``,
    expiration ``declaration.expiration`` (fire and forget; a failed store is not fatal)."""

    key: str
    declaration: Declaration


@dataclass(frozen=True)
class FetchDeclarations:
    """Read every subkey of ``key`` from the DHT (latest values), then call
    :meth:`MatchmakingCore.receive_declarations` (or :meth:`~MatchmakingCore.fetch_failed`)."""

    key: str


@dataclass(frozen=True)
class SendJoinRequest:
    """Open a join stream to ``leader`` and send ``request``; pass what comes back to
    :meth:`MatchmakingCore.handle_leader_message`, or :meth:`~MatchmakingCore.request_failed`
    if the stream fails or ends without a final message."""

    leader: PeerId
    request: JoinRequest


@dataclass(frozen=True)
class CancelJoinRequest:
    """Close our join stream to ``leader`` (we gave up on it)."""

    leader: PeerId


@dataclass(frozen=True)
class SendToFollower:
    """Send ``message`` on ``follower``'s join stream; close the stream after a final one
    (anything but :class:`Accepted`)."""

    follower: PeerId
    message: LeaderMessage

    @property
    def final(self) -> bool:
        return isinstance(self.message, _FINAL_MESSAGES)


@dataclass(frozen=True)
class GroupAssembled:
    """Terminal: matchmaking succeeded; run the all-reduce with ``group``."""

    group: MatchmakingGroup
    is_leader: bool


@dataclass(frozen=True)
class MatchmakingFailed:
    """Terminal: no group this round."""

    reason: FailureReason
    detail: str


Action = Union[
    Declare,
    FetchDeclarations,
    SendJoinRequest,
    CancelJoinRequest,
    SendToFollower,
    GroupAssembled,
    MatchmakingFailed,
]


@dataclass(frozen=True)
class MatchmakingStatistics:
    phase: Phase
    group_key: str
    expiration: float
    leader: PeerId | None
    num_followers: int
    num_candidates: int
    requests_sent: int
    peers_seen: int
    schema_mismatches: int
    rejections_received: Mapping[RejectReason, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    rejections_sent: Mapping[RejectReason, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    #: joiners not counted because they had stopped waiting (past the patience they sent)
    joiners_past_patience: int = 0
    #: declarations that reached us after their expiration, still readable (a slow DHT read):
    #: asked after the current ones instead of dropped
    late_declarations: int = 0
