"""The sans-IO matchmaking state machine (types in matchmaking_types, rules in
matchmaking_rules; both re-exported here). Every transition is here; the state they act on is
in plain parts the core composes: our declaration and reads of the group key
(matchmaking_declaration), the leaders we may ask (matchmaking_candidates), a leader's
followers (matchmaking_followers) and the peers seen this round, with the failure reasons
(matchmaking_sightings)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from swarmtrain.averaging.allreduce_core import AveragingMode

__all__ = [
    "Accepted",
    "Action",
    "BeginAllReduce",
    "CancelJoinRequest",
    "Declaration",
    "Declare",
    "Disbanded",
    "FailureReason",
    "FetchDeclarations",
    "GroupAssembled",
    "GroupMember",
    "JoinRequest",
    "LeaderMessage",
    "MatchmakingConfig",
    "MatchmakingCore",
    "MatchmakingFailed",
    "MatchmakingGroup",
    "MatchmakingStatistics",
    "Phase",
    "RejectReason",
    "Rejected",
    "SendJoinRequest",
    "SendToFollower",
    "derive_group_id",
    "is_valid_group_key",
    "leader_candidates",
    "make_group_key",
    "may_lead",
    "next_group_bits",
    "order_members",
]

from swarmtrain.averaging.matchmaking_candidates import LeaderCandidates
from swarmtrain.averaging.matchmaking_declaration import KeyReads, OwnDeclaration
from swarmtrain.averaging.matchmaking_followers import (
    ANSWER_TIME_FACTOR,
    FollowerBook,
    assemble_at,
    request_time,
)
from swarmtrain.averaging.matchmaking_rules import (  # noqa: F401
    _hash,
    _is_viable,
    _next_power_of_two,
    derive_group_id,
    leader_candidates,
    may_lead,
    next_group_bits,
    order_members,
)
from swarmtrain.averaging.matchmaking_sightings import PeerSightings
from swarmtrain.averaging.matchmaking_types import (  # noqa: F401
    _FINAL_MESSAGES,
    _GROUP_ID_DOMAIN,
    _GROUP_KEY,
    _LOOKING,
    _MOSHPIT_DOMAIN,
    _ORDER_DOMAIN,
    _TERMINAL,
    Accepted,
    Action,
    BeginAllReduce,
    CancelJoinRequest,
    Declaration,
    Declare,
    Disbanded,
    FailureReason,
    FetchDeclarations,
    GroupAssembled,
    GroupMember,
    JoinRequest,
    LeaderMessage,
    MatchmakingConfig,
    MatchmakingFailed,
    MatchmakingGroup,
    MatchmakingStatistics,
    PeerId,
    Phase,
    Rejected,
    RejectReason,
    SendJoinRequest,
    SendToFollower,
    _check_bandwidth,
    _check_mode,
    _check_part_layout,
    _check_peer_id,
    is_valid_group_key,
    make_group_key,
)

# ---------------------------------------------------------------------------------- the core


class MatchmakingCore:
    """One peer's matchmaking for one round.

    :param config: shared settings
    :param peer_id: our id (bytes; ``PeerID.to_bytes()``)
    :param schema_hash: hash of the tensors' shapes and dtypes; only equal hashes average
    :param group_bits: our bucket this round (see :func:`next_group_bits`)
    :param deadline: give up at this time
    :param mode: NODE and AUX peers declare and may lead; CLIENT peers only follow
    :param bandwidth: our bandwidth for load balancing (None: unknown)
    :param gather: bytes to share with the group (``data_for_gather``)
    :param scheduled_time: when we intend to average (our first expiration is no earlier)
    :param nonce: mixed into the group id if we lead (the shell passes random bytes)
    :param part_layout: the newest all-reduce part layout we speak; told to our leader, or to
      our followers in the group (the group uses its members' lowest,
      ``MatchmakingGroup.part_layout``)
    :param banned: peers we neither lead nor follow this round (``BanList.banned``): their
      join requests get ``NOT_LOOKING``, their declarations are skipped
    :param request_timeouts: per leader, how long to wait for its first answer and for its
      group past our expiration, where that is longer than ``config.request_timeout`` (a slow
      or relayed path: ``swarmtrain.averaging.answer_times``)

    Usage: ``start(now)``, then pass every event in; after every call, carry out the returned
    actions in order, then call ``tick(now)`` once ``now >= next_deadline()``. Stop after a
    :class:`GroupAssembled` or :class:`MatchmakingFailed` action (``done`` becomes True).
    """

    def __init__(
        self,
        config: MatchmakingConfig,
        peer_id: PeerId,
        schema_hash: bytes,
        group_bits: str = "",
        *,
        deadline: float,
        mode: AveragingMode = AveragingMode.NODE,
        bandwidth: float | None = None,
        gather: bytes = b"",
        scheduled_time: float | None = None,
        nonce: bytes = b"",
        expected_group_size: int | None = None,
        part_layout: int = 0,
        banned: Iterable[PeerId] = (),
        request_timeouts: Mapping[PeerId, float] | None = None,
    ):
        if not isinstance(config, MatchmakingConfig):
            raise TypeError("config must be a MatchmakingConfig")
        _check_peer_id(peer_id)
        if not isinstance(schema_hash, bytes) or not schema_hash:
            raise ValueError("schema_hash must be non-empty bytes")
        _check_mode(mode)
        if not isinstance(deadline, (int, float)) or math.isnan(deadline):
            raise ValueError(f"deadline must be a number, got {deadline!r}")
        if not isinstance(gather, bytes) or not isinstance(nonce, bytes):
            raise TypeError("gather and nonce must be bytes")
        self.config = config
        self.peer_id = peer_id
        self.schema_hash = schema_hash
        self.group_key = make_group_key(config.prefix, group_bits)
        self.group_bits = group_bits
        self.deadline = float(deadline)
        self.mode = mode
        self.bandwidth = _check_bandwidth(bandwidth)
        self.gather = gather
        self.nonce = nonce
        _check_part_layout(part_layout)
        self.part_layout = part_layout
        self.banned = frozenset(banned)
        self.request_timeouts = dict(request_timeouts or {})
        for leader, seconds in self.request_timeouts.items():
            if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
                raise ValueError(f"request timeout for {leader!r} must be positive: {seconds!r}")
        # A leader assembles once its group reaches this size (the config's target, or the
        # caller's smaller estimate of the peers present: no wait for the declaration to lapse).
        self.assemble_at = assemble_at(config, expected_group_size)
        # Peers we expect in the group (the caller's count of peers present): a leader whose
        # group is smaller at its expiration holds it open once, as long as its followers wait.
        self.expected_peers = self.assemble_at if expected_group_size is not None else None
        self._held = False

        self._phase = Phase.NEW
        self._own = OwnDeclaration(
            config,
            peer_id,
            schema_hash,
            self.group_key,
            mode,
            self.bandwidth,
            self.deadline,
            scheduled_time,
        )
        self._reads = KeyReads(config, self.group_key)
        self._result: GroupAssembled | MatchmakingFailed | None = None
        # follower side
        self._leader: PeerId | None = None
        self._request_deadline = math.inf  # REQUESTING: first answer due; FOLLOWING: group due
        self._redirects = 0
        self._request_expiration = -math.inf  # the expiration we told the leader we asked
        self._candidates = LeaderCandidates(peer_id, schema_hash, mode, self.banned, self._own)
        # leader side
        self._followers = FollowerBook()
        # for statistics and failure reasons
        self._window_end = math.inf  # our first expiration: the fast failures are judged then
        self._window_checked = False
        self._seen = PeerSightings(
            peer_id, schema_hash, self.group_key, mode, config.min_group_size
        )
        self._requests_sent = 0
        self._rejections_received: Counter[RejectReason] = Counter()
        self._rejections_sent: Counter[RejectReason] = Counter()

    # ------------------------------------------------------------------ properties

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def done(self) -> bool:
        return self._phase in _TERMINAL

    @property
    def result(self) -> GroupAssembled | MatchmakingFailed | None:
        return self._result

    @property
    def expiration(self) -> float:
        return self._own.expiration

    @property
    def scheduled_time(self) -> float | None:
        """When we intend to average; the shell may change it (our next declaration uses it)."""
        return self._own.scheduled_time

    @scheduled_time.setter
    def scheduled_time(self, scheduled_time: float | None) -> None:
        self._own.scheduled_time = scheduled_time

    @property
    def leader(self) -> PeerId | None:
        """The peer we asked or follow (REQUESTING / FOLLOWING), else None."""
        return self._leader

    @property
    def followers(self) -> tuple[PeerId, ...]:
        return tuple(self._followers)

    @property
    def declares(self) -> bool:
        """Whether we declare (and so may lead): every mode but CLIENT."""
        return self.mode != AveragingMode.CLIENT

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to do (``inf`` when done)."""
        if self._phase in _TERMINAL or self._phase == Phase.NEW:
            return math.inf
        times = [self.deadline]
        if self._phase == Phase.SEARCHING:  # (REQUESTING: the answer or its timeout comes first)
            times.append(self._own.expiration)
        if self._phase in (Phase.REQUESTING, Phase.FOLLOWING):
            times.append(self._request_deadline)
        if self._phase == Phase.SEARCHING and not self._candidates and not self._reads.pending:
            times.append(self._reads.next_fetch)
        if not self._window_checked:
            times.append(self._window_end)
        return min(times)

    def statistics(self) -> MatchmakingStatistics:
        return MatchmakingStatistics(
            phase=self._phase,
            group_key=self.group_key,
            expiration=self._own.expiration,
            leader=self._leader,
            num_followers=len(self._followers),
            num_candidates=len(self._candidates),
            requests_sent=self._requests_sent,
            peers_seen=len(self._seen.compatible_seen),
            schema_mismatches=len(self._seen.schema_mismatches),
            rejections_received=MappingProxyType(dict(self._rejections_received)),
            rejections_sent=MappingProxyType(dict(self._rejections_sent)),
            joiners_past_patience=self._followers.joiners_past_patience,
            late_declarations=len(self._seen.late_seen),
        )

    def __repr__(self) -> str:
        return (
            f"<MatchmakingCore {self.peer_id!r} {self.group_key} {self._phase.value} "
            f"leader={self._leader!r} followers={len(self._followers)}>"
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self, now: float) -> list[Action]:
        """Declare ourselves (unless a client) and read the group key."""
        if self._phase != Phase.NEW:
            raise RuntimeError(f"start() called in phase {self._phase.value}")
        self._phase = Phase.SEARCHING
        if now >= self.deadline:
            return self._fail(
                FailureReason.DEADLINE, "the deadline passed before matchmaking began"
            )
        actions: list[Action] = []
        self._own.renew(now, actions)
        self._window_end = self._own.expiration
        self._reads.fetch(actions)
        return actions

    def cancel(self, now: float) -> list[Action]:
        """Give up: disband followers, leave our leader, withdraw the declaration."""
        if self._phase in _TERMINAL:
            return []
        return self._fail(FailureReason.CANCELLED, "matchmaking was cancelled")

    def tick(self, now: float) -> list[Action]:
        """Handle whatever became due at ``now`` (timeouts, our expiration, the deadline)."""
        if self._phase not in _LOOKING:
            return []
        actions: list[Action] = self._forget_followers_past_patience(now)
        # 1. an answer or a group that is overdue
        if self._phase in (Phase.REQUESTING, Phase.FOLLOWING) and now >= self._request_deadline:
            if self._phase == Phase.REQUESTING:
                self._seen.unreachable.add(self._asked_leader())
            actions.append(CancelJoinRequest(self._asked_leader()))
            self._leave_leader()
        if now >= self._window_end:
            self._window_checked = True
        # 2. our expiration: lead what we have, or start over. Not while a leader's first answer
        # is due: it may have taken us already (its acceptance on its way) and assemble a group
        # with us in it; we act on our expiration once it answered or its time ran out.
        if self._phase == Phase.SEARCHING and now >= self._own.expiration:
            if self._can_assemble(final=True):
                hold_until = self._hold_until(now)
                if hold_until is None:
                    return actions + self._assemble(now)
                self._held = True  # once: stay visible for the peers we expect, then assemble
                self._own.declare(hold_until, actions)
                return actions + self._advance(now)
            cannot = self._cannot_average(now)
            if cannot is not None:  # fail now, without declaring again
                return actions + self._fail(*cannot)
            if now < self.deadline:
                actions += self._disband(None)
                self._own.renew(now, actions)
                self._reads.restart()  # a new expiration may make new peers eligible
                # peers we saw but could not follow may lead us now: ask them at once (a read
                # takes seconds on a loaded machine, by when their groups may have assembled)
                self._candidates.rerank(now)
        # 3. the deadline
        if now >= self.deadline:
            return actions + self._fail(*self._failure_reason())
        return actions + self._advance(now)

    # ------------------------------------------------------------------ DHT results

    def receive_declarations(self, declarations: Iterable[Declaration], now: float) -> list[Action]:
        """The result of :class:`FetchDeclarations` (records of other keys are ignored by the
        shell; expired ones and our own are skipped here)."""
        self._reads.answered(now)
        if self._phase not in _LOOKING:
            return []
        declarations = list(declarations)
        for d in declarations:
            self._seen.note_declaration(d, now)
        self._own.refresh_client_expiration(now)
        self._candidates.read(declarations, now)
        return self._advance(now)

    def fetch_failed(self, now: float) -> list[Action]:
        """The DHT read failed: try again later (as after an empty answer)."""
        return self.receive_declarations((), now)

    # ------------------------------------------------------------------ leader side

    def handle_join_request(self, peer: PeerId, request: JoinRequest, now: float) -> list[Action]:
        """``peer`` (authenticated by the transport) asks us to lead it."""
        actions = self._forget_followers_past_patience(now)
        reason, suggestion = self._reason_to_reject(peer, request, now)
        if reason == RejectReason.GROUP_FULL:
            evicted = self._followers.auxiliary_to_evict_for(request, self._own_member())
            if evicted is not None:  # a full group of auxiliary peers makes room for a sender
                self._followers.remove(evicted)
                actions.append(SendToFollower(evicted, Disbanded()))
                reason = None
        if reason is not None:
            self._rejections_sent[reason] += 1
            if reason == RejectReason.BAD_SCHEMA_HASH:
                self._seen.schema_mismatches.add(peer)
            actions.append(SendToFollower(peer, Rejected(reason, suggestion)))
            if reason == RejectReason.BAD_EXPIRATION:
                actions += self._ask_joiner_that_ranks_before_us(peer, request, now)
            return actions
        self._followers.accept(peer, request, now)
        self._seen.note_joiner(peer, request.mode)
        actions.append(SendToFollower(peer, Accepted()))
        if self._phase == Phase.SEARCHING and self._full():
            actions += self._assemble(now)
        return actions

    def _full(self) -> bool:
        """Whether our group has the members to assemble at once (``assemble_at``). While we
        wait on a leader's first answer (REQUESTING) we assemble only once it answered: its
        acceptance may be on its way, and it may assemble a group with us in it meanwhile
        (seen with slow paths). If it accepts us, our followers go to it."""
        target = self.assemble_at
        return target is not None and len(self._followers) + 1 >= target and self._can_assemble()

    def _ask_joiner_that_ranks_before_us(
        self, peer: PeerId, request: JoinRequest, now: float
    ) -> list[Action]:
        """A joiner we refused because it ranks before us (``BAD_EXPIRATION``) is looking for a
        group and may lead us: ask it at once, if we are asking nobody. Each peer may have read
        the other's declaration only after it had declared again (slow reads): each asked the
        other, each was the later one at that moment, and the two could miss each other every
        window until the deadline. The request told us its expiration, which is current."""
        if self._phase != Phase.SEARCHING or request.mode == AveragingMode.CLIENT:
            return []
        if (peer, request.expiration) in self._candidates.tried or request.expiration <= now:
            return []
        self._candidates.tried.add((peer, request.expiration))
        self._redirects = 0
        return self._request(peer, now)

    def reject_malformed_request(self, peer: PeerId) -> list[Action]:
        """A join request from ``peer`` could not be decoded (or failed validation)."""
        self._rejections_sent[RejectReason.PROTOCOL_VIOLATION] += 1
        return [SendToFollower(peer, Rejected(RejectReason.PROTOCOL_VIOLATION))]

    def follower_left(self, peer: PeerId, now: float) -> list[Action]:
        """The join stream of an accepted follower closed or failed before a final message."""
        self._followers.remove(peer)
        return []

    def _forget_followers_past_patience(self, now: float) -> list[Action]:
        """Disband the followers that would give up before our start message reached them
        (:meth:`FollowerBook.past_patience`)."""
        if self._phase not in _LOOKING:
            return []
        gone = self._followers.past_patience(now)
        return [SendToFollower(peer, Disbanded()) for peer in gone]

    def _reason_to_reject(
        self, peer: PeerId, request: JoinRequest, now: float
    ) -> tuple[RejectReason | None, PeerId | None]:
        if not isinstance(request, JoinRequest) or not isinstance(peer, bytes) or not peer:
            return RejectReason.PROTOCOL_VIOLATION, None
        if self._phase not in _LOOKING or peer in self.banned:
            return RejectReason.NOT_LOOKING, None
        if not self.declares or now >= self._own.expiration:
            return RejectReason.NOT_DECLARED, None
        if request.group_key != self.group_key:
            return RejectReason.BAD_GROUP_KEY, None
        if request.schema_hash != self.schema_hash:
            return RejectReason.BAD_SCHEMA_HASH, None
        if self._phase == Phase.FOLLOWING:
            return RejectReason.NOT_A_LEADER, self._leader
        if peer == self.peer_id or peer in self._followers:
            return RejectReason.DUPLICATE, None
        delay = request_time(request, now)
        if (
            request.answer_by is not None
            and delay is not None
            and now + ANSWER_TIME_FACTOR * delay > request.answer_by
        ):  # it may stop waiting before our answer reaches it: do not count it
            self._followers.joiners_past_patience += 1
            return RejectReason.NOT_LOOKING, None
        if not may_lead(self.peer_id, self._own.expiration, peer, request.expiration, request.mode):
            return RejectReason.BAD_EXPIRATION, None
        target = self.config.target_group_size
        if target is not None and len(self._followers) + 1 >= target:
            return RejectReason.GROUP_FULL, None
        return None, None

    def _can_assemble(self, final: bool = False) -> bool:
        """Whether we may assemble now (``final``: at our expiration, else with a full group)."""
        if not self.declares or self._phase not in (Phase.SEARCHING, Phase.REQUESTING):
            return False
        members = [self._own_member(), *self._followers.members()]
        if final and len(members) < self.config.min_group_size:
            return False
        return _is_viable(members)

    def _own_member(self) -> GroupMember:
        return GroupMember(self.peer_id, self.mode, self.bandwidth, self.gather, self.part_layout)

    def _assemble(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self._phase == Phase.REQUESTING:
            actions.append(CancelJoinRequest(self._asked_leader()))
            self._leave_leader()
        members = [self._own_member(), *self._followers.members()]
        group_id = derive_group_id(
            self.group_key,
            self.peer_id,
            self._own.expiration,
            (m.peer_id for m in members),
            self.nonce,
        )
        group = MatchmakingGroup(
            group_id, self.group_key, self.peer_id, order_members(group_id, members)
        )
        for follower in self._followers:
            actions.append(SendToFollower(follower, BeginAllReduce(group)))
        self._followers.clear()
        return actions + self._finish(GroupAssembled(group, is_leader=True))

    def _disband(self, suggested_leader: PeerId | None) -> list[Action]:
        actions: list[Action] = [
            SendToFollower(f, Disbanded(suggested_leader)) for f in self._followers
        ]
        self._followers.clear()
        return actions

    # ------------------------------------------------------------------ follower side

    def handle_leader_message(
        self, leader: PeerId, message: LeaderMessage, now: float
    ) -> list[Action]:
        """A message on our join stream to ``leader``. Messages from anyone but the peer we
        asked are stale (a stream we gave up on) and ignored."""
        if self._phase not in (Phase.REQUESTING, Phase.FOLLOWING) or leader != self._leader:
            return []
        self._seen.unreachable.discard(leader)
        if isinstance(message, Accepted):
            if self._phase != Phase.REQUESTING:
                return self._drop_leader(now, cancel=True)  # accepted twice
            self._phase = Phase.FOLLOWING
            # the leader assembles at its expiration, which is no later than the one we told it
            self._request_deadline = max(self._request_expiration, now) + self._timeout_for(leader)
            return self._disband(leader)
        if isinstance(message, Rejected):
            self._rejections_received[message.reason] += 1
            self._seen.note_rejection(leader, message.reason)
            if self._phase == Phase.FOLLOWING:
                return self._drop_leader(now)  # not a valid answer after Accepted
            return self._redirect_or_search(message.suggested_leader, now)
        if isinstance(message, Disbanded):
            return self._redirect_or_search(message.suggested_leader, now)
        if isinstance(message, BeginAllReduce):
            group = message.group
            index = group.index_of(self.peer_id)
            if (
                self._phase != Phase.FOLLOWING
                or index is None
                or group.leader != leader
                or group.group_key != self.group_key
                or group.members[index].mode != self.mode
            ):
                return self._drop_leader(now)
            self._leave_leader()
            return self._finish(GroupAssembled(group, is_leader=False))
        return self._drop_leader(now, cancel=True)

    def request_failed(self, leader: PeerId, now: float) -> list[Action]:
        """Our join stream to ``leader`` failed, or ended without a final message."""
        if self._phase not in (Phase.REQUESTING, Phase.FOLLOWING) or leader != self._leader:
            return []
        if self._phase == Phase.REQUESTING:
            self._seen.unreachable.add(leader)
        return self._drop_leader(now)

    def _drop_leader(self, now: float, cancel: bool = False) -> list[Action]:
        actions: list[Action] = [CancelJoinRequest(self._asked_leader())] if cancel else []
        self._leave_leader()
        return actions + self._look_on(now)

    def _look_on(self, now: float) -> list[Action]:
        """Back to SEARCHING: ask the next candidate; or, when our expiration passed while we
        waited on a leader (an older peer's expiration may be later than ours: see
        ``OwnDeclaration.toward``), do at once what the tick does then (lead what we have, or
        declare again and ask the peers of the last read)."""
        if now >= self._own.expiration:
            return self.tick(now)
        return self._advance(now)

    def _asked_leader(self) -> PeerId:
        """The leader we asked or follow (set in the REQUESTING and FOLLOWING phases)."""
        leader = self._leader
        assert leader is not None, self._phase
        return leader

    def _timeout_for(self, leader: PeerId) -> float:
        """How long we wait for ``leader``: its first answer, its group past our expiration."""
        return max(self.config.request_timeout, self.request_timeouts.get(leader, 0.0))

    def _leave_leader(self) -> None:
        self._phase = Phase.SEARCHING
        self._leader = None
        self._request_deadline = math.inf

    def _redirect_or_search(self, suggested: PeerId | None, now: float) -> list[Action]:
        self._leave_leader()
        if self._full():
            return self._assemble(now)
        if (
            suggested is not None
            and suggested != self.peer_id
            and suggested not in self.banned
            and self._redirects < self.config.max_redirects
        ):
            if now < self._own.expiration:
                self._redirects += 1
                return self._request(suggested, now)
        return self._look_on(now)

    def _request(self, leader: PeerId, now: float) -> list[Action]:
        self._phase = Phase.REQUESTING
        self._leader = leader
        patience = self._timeout_for(leader)  # told to the leader: it counts us only so long
        self._request_deadline = now + patience
        self._requests_sent += 1
        self._request_expiration = self._own.toward(leader in self._seen.legacy_peers)
        request = JoinRequest(
            self.group_key,
            self.schema_hash,
            self._request_expiration,
            self.mode,
            self.bandwidth,
            self.gather,
            self.part_layout,
            patience=patience,
            answer_by=now + patience,
        )
        return [SendJoinRequest(leader, request)]

    def _advance(self, now: float) -> list[Action]:
        """While SEARCHING: ask the next candidate, or re-read the key when it is time."""
        if self._phase != Phase.SEARCHING:
            return []
        if self._full():  # filled while we waited on a leader that did not take us
            return self._assemble(now)
        self._own.refresh_client_expiration(now)
        leader = self._candidates.next_leader(now)
        if leader is not None:
            self._redirects = 0
            return self._request(leader, now)
        cannot = self._cannot_average(now)
        if cannot is not None:
            return self._fail(*cannot)
        actions: list[Action] = []
        if now >= self._reads.next_fetch:
            self._reads.fetch(actions)
        return actions

    # ------------------------------------------------------------------ shared

    def _cannot_average(self, now: float) -> tuple[FailureReason, str] | None:
        """Why no group can form, judged once our first declaration window is over and we wait
        on no leader (the leader we wait on may know of peers we cannot see); else None."""
        if now < self._window_end or self._phase != Phase.SEARCHING:
            return None
        return self._seen.cannot_average(self._phase, self._leader, len(self._followers))

    def _hold_until(self, now: float) -> float | None:
        """When a leader at its expiration with fewer members than ``expected_peers`` should
        assemble instead (None: now). It holds once, while its followers still wait for it (a
        follower waits at least ``request_timeout`` past its own expiration; half of that is
        left for the start message to reach it; a follower that sent its patience waits that
        long, less the time its request took): under load a peer may see our declaration only
        seconds after we see its one."""
        expected = self.expected_peers
        if self._held or expected is None or not self._followers:
            return None
        if len(self._followers) + 1 >= expected:
            return None
        patience = min(
            self._followers.hold_limit(peer, request, self.config.request_timeout)
            for peer, request in self._followers.items()
        )
        hold_until = min(patience, self.deadline)
        return hold_until if hold_until > now else None

    def _finish(self, result: GroupAssembled | MatchmakingFailed) -> list[Action]:
        self._phase = Phase.ASSEMBLED if isinstance(result, GroupAssembled) else Phase.FAILED
        self._result = result
        self._candidates.clear()
        if isinstance(result, GroupAssembled):
            # An assembled member leaves its declaration to expire (at its expiration, at most
            # min_matchmaking_time after the last renewal; readable declaration_linger longer)
            # instead of withdrawing it: the withdrawal was one DHT store per member while the
            # all-reduce starts (-11% round time at 8 peers x 4M), and a peer that asks to join
            # meanwhile is told NOT_LOOKING.
            self._own.declared = None
            return [result]
        return [*self._own.withdraw(), result]

    def _fail(self, reason: FailureReason, detail: str) -> list[Action]:
        actions = self._disband(None)
        if self._phase in (Phase.REQUESTING, Phase.FOLLOWING):
            actions.append(CancelJoinRequest(self._asked_leader()))
        self._leave_leader()
        return actions + self._finish(MatchmakingFailed(reason, detail))

    def _failure_reason(self) -> tuple[FailureReason, str]:
        return self._seen.failure_reason(self._phase, self._leader, len(self._followers))
