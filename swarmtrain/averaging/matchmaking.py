"""Matchmaking over the DHT and the join RPC: the async shell around ``MatchmakingCore``.

``Matchmaking`` serves ``{prefix}::Matchmaking.rpc_join_group`` on one host (unless it is a
client, which nobody can dial) and runs one round at a time::

    async with Matchmaking.create(dht, config, schema_hash) as matchmaking:
        assembled = await matchmaking.look_for_group("01", deadline=get_dht_time() + 30)
        assembled.group  # a MatchmakingGroup, the same on every member

How the core is driven: every event (a DHT answer, a join request, a leader's message, a closed
stream, a timer) calls one core method *synchronously*, and the returned actions are carried
out at once without awaiting: a DHT read or a join call starts a task, a message to a follower
goes into that follower's buffered channel, cancelling a join call cancels its scope. So no
await ever happens between a decision and the start of its I/O, and the core is never touched
by two tasks across an await. One timer task calls ``tick`` at ``next_deadline()``.

Resource handling: ``create`` owns a task group for DHT stores (declarations, including the
withdrawal at the end of a round, must outlive the round); ``look_for_group`` owns a task group
for the round's DHT reads, outgoing join calls and the timer, cancelled when the round ends.
Incoming join calls run in the host's RPC server; each waits on its follower's channel, which
the round closes when it ends, so none outlives the round.

Declarations are per-peer records (``swarmtrain.dht.peer_records``): signed by the declaring
peer's identity key on store, checked by every node that stores or reads them, so nobody can
withdraw, replace or wipe another peer's declaration.

Bounds: each DHT read or store is bounded by ``dht_timeout``; a join call by the core's request
timeouts (``CancelJoinRequest``) and by the round; the round by its deadline.

Error handling: a failed DHT read or store, a peer that fails or talks nonsense only feed the
core (``fetch_failed``, ``request_failed``, ``reject_malformed_request``); ``look_for_group``
raises :class:`MatchmakingError` with the core's reason when the round ends without a group.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import trio
from google.protobuf.message import DecodeError

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.answer_times import AnswerTimes
from swarmtrain.averaging.errors import MatchmakingError
from swarmtrain.averaging.matchmaking_core import MatchmakingCore
from swarmtrain.averaging.matchmaking_types import (
    GROUP_KEY_PATTERN,
    Accepted,
    Action,
    BeginAllReduce,
    CancelJoinRequest,
    Declaration,
    Declare,
    Disbanded,
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
    Rejected,
    RejectReason,
    SendJoinRequest,
    SendToFollower,
)
from swarmtrain.averaging.partition import PART_LAYOUT
from swarmtrain.dht import PeerRecordValidator, get_dht_time
from swarmtrain.p2p import P2PError, PeerID
from swarmtrain.proto import matchmaking_pb2 as pb

__all__ = ["Matchmaking", "rpc_join_group_name"]

logger = logging.getLogger(__name__)

Code = pb.MatchmakingCode
_MODES = {
    AveragingMode.NODE: pb.MATCHMAKING_MODE_NODE,
    AveragingMode.CLIENT: pb.MATCHMAKING_MODE_CLIENT,
    AveragingMode.AUX: pb.MATCHMAKING_MODE_AUX,
}
_MODES_BACK = {v: k for k, v in _MODES.items()}
_REJECT_CODES = {
    RejectReason.NOT_LOOKING: Code.MATCHMAKING_NOT_LOOKING,
    RejectReason.NOT_DECLARED: Code.MATCHMAKING_NOT_DECLARED,
    RejectReason.BAD_GROUP_KEY: Code.MATCHMAKING_BAD_GROUP_KEY,
    RejectReason.BAD_SCHEMA_HASH: Code.MATCHMAKING_BAD_SCHEMA_HASH,
    RejectReason.NOT_A_LEADER: Code.MATCHMAKING_NOT_A_LEADER,
    RejectReason.DUPLICATE: Code.MATCHMAKING_DUPLICATE,
    RejectReason.BAD_EXPIRATION: Code.MATCHMAKING_BAD_EXPIRATION,
    RejectReason.GROUP_FULL: Code.MATCHMAKING_GROUP_FULL,
    RejectReason.PROTOCOL_VIOLATION: Code.MATCHMAKING_PROTOCOL_VIOLATION,
}
_REJECT_REASONS = {v: k for k, v in _REJECT_CODES.items()}
# Largest join request / leader message (a group of many members with gathered data).
MAX_MESSAGE_SIZE = 64 * 1024 * 1024


def _short(peer: PeerId) -> str:
    """The last characters of a peer id, for debug logs."""
    try:
        return str(PeerID(peer))[-6:]
    except Exception:
        return peer.hex()[-8:]


def _describe(action: Action) -> str | None:
    """One debug-log line for an action (None for DHT traffic, which is too chatty)."""
    if isinstance(action, SendJoinRequest):
        return f"ask {_short(action.leader)} (our expiration {action.request.expiration:.3f})"
    if isinstance(action, CancelJoinRequest):
        return f"stop asking {_short(action.leader)}"
    if isinstance(action, SendToFollower):
        message = action.message
        if isinstance(message, Rejected):
            what = f"reject ({message.reason.value})"
        elif isinstance(message, BeginAllReduce):
            what = f"begin group of {message.group.size}"
        else:
            what = type(message).__name__.lower()
        return f"tell {_short(action.follower)}: {what}"
    if isinstance(action, GroupAssembled):
        group = action.group
        role = "leader" if action.is_leader else f"follower of {_short(group.leader)}"
        members = ",".join(_short(p) for p in group.peer_ids)
        return f"assembled as {role}: {group.size} [{members}]"
    if isinstance(action, MatchmakingFailed):
        return f"failed: {action.reason.value}: {action.detail}"
    return None


def rpc_join_group_name(prefix: str) -> str:
    return f"{prefix}::Matchmaking.rpc_join_group"


# ---------------------------------------------------------------------------------- wire codecs


def _mode(value: pb.MatchmakingMode) -> AveragingMode:
    try:
        return _MODES_BACK[value]
    except KeyError:
        raise ValueError(f"unknown matchmaking mode {value}") from None


def encode_declaration(d: Declaration) -> bytes:
    """The DHT value of ``d`` (stored with DHT expiration ``d.readable_until``); a legacy
    declaration (no ``dht_expiration``) is written as older peers wrote it, without its
    expiration."""
    message = pb.MatchmakingDeclaration(
        looking_for_group=d.looking_for_group, schema_hash=d.schema_hash, mode=_MODES[d.mode]
    )
    if d.bandwidth is not None:
        message.bandwidth = d.bandwidth
    if not d.legacy:
        message.expiration = d.expiration
    return message.SerializeToString()


def decode_declaration(peer_id: Any, value: Any, expiration: float) -> Declaration | None:
    """A DHT record under a group key (``expiration``: its DHT expiration), or None if it is
    not a valid declaration. A value without an expiration is an older peer's: its DHT
    expiration is its expiration (``Declaration.legacy``); a declared expiration past the DHT
    expiration is read as the DHT expiration (nobody starts after its record is gone)."""
    if not isinstance(peer_id, bytes) or not isinstance(value, bytes):
        return None
    try:
        m = pb.MatchmakingDeclaration.FromString(value)
        declared, dht_expiration = expiration, None
        if m.HasField("expiration"):
            if math.isnan(m.expiration):
                return None
            declared, dht_expiration = min(m.expiration, expiration), expiration
        return Declaration(
            peer_id,
            declared,
            m.looking_for_group,
            m.schema_hash,
            _mode(m.mode),
            m.bandwidth if m.HasField("bandwidth") else None,
            dht_expiration=dht_expiration,
        )
    except (DecodeError, ValueError, TypeError):
        return None


def encode_join_request(r: JoinRequest) -> pb.MatchmakingJoinRequest:
    message = pb.MatchmakingJoinRequest(
        group_key=r.group_key,
        schema_hash=r.schema_hash,
        expiration=r.expiration,
        mode=_MODES[r.mode],
        gather=r.gather,
        part_layout=r.part_layout,
    )
    if r.bandwidth is not None:
        message.bandwidth = r.bandwidth
    if r.patience is not None and r.answer_by is not None:
        message.patience, message.answer_by = r.patience, r.answer_by
    return message


def decode_join_request(m: pb.MatchmakingJoinRequest) -> JoinRequest:
    """Raises ValueError or TypeError for a malformed request."""
    return JoinRequest(
        m.group_key,
        m.schema_hash,
        m.expiration,
        _mode(m.mode),
        m.bandwidth if m.HasField("bandwidth") else None,
        m.gather,
        m.part_layout,
        patience=m.patience if m.HasField("patience") else None,
        answer_by=m.answer_by if m.HasField("answer_by") else None,
    )


def encode_leader_message(message: LeaderMessage) -> pb.MatchmakingResponse:
    if isinstance(message, Accepted):
        return pb.MatchmakingResponse(code=Code.MATCHMAKING_ACCEPTED)
    if isinstance(message, Rejected):
        return pb.MatchmakingResponse(
            code=_REJECT_CODES[message.reason],
            suggested_leader=message.suggested_leader or b"",
            detail=f"rejected: {message.reason.value}",
        )
    if isinstance(message, Disbanded):
        return pb.MatchmakingResponse(
            code=Code.MATCHMAKING_GROUP_DISBANDED, suggested_leader=message.suggested_leader or b""
        )
    group = message.group
    members = []
    for m in group.members:
        member = pb.MatchmakingGroupMember(
            peer_id=m.peer_id, mode=_MODES[m.mode], gather=m.gather, part_layout=m.part_layout
        )
        if m.bandwidth is not None:
            member.bandwidth = m.bandwidth
        members.append(member)
    return pb.MatchmakingResponse(
        code=Code.MATCHMAKING_BEGIN_ALLREDUCE,
        group_id=group.group_id,
        members=members,
        group_key=group.group_key,
    )


def decode_leader_message(leader: PeerId, m: pb.MatchmakingResponse) -> LeaderMessage:
    """Raises ValueError or TypeError for a malformed message."""
    suggested = m.suggested_leader or None
    if m.code == Code.MATCHMAKING_ACCEPTED:
        return Accepted()
    if m.code == Code.MATCHMAKING_BEGIN_ALLREDUCE:
        members = tuple(
            GroupMember(
                p.peer_id,
                _mode(p.mode),
                p.bandwidth if p.HasField("bandwidth") else None,
                p.gather,
                p.part_layout,
            )
            for p in m.members
        )
        return BeginAllReduce(MatchmakingGroup(m.group_id, m.group_key, leader, members))
    if m.code in (Code.MATCHMAKING_GROUP_DISBANDED, Code.MATCHMAKING_INTERNAL_ERROR):
        return Disbanded(suggested)
    if m.code in _REJECT_REASONS:
        return Rejected(_REJECT_REASONS[m.code], suggested)
    raise ValueError(f"unknown matchmaking code {m.code}")


# ---------------------------------------------------------------------------------- the shell


class Matchmaking:
    """Matchmaking for one averager on one host; see the module docstring.

    :param dht: a running ``AsyncDHT`` (its host serves the join RPC)
    :param config: matchmaking settings (the prefix names the RPC and the group keys)
    :param schema_hash: only peers with the same hash average together
    :param mode: NODE, CLIENT (never leads, serves nothing) or AUX
    :param bandwidth: ours, for load balancing (None: unknown)
    :param dht_timeout: bound on each DHT read or store (default: the longer of
      ``min_matchmaking_time`` and the config's ``declaration_linger``: a read that long still
      finds the declarations that were current when it began)
    :param part_layout: the newest all-reduce part layout we speak (tests pass 0 to act as
      an older version)
    :param time_keyword: the keyword that set ``min_matchmaking_time``, as warnings name it
    """

    def __init__(
        self,
        dht,
        config: MatchmakingConfig,
        schema_hash: bytes,
        *,
        mode: AveragingMode = AveragingMode.NODE,
        bandwidth: float | None = None,
        dht_timeout: float | None = None,
        part_layout: int = PART_LAYOUT,
        time_keyword: str = "min_matchmaking_time",
    ):
        self.dht = dht
        self.time_keyword = time_keyword
        self.p2p = dht.p2p
        self.config = config
        self.schema_hash = schema_hash
        self.mode = mode
        self.bandwidth = bandwidth
        self.part_layout = part_layout
        # A declaration stays readable declaration_linger past its expiration: a read up to that
        # slow still finds the peers that were looking when it began (they declared again since).
        self.dht_timeout = (
            dht_timeout
            if dht_timeout is not None
            else max(config.min_matchmaking_time, config.declaration_linger)
        )
        self._warned_slow_dht = False
        self.slowest_read = 0.0  # seconds, the slowest read of the group key so far
        self.peer_id_bytes: PeerId = self.p2p.peer_id.to_bytes()
        self.handler_name = rpc_join_group_name(config.prefix)
        self._nursery: trio.Nursery | None = None
        self._round_lock = trio.Lock()
        # state of the current round (None between rounds)
        self._core: MatchmakingCore | None = None
        self._round_nursery: trio.Nursery | None = None
        self._round_done = trio.Event()
        self._wake = trio.Event()
        self._followers: dict[PeerId, trio.MemorySendChannel] = {}
        self._join_calls: dict[PeerId, trio.CancelScope] = {}
        self.rounds_started = 0
        # told each assembled group's id at once, before ``look_for_group`` returns, and (the
        # second) when ``look_for_group`` is cancelled after its group was assembled
        self.on_group_assembled: Callable[[bytes], None] | None = None
        self.on_group_dropped: Callable[[bytes], None] | None = None
        # how long leaders took to answer our join requests: slow (relayed, loaded) paths get
        # longer timeouts, up to a matchmaking window
        self.answer_times = AnswerTimes(config.request_timeout, config.min_matchmaking_time)

    @classmethod
    @asynccontextmanager
    async def create(
        cls, dht, config: MatchmakingConfig, schema_hash: bytes, **kwargs: Any
    ) -> AsyncIterator[Matchmaking]:
        """Register the join handler (unless a client); remove it and stop every task on exit."""
        self = cls(dht, config, schema_hash, **kwargs)
        # declarations are owned: only a peer can write (or blank) its own subkey
        dht.add_validators([PeerRecordValidator([GROUP_KEY_PATTERN])])
        serve = self.mode != AveragingMode.CLIENT
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if serve:
                self.p2p.add_protobuf_handler(
                    self.handler_name,
                    self._rpc_join_group,
                    pb.MatchmakingJoinRequest,
                    stream_output=True,
                    max_message_size=MAX_MESSAGE_SIZE,
                )
            try:
                yield self
            finally:
                if serve:
                    self.p2p.remove_protobuf_handler(self.handler_name)
                nursery.cancel_scope.cancel()

    @property
    def looking_for_group(self) -> bool:
        return self._core is not None and not self._core.done

    def may_be_in_group_of(self, leader: bytes) -> bool:
        """A join request to ``leader`` (any leader if b"") is in flight: it may have put us in
        a group already (its start message not here yet). False once the round ended, was
        cancelled or failed."""
        if not self.looking_for_group:
            return False
        return leader in self._join_calls if leader else bool(self._join_calls)

    def statistics(self) -> MatchmakingStatistics | None:
        """The current round's statistics (None between rounds)."""
        return self._core.statistics() if self._core is not None else None

    def set_scheduled_time(self, scheduled_time: float) -> None:
        """Change when we intend to average; the next declaration of this round uses it."""
        if self._core is not None and not self._core.done:
            self._core.scheduled_time = scheduled_time

    # ------------------------------------------------------------------ one round

    async def look_for_group(
        self,
        group_bits: str,
        *,
        deadline: float,
        scheduled_time: float | None = None,
        gather: bytes = b"",
        expected_group_size: int | None = None,
        banned: Iterable[bytes] = (),
    ) -> GroupAssembled:
        """Find a group under ``{prefix}.0b{group_bits}`` before ``deadline`` (DHT time).
        ``expected_group_size``: as a leader, assemble as soon as the group has this many
        members (e.g. every peer known to be present) instead of at the declaration's end.
        ``banned``: peer ids (bytes) we neither lead nor follow.

        :raises MatchmakingError: no group (too few peers, schema mismatch, deadline)
        """
        async with self._round_lock:
            core = MatchmakingCore(
                self.config,
                self.peer_id_bytes,
                self.schema_hash,
                group_bits,
                deadline=deadline,
                mode=self.mode,
                bandwidth=self.bandwidth,
                gather=gather,
                scheduled_time=scheduled_time,
                nonce=os.urandom(16),
                expected_group_size=expected_group_size,
                part_layout=self.part_layout,
                banned=banned,
                request_timeouts=self._request_timeouts(get_dht_time()),
            )
            self.rounds_started += 1
            self._core, self._round_done = core, trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    self._round_nursery = nursery
                    now = get_dht_time()
                    logger.debug(
                        "%s %s: round starts (scheduled in %.3f s, deadline in %.3f s)",
                        _short(self.peer_id_bytes),
                        core.group_key,
                        (scheduled_time or now) - now,
                        deadline - now,
                    )
                    self._dispatch(core.start(now))
                    nursery.start_soon(self._run_timer, core)
                    await self._round_done.wait()
                    nursery.cancel_scope.cancel()
            except BaseException:
                assembled = core.result if core.done else None
                if isinstance(assembled, GroupAssembled) and self.on_group_dropped is not None:
                    self.on_group_dropped(assembled.group.group_id)  # cancelled just after
                raise
            finally:
                if not core.done:  # cancelled: disband followers, withdraw (no awaits here)
                    self._dispatch(core.cancel(get_dht_time()))
                for channel in self._followers.values():
                    channel.close()
                self._followers.clear()
                self._join_calls.clear()
                self._core = self._round_nursery = None
        result = core.result
        if isinstance(result, GroupAssembled):
            return result
        assert isinstance(result, MatchmakingFailed)
        logger.debug("no group under %s: %s", core.group_key, core.statistics())
        raise MatchmakingError(result.reason, result.detail)

    def _request_timeouts(self, now: float) -> dict[PeerId, float]:
        """Per peer we are connected to or heard from before: how long to wait for its answer
        (``AnswerTimes``; longer where we hold no direct connection)."""
        paths = {peer.to_bytes(): kinds for peer, kinds in self.p2p.connection_paths().items()}
        peers = set(paths) | {p for p in self.answer_times.peers() if isinstance(p, bytes)}
        timeouts = {}
        for peer in peers:
            direct = "direct" in paths.get(peer, ())
            seconds = self.answer_times.timeout(peer, now, direct=direct)
            if seconds > self.config.request_timeout:
                timeouts[peer] = seconds
        return timeouts

    def _observe_answer_time(
        self, core: MatchmakingCore, leader: PeerId, seconds: float, now: float
    ) -> None:
        """Note how long ``leader`` took to answer, for this round too (the core's next
        request to it waits as long as ``AnswerTimes`` now says)."""
        self.answer_times.observe(leader, seconds, now)
        if not core.done:
            paths = {p.to_bytes(): kinds for p, kinds in self.p2p.connection_paths().items()}
            direct = "direct" in paths.get(leader, ())
            core.learn_request_timeout(
                leader, self.answer_times.timeout(leader, now, direct=direct)
            )

    async def _run_timer(self, core: MatchmakingCore) -> None:
        while not core.done:
            wake = self._wake = trio.Event()
            delay = core.next_deadline() - get_dht_time()
            if delay > 0:
                with trio.move_on_after(delay):
                    await wake.wait()
                continue
            actions = core.tick(get_dht_time())
            self._dispatch(actions)
            if not actions and core.next_deadline() <= get_dht_time():
                await trio.sleep(0.01)  # nothing moved: do not spin
            else:
                await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ carrying out actions

    def _dispatch(self, actions: list[Action]) -> None:
        """Carry out ``actions`` in order, without awaiting (see the module docstring)."""
        core = self._core
        for action in actions:
            if logger.isEnabledFor(logging.DEBUG):
                line = _describe(action)
                if line is not None and core is not None:
                    logger.debug("%s %s: %s", _short(self.peer_id_bytes), core.group_key, line)
            if isinstance(action, Declare):
                assert self._nursery is not None
                self._nursery.start_soon(self._store_declaration, action)
            elif isinstance(action, FetchDeclarations):
                if self._round_nursery is not None and core is not None:
                    self._round_nursery.start_soon(self._fetch_declarations, core, action.key)
            elif isinstance(action, SendJoinRequest):
                if self._round_nursery is not None and core is not None:
                    scope = trio.CancelScope()
                    self._join_calls[action.leader] = scope
                    self._round_nursery.start_soon(self._join_call, core, action, scope)
            elif isinstance(action, CancelJoinRequest):
                join_call = self._join_calls.pop(action.leader, None)
                if join_call is not None:
                    join_call.cancel()
            elif isinstance(action, SendToFollower):
                channel = self._followers.get(action.follower)
                if channel is not None:
                    try:
                        channel.send_nowait(action.message)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    if action.final:
                        del self._followers[action.follower]
                        channel.close()
            elif isinstance(action, (GroupAssembled, MatchmakingFailed)):
                if isinstance(action, GroupAssembled) and self.on_group_assembled is not None:
                    self.on_group_assembled(action.group.group_id)
                self._round_done.set()
        self._wake.set()

    async def _store_declaration(self, action: Declare) -> None:
        d = action.declaration
        with trio.move_on_after(self.dht_timeout):
            try:
                value = encode_declaration(d)
                await self.dht.store(action.key, value, d.readable_until, subkey=d.peer_id)
            except Exception as e:  # a failed declaration is not fatal: peers just miss us
                logger.debug("could not declare under %s: %r", action.key, e)

    async def _fetch_declarations(self, core: MatchmakingCore, key: str) -> None:
        found = None
        failed = True
        started = trio.current_time()
        with trio.move_on_after(self.dht_timeout):
            try:
                found = await self.dht.get(key, latest=True)
                failed = False
            except Exception as e:
                logger.debug("could not read %s: %r", key, e)
        elapsed = trio.current_time() - started
        self.slowest_read = max(self.slowest_read, elapsed)
        linger = self.config.declaration_linger
        if elapsed > max(linger, self.dht_timeout) / 2 and not self._warned_slow_dht:
            # A declaration current when a read begins stays readable declaration_linger longer
            # (and reads are cut at dht_timeout): reads near that slow find peers only after
            # they moved on, or nothing, so groups rarely form.
            self._warned_slow_dht = True
            logger.warning(
                "reading matchmaking declarations took %.1f s (they stay readable %.1f s past "
                "their expiration; reads are cut at %.1f s): groups will rarely form; raise %s "
                "(or give the DHT more CPU)",
                elapsed,
                linger,
                self.dht_timeout,
                self.time_keyword,
            )
        if core is not self._core or core.done:
            return
        if failed:
            self._dispatch(core.fetch_failed(get_dht_time()))
            return
        declarations = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                d = decode_declaration(subkey, item.value, item.expiration_time)
                if d is not None:
                    declarations.append(d)
        if logger.isEnabledFor(logging.DEBUG):
            now = get_dht_time()
            logger.debug(
                "%s %s: read in %.3f s: %s",
                _short(self.peer_id_bytes),
                key,
                elapsed,
                ", ".join(
                    f"{_short(d.peer_id)}{'' if d.looking_for_group else '(done)'}"
                    f"@{d.expiration - now:+.2f}"
                    for d in declarations
                )
                or "nobody",
            )
        self._dispatch(core.receive_declarations(declarations, get_dht_time()))

    # ------------------------------------------------------------------ as a follower

    async def _join_call(
        self, core: MatchmakingCore, action: SendJoinRequest, scope: trio.CancelScope
    ) -> None:
        leader = action.leader
        final = False
        answered = False
        asked_at = get_dht_time()

        def current() -> bool:  # this call is still the one the core waits on
            return self._join_calls.get(leader) is scope and core is self._core and not core.done

        with scope:
            try:
                async with self.p2p.iterate_protobuf_handler(
                    PeerID(leader),
                    self.handler_name,
                    encode_join_request(action.request),
                    pb.MatchmakingResponse,
                    next_message_timeout=None,  # the core times the call out
                    max_message_size=MAX_MESSAGE_SIZE,
                ) as responses:
                    async for response in responses:
                        message = decode_leader_message(leader, response)
                        logger.debug(
                            "%s: %s answered %s after %.3f s%s",
                            _short(self.peer_id_bytes),
                            _short(leader),
                            _describe(SendToFollower(leader, message)),
                            get_dht_time() - asked_at,
                            "" if current() else " (stale)",
                        )
                        if not answered:  # the first answer: how slow this path is
                            answered = True
                            now = get_dht_time()
                            self._observe_answer_time(core, leader, now - asked_at, now)
                        if not current():
                            return
                        final = not isinstance(message, Accepted)
                        self._dispatch(core.handle_leader_message(leader, message, get_dht_time()))
                        if final:
                            break
            except (P2PError, ValueError, TypeError) as e:
                logger.debug(
                    "%s: join call to %s failed after %.3f s: %r",
                    _short(self.peer_id_bytes),
                    _short(leader),
                    get_dht_time() - asked_at,
                    e,
                )
        if scope.cancelled_caught and not answered:  # we stopped waiting: it is slower than that
            now = get_dht_time()
            self._observe_answer_time(core, leader, now - asked_at, now)
        if not final and current():
            self._dispatch(core.request_failed(leader, get_dht_time()))
        if self._join_calls.get(leader) is scope:
            del self._join_calls[leader]

    # ------------------------------------------------------------------ as a leader

    async def _rpc_join_group(
        self, request: pb.MatchmakingJoinRequest, context
    ) -> AsyncIterator[pb.MatchmakingResponse]:
        peer: PeerId = context.remote_id.to_bytes()
        core = self._core
        if core is None or core.done:
            yield encode_leader_message(Rejected(RejectReason.NOT_LOOKING))
            return
        if peer in self._followers:  # one join call per peer at a time
            yield encode_leader_message(Rejected(RejectReason.DUPLICATE))
            return
        try:
            join = decode_join_request(request)
        except (ValueError, TypeError):
            core.reject_malformed_request(peer)
            yield encode_leader_message(Rejected(RejectReason.PROTOCOL_VIOLATION))
            return
        send, receive = trio.open_memory_channel(math.inf)
        self._followers[peer] = send
        logger.debug(
            "%s %s: join request from %s (its expiration %.3f, ours %.3f)",
            _short(self.peer_id_bytes),
            core.group_key,
            _short(peer),
            join.expiration,
            core.expiration,
        )
        try:
            self._dispatch(core.handle_join_request(peer, join, get_dht_time()))
            async with receive:
                async for message in receive:
                    yield encode_leader_message(message)
        finally:
            if self._followers.get(peer) is send:  # closed before a final message
                del self._followers[peer]
                send.close()
                if core is self._core and not core.done:
                    logger.debug("%s: follower %s left", _short(self.peer_id_bytes), _short(peer))
                    self._dispatch(core.follower_left(peer, get_dht_time()))
