"""MatchmakingCore wired to other cores in memory: a dict for the DHT, a FIFO queue for the
network, and a clock that jumps to the next deadline. No sockets, no sleeps."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import random
import statistics

import pytest

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking_core import (
    Accepted,
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
    MatchmakingConfig,
    MatchmakingCore,
    MatchmakingFailed,
    MatchmakingGroup,
    Phase,
    Rejected,
    RejectReason,
    SendJoinRequest,
    SendToFollower,
    derive_group_id,
    is_valid_group_key,
    leader_candidates,
    make_group_key,
    may_lead,
    next_group_bits,
    order_members,
)

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
SCHEMA = b"schema-1"


def pid(i: int) -> bytes:
    return f"peer-{i:03d}".encode()


class Swarm:
    """Delivers the cores' actions to each other.

    Each join call is a stream ``(follower, leader, n)``; messages on a stream that closed are
    dropped, like a real transport would. ``kill(peer)`` closes its streams (the other side
    sees the failure); ``freeze(peer)`` makes it silent (its streams stay open, nothing answers).
    ``hide`` maps a peer to peers whose declarations it cannot see. ``latency`` maps a pair of
    peers (``frozenset``) to the one-way delay of their messages (a slow or relayed path; a
    closed stream is noticed after the same delay); a DHT read answers after ``read_delay``.
    The join requests of ``old_joiners`` go without the joiner's patience (an older peer's).
    ``old_peers`` write and read declarations as peers before ``declaration_linger`` did: no
    expiration in the value, so a record's DHT expiration is its expiration (give their cores
    ``declaration_linger=0``: then they act as the older core did).
    """

    def __init__(self, config: MatchmakingConfig):
        self.config = config
        self.now = 0.0
        self.cores: dict[bytes, MatchmakingCore] = {}
        self.dht: dict[str, dict[bytes, Declaration]] = collections.defaultdict(dict)
        self.queue: collections.deque = collections.deque()
        self.streams: dict[tuple[bytes, bytes], int] = {}  # (follower, leader) -> stream number
        self.stream_counter = 0
        self.abandoned: set[int] = set()  # streams the follower closed (or that broke)
        self.pending_starts: list[tuple[float, bytes]] = []
        self.results: dict[bytes, GroupAssembled | MatchmakingFailed] = {}
        self.log: list[tuple[float, bytes, object]] = []
        self.dead: set[bytes] = set()
        self.frozen: set[bytes] = set()
        self.hide: dict[bytes, set[bytes]] = {}
        self.blank_schema = False
        self.latency: dict[frozenset, float] = {}
        self.read_delay = 0.0
        self.old_joiners: set[bytes] = set()
        self.old_peers: set[bytes] = set()
        self.in_flight: list[tuple[float, int, bytes, object]] = []  # (due, n, target, fn)

    def add(self, peer: bytes, *, start: float = 0.0, config=None, deadline=30.0, **kwargs):
        kwargs.setdefault("schema_hash", SCHEMA)
        self.cores[peer] = MatchmakingCore(config or self.config, peer, deadline=deadline, **kwargs)
        self.pending_starts.append((start, peer))
        return self.cores[peer]

    # ------------------------------------------------------------------ delivery

    def alive(self, peer: bytes) -> bool:
        return peer in self.cores and peer not in self.dead and peer not in self.frozen

    def dispatch(self, src: bytes, actions) -> None:
        for action in actions:
            self.log.append((self.now, src, action))
            if isinstance(action, Declare):
                declaration = action.declaration
                if src in self.old_peers:
                    declaration = as_legacy(declaration)
                record = self.dht[action.key].get(declaration.peer_id)
                if record is None or record.readable_until <= declaration.readable_until:
                    self.dht[action.key][declaration.peer_id] = declaration
            elif isinstance(action, FetchDeclarations):
                hidden = self.hide.get(src, set())
                snapshot = [
                    d
                    for d in self.dht[action.key].values()
                    if d.readable_until > self.now and d.peer_id not in hidden
                ]
                if src in self.old_peers:  # they take a record's DHT expiration for its expiration
                    snapshot = [as_legacy(d) for d in snapshot]
                if self.blank_schema:
                    snapshot = [dataclasses.replace(d, schema_hash=b"") for d in snapshot]
                answer = (src, lambda c, s=snapshot: c.receive_declarations(s, self.now))
                if self.read_delay > 0:
                    self.stream_counter += 1
                    heapq.heappush(
                        self.in_flight, (self.now + self.read_delay, self.stream_counter, *answer)
                    )
                else:
                    self.queue.append(answer)
            elif isinstance(action, SendJoinRequest):
                if src in self.old_joiners:
                    request = dataclasses.replace(action.request, patience=None, answer_by=None)
                    action = SendJoinRequest(action.leader, request)
                self.stream_counter += 1
                stream = (src, action.leader)
                self.streams[stream] = self.stream_counter
                if action.leader in self.dead or action.leader not in self.cores:
                    del self.streams[stream]
                    self.queue.append(
                        (src, lambda c, lead=action.leader: c.request_failed(lead, self.now))
                    )
                else:
                    self._send(
                        src,
                        action.leader,
                        lambda c, f=src, r=action.request: c.handle_join_request(f, r, self.now),
                    )
            elif isinstance(action, CancelJoinRequest):
                number = self.streams.pop((src, action.leader), None)
                if number is not None:
                    self.abandoned.add(number)
                    self._send(src, action.leader, lambda c, f=src: c.follower_left(f, self.now))
            elif isinstance(action, SendToFollower):
                stream = (action.follower, src)
                number = self.streams.get(stream)
                if number is None:
                    continue  # the follower closed the stream
                if action.final:
                    del self.streams[stream]

                def deliver(c, lead=src, msg=action.message, n=number):
                    if n in self.abandoned:
                        return []  # the follower closed this stream meanwhile
                    return c.handle_leader_message(lead, msg, self.now)

                self._send(src, action.follower, deliver)
            elif isinstance(action, (GroupAssembled, MatchmakingFailed)):
                assert src not in self.results, "two terminal actions"
                self.results[src] = action
            else:  # pragma: no cover
                raise AssertionError(action)

    def _send(self, src: bytes, target: bytes, fn) -> None:
        delay = self.latency.get(frozenset((src, target)), 0.0)
        if delay <= 0:
            self.queue.append((target, fn))
        else:
            self.stream_counter += 1  # a tie breaker: equal due times keep their order
            heapq.heappush(self.in_flight, (self.now + delay, self.stream_counter, target, fn))

    def _arrive(self) -> None:
        while self.in_flight and self.in_flight[0][0] <= self.now:
            _, _, target, fn = heapq.heappop(self.in_flight)
            self.queue.append((target, fn))

    def drain(self) -> None:
        self._arrive()
        steps = 0
        while self.queue:
            steps += 1
            assert steps < 100_000, "message storm"
            target, fn = self.queue.popleft()
            if self.alive(target):
                self.dispatch(target, fn(self.cores[target]))

    def kill(self, peer: bytes) -> None:
        self.dead.add(peer)
        for follower, leader in list(self.streams):
            if peer in (follower, leader):
                self.abandoned.add(self.streams[(follower, leader)])
            if leader == peer:
                del self.streams[(follower, leader)]
                self.queue.append((follower, lambda c, p=peer: c.request_failed(p, self.now)))
            elif follower == peer:
                del self.streams[(follower, leader)]
                self.queue.append((leader, lambda c, p=peer: c.follower_left(p, self.now)))
        self.drain()

    def freeze(self, peer: bytes) -> None:
        self.frozen.add(peer)

    def run(self, until: float = math.inf) -> dict[bytes, GroupAssembled | MatchmakingFailed]:
        for _ in range(100_000):
            self.drain()
            for t, peer in sorted(self.pending_starts):
                if t <= self.now:
                    self.pending_starts.remove((t, peer))
                    self.dispatch(peer, self.cores[peer].start(self.now))
                    self.drain()
            live = [p for p in sorted(self.cores) if self.alive(p) and not self.cores[p].done]
            times = [self.cores[p].next_deadline() for p in live] + [
                t for t, _ in self.pending_starts
            ]
            times += [due for due, *_ in self.in_flight]
            if not times or min(times) > until or min(times) == math.inf:
                return self.results
            assert min(times) >= self.now - 1e-9, "a deadline in the past was not handled"
            self.now = max(self.now, min(times))
            for peer in live:
                if self.alive(peer) and self.cores[peer].next_deadline() <= self.now:
                    self.dispatch(peer, self.cores[peer].tick(self.now))
                    self.drain()
        raise AssertionError("the simulation did not settle")

    # ------------------------------------------------------------------ checks

    def groups(self) -> dict[bytes, MatchmakingGroup]:
        return {p: r.group for p, r in self.results.items() if isinstance(r, GroupAssembled)}

    def check_consistent(self) -> list[MatchmakingGroup]:
        """Every member of an assembled group got the same group; no peer is in two groups."""
        groups = self.groups()
        distinct = {g.group_id: g for g in groups.values()}
        seen: set[bytes] = set()
        for group in distinct.values():
            for peer in group.peer_ids:
                assert groups.get(peer) == group, f"{peer} disagrees about {group}"
                assert peer not in seen
                seen.add(peer)
            target = self.config.target_group_size
            assert self.config.min_group_size <= group.size <= (target or math.inf)
        return sorted(distinct.values(), key=lambda g: g.peer_ids)

    def sent(self, kind, src=None):
        return [a for _, s, a in self.log if isinstance(a, kind) and (src is None or s == src)]


def as_legacy(d: Declaration) -> Declaration:
    """A declaration as an older peer writes or reads it: its DHT expiration is its expiration."""
    return dataclasses.replace(d, expiration=d.readable_until, dht_expiration=None)


def config(**kwargs) -> MatchmakingConfig:
    kwargs.setdefault("prefix", "test")
    kwargs.setdefault("target_group_size", 4)
    kwargs.setdefault("min_group_size", 2)
    kwargs.setdefault("min_matchmaking_time", 5.0)
    kwargs.setdefault("request_timeout", 2.0)
    return MatchmakingConfig(**kwargs)


# ---------------------------------------------------------------------------------- swarms


def test_four_peers_target_four_form_one_group():
    swarm = Swarm(config())
    for i in range(4):
        swarm.add(pid(i), gather=f"data{i}".encode(), bandwidth=float(i + 1))
    results = swarm.run()
    assert len(results) == 4
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(i) for i in range(4)}
    assert group.leader == pid(0)  # equal expirations: the lowest peer id leads
    assert swarm.now < 5.0  # a full group assembles at once, not at the expiration
    for member in group.members:
        i = int(member.peer_id[-3:])
        assert member.gather == f"data{i}".encode() and member.bandwidth == float(i + 1)
    assert {results[p].is_leader for p in group.peer_ids} == {True, False}
    assert sum(results[p].is_leader for p in group.peer_ids) == 1
    # assembled members leave their declarations to expire (no DHT store during the round)
    assert all(d.looking_for_group for d in swarm.dht["test.0b"].values())


@pytest.mark.parametrize("layouts, want", [((1, 1, 1, 1), 1), ((1, 0, 1, 1), 0), ((0,) * 4, 0)])
def test_group_part_layout_is_the_lowest_its_members_speak(layouts, want):
    swarm = Swarm(config())
    for i, layout in enumerate(layouts):
        swarm.add(pid(i), part_layout=layout)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert {m.peer_id: m.part_layout for m in group.members} == {
        pid(i): layout for i, layout in enumerate(layouts)
    }
    assert group.part_layout == want


def test_part_layout_survives_the_wire_and_older_peers_read_as_zero():
    from swarmtrain.averaging.matchmaking import (
        decode_join_request,
        decode_leader_message,
        encode_join_request,
        encode_leader_message,
    )

    request = JoinRequest("p.0b", SCHEMA, 1.0, part_layout=1)
    assert decode_join_request(encode_join_request(request)) == request
    members = (GroupMember(pid(0), part_layout=1), GroupMember(pid(1), part_layout=1))
    group = MatchmakingGroup(b"g", "p.0b", pid(0), members)
    wire = encode_leader_message(BeginAllReduce(group))
    assert decode_leader_message(pid(0), wire).group.part_layout == 1
    # an older joiner or leader does not know the field: it reads (and relays) nothing
    for member in wire.members:
        member.ClearField("part_layout")
    assert decode_leader_message(pid(0), wire).group.part_layout == 0
    old_request = encode_join_request(request)
    old_request.ClearField("part_layout")
    assert decode_join_request(old_request).part_layout == 0


def test_eight_peers_target_four_form_two_groups():
    swarm = Swarm(config())
    for i in range(8):
        swarm.add(pid(i))
    swarm.run()
    groups = swarm.check_consistent()
    assert [g.size for g in groups] == [4, 4]
    assert len({g.group_id for g in groups}) == 2
    assert sorted(g.leader for g in groups)[0] == pid(0)


@pytest.mark.parametrize("seed", range(6))
def test_random_swarm_forms_consistent_groups(seed):
    """Peers start at random times with random matchmaking windows; whatever happens, members
    agree on their group, nobody is in two groups, and everyone ends with a result."""
    rng = random.Random(seed)
    swarm = Swarm(config(target_group_size=4, min_group_size=2))
    n = 13
    for i in range(n):
        cfg = config(min_matchmaking_time=rng.uniform(1.0, 6.0))
        swarm.add(pid(i), start=rng.uniform(0.0, 4.0), config=cfg, deadline=40.0)
    results = swarm.run()
    assert len(results) == n
    groups = swarm.check_consistent()
    grouped = sum(g.size for g in groups)
    assert grouped >= n - 1  # at most one peer is left alone (13 = 4 + 4 + 4 + 1 at worst)
    for result in results.values():
        if isinstance(result, MatchmakingFailed):
            assert result.reason in (FailureReason.TOO_FEW_PEERS, FailureReason.DEADLINE)
            assert result.detail


def test_min_group_size_not_reached_fails_with_too_few_peers():
    swarm = Swarm(config(min_group_size=3))
    swarm.add(pid(0), deadline=12.0)
    swarm.add(pid(1), deadline=12.0)
    results = swarm.run()
    for peer in (pid(0), pid(1)):
        assert isinstance(results[peer], MatchmakingFailed)
        assert results[peer].reason == FailureReason.TOO_FEW_PEERS
        assert "min_group_size=3" in results[peer].detail
    # the leader disbanded its follower at each expiration before the deadline
    disbands = [a for a in swarm.sent(SendToFollower, pid(0)) if isinstance(a.message, Disbanded)]
    assert disbands and all(a.follower == pid(1) for a in disbands)
    assert swarm.now == 12.0


def test_alone_fails_with_too_few_peers():
    swarm = Swarm(config())
    swarm.add(pid(0), deadline=7.0)
    result = swarm.run()[pid(0)]
    assert result.reason == FailureReason.TOO_FEW_PEERS
    assert "found 1 peer(s)" in result.detail


def test_min_group_size_reached_at_expiration_assembles_a_smaller_group():
    swarm = Swarm(config(target_group_size=4, min_group_size=3))
    for i in range(3):
        swarm.add(pid(i))
    swarm.run()
    (group,) = swarm.check_consistent()
    assert group.size == 3
    assert swarm.now == 5.0  # not full: the leader waited for its expiration


def test_expected_group_size_assembles_without_waiting_for_the_expiration():
    swarm = Swarm(config(target_group_size=None, min_group_size=2))
    for i in range(3):
        swarm.add(pid(i), expected_group_size=3)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert group.size == 3
    assert swarm.now < 5.0  # everyone expected is here: no wait for the declaration to lapse


def test_expected_group_size_too_low_or_absent_changes_nothing():
    for expected in (None, 1):
        swarm = Swarm(config(target_group_size=None, min_group_size=2))
        for i in range(3):
            swarm.add(pid(i), expected_group_size=expected)
        swarm.run()
        (group,) = swarm.check_consistent()
        assert group.size == 3 and swarm.now == 5.0
    swarm = Swarm(config(target_group_size=2))  # the config's target still caps the group
    assert swarm.add(pid(0), expected_group_size=3).assemble_at == 2
    with pytest.raises(TypeError):
        swarm.add(pid(1), expected_group_size=2.0)


def test_schema_mismatch_is_a_clear_failure():
    swarm = Swarm(config())
    swarm.add(pid(0), schema_hash=b"schema-A", deadline=8.0)
    swarm.add(pid(1), schema_hash=b"schema-B", deadline=8.0)
    results = swarm.run()
    for peer in (pid(0), pid(1)):
        assert results[peer].reason == FailureReason.SCHEMA_MISMATCH, results[peer]
        assert "another schema" in results[peer].detail
    assert swarm.cores[pid(1)].statistics().schema_mismatches == 1


def test_schema_mismatch_join_is_rejected_with_the_reason():
    swarm = Swarm(config())
    swarm.blank_schema = True  # records that do not say their schema: joiners must ask
    swarm.add(pid(0), schema_hash=b"schema-A", deadline=8.0)
    swarm.add(pid(1), schema_hash=b"schema-B", deadline=8.0)
    results = swarm.run()
    rejects = [a.message for a in swarm.sent(SendToFollower, pid(0))]
    assert rejects and set(rejects) == {Rejected(RejectReason.BAD_SCHEMA_HASH)}
    follower = swarm.cores[pid(1)].statistics()
    assert follower.rejections_received == {RejectReason.BAD_SCHEMA_HASH: len(rejects)}
    for peer in (pid(0), pid(1)):
        assert results[peer].reason == FailureReason.SCHEMA_MISMATCH


def test_leader_disbands_at_deadline_and_followers_hear_it():
    swarm = Swarm(config(target_group_size=4, min_group_size=3))
    swarm.add(pid(0), deadline=4.0)  # its expiration is capped by its deadline
    swarm.add(pid(1), deadline=20.0)
    results = swarm.run()
    assert results[pid(0)].reason == FailureReason.TOO_FEW_PEERS
    messages = [a.message for a in swarm.sent(SendToFollower, pid(0))]
    assert messages == [Accepted(), Disbanded()]
    assert results[pid(1)].reason == FailureReason.TOO_FEW_PEERS
    assert swarm.now == 20.0


def test_follower_whose_leader_vanishes_finds_another():
    swarm = Swarm(config(target_group_size=5, min_group_size=3))
    for i in range(4):
        swarm.add(pid(i), deadline=25.0)
    swarm.add(pid(4), start=1.0, deadline=25.0)
    swarm.run(until=0.0)
    assert swarm.cores[pid(1)].phase == Phase.FOLLOWING
    assert swarm.cores[pid(0)].followers == (pid(1), pid(2), pid(3))
    swarm.kill(pid(0))  # its streams fail (its stale declaration stays in the DHT)
    results = swarm.run()
    assert pid(0) not in results
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(1), pid(2), pid(3), pid(4)}
    assert swarm.now < 25.0


def test_follower_whose_leader_goes_silent_times_out_and_retries():
    swarm = Swarm(config(target_group_size=4, min_group_size=2))
    for i in range(3):
        swarm.add(pid(i), deadline=30.0)
    swarm.run(until=0.0)
    assert swarm.cores[pid(1)].phase == Phase.FOLLOWING
    swarm.freeze(pid(0))  # accepted us, then never speaks again
    results = swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(1), pid(2)}
    # they waited for their own expiration plus request_timeout, then gave up on pid(0)
    cancels = swarm.sent(CancelJoinRequest)
    assert {(a.leader) for a in cancels} == {pid(0)}
    assert 7.0 <= swarm.now < 30.0
    assert set(results) == {pid(1), pid(2)}


def test_unresponsive_leader_request_times_out():
    swarm = Swarm(config(target_group_size=2, min_group_size=2))
    swarm.add(pid(0), deadline=30.0)
    swarm.freeze(pid(0))  # declared, then never answers
    swarm.dispatch(pid(0), swarm.cores[pid(0)].start(0.0))
    swarm.pending_starts.clear()
    swarm.add(pid(1), start=0.5, deadline=30.0)
    swarm.add(pid(2), start=0.5, deadline=30.0)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(1), pid(2)}
    assert swarm.sent(CancelJoinRequest, pid(1))[0] == CancelJoinRequest(pid(0))


def test_deterministic_leader_choice():
    decls = [
        Declaration(pid(5), 10.0, schema_hash=SCHEMA),
        Declaration(pid(3), 10.0, schema_hash=SCHEMA),
        Declaration(pid(9), 8.0, schema_hash=SCHEMA),
        Declaration(pid(1), 12.0, schema_hash=SCHEMA),  # expires after us: would follow us
        Declaration(pid(2), 9.0, schema_hash=b"other"),  # another schema
        Declaration(pid(4), 9.5, schema_hash=SCHEMA, looking_for_group=False),
        Declaration(pid(6), 9.5, schema_hash=SCHEMA, mode=CLIENT),
        Declaration(pid(7), 0.5, schema_hash=SCHEMA),  # expired
        Declaration(pid(8), 10.0, schema_hash=SCHEMA),  # same expiration, higher id than us
    ]
    for order in (decls, decls[::-1]):
        found = leader_candidates(order, pid(6), 10.0, SCHEMA, now=1.0)
        assert [d.peer_id for d in found] == [pid(9), pid(3), pid(5)]
    found = leader_candidates(decls, pid(6), 10.0, SCHEMA, 1.0, exclude={(pid(9), 8.0)})
    assert found[0].peer_id == pid(3)
    # a client never leads, so the peer-id tie break does not apply to it
    found = leader_candidates(decls, pid(0), 10.0, SCHEMA, 1.0, mode=CLIENT)
    assert [d.peer_id for d in found] == [pid(9), pid(3), pid(5), pid(8)]
    assert may_lead(pid(3), 10.0, pid(5), 10.0) and not may_lead(pid(5), 10.0, pid(3), 10.0)
    assert may_lead(pid(5), 10.0, pid(3), 10.0, CLIENT)
    assert not may_lead(pid(3), 10.5, pid(5), 10.0, CLIENT)


def test_group_ids_equal_on_all_members_and_unique():
    swarm = Swarm(config(target_group_size=2))
    for i in range(6):
        swarm.add(pid(i))
    swarm.run()
    groups = swarm.check_consistent()
    assert len(groups) == 3 and len({g.group_id for g in groups}) == 3
    for group in groups:
        ids = {swarm.results[p].group.group_id for p in group.peer_ids}
        assert ids == {group.group_id} and len(group.group_id) == 32


def test_redirect_to_the_leaders_leader():
    # pid(1) and pid(2) start first (expiration 5); pid(0) comes later with a shorter window
    # (expiration 3): pid(1) follows it and redirects its own follower pid(2) there.
    swarm = Swarm(config(target_group_size=3, min_group_size=2))
    swarm.add(pid(1))
    swarm.add(pid(2))
    swarm.add(pid(0), start=1.0, config=config(target_group_size=3, min_matchmaking_time=2.0))
    swarm.run()
    (group,) = swarm.check_consistent()
    assert group.leader == pid(0) and group.size == 3
    disbanded = [a for a in swarm.sent(SendToFollower, pid(1)) if a.final]
    assert disbanded == [SendToFollower(pid(2), Disbanded(suggested_leader=pid(0)))]


def test_not_a_leader_redirects_a_joiner():
    swarm = Swarm(config(target_group_size=3, min_group_size=2))
    swarm.add(pid(0))
    swarm.add(pid(1))
    swarm.add(pid(2), start=1.0)
    swarm.hide[pid(2)] = {pid(0)}  # pid(2) only sees pid(1), which follows pid(0)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(0), pid(1), pid(2)}
    rejects = [a for a in swarm.sent(SendToFollower, pid(1)) if isinstance(a.message, Rejected)]
    assert rejects == [SendToFollower(pid(2), Rejected(RejectReason.NOT_A_LEADER, pid(0)))]


def test_clients_follow_but_never_lead():
    swarm = Swarm(config(target_group_size=4, min_group_size=2))
    swarm.add(pid(0), mode=CLIENT, deadline=8.0)
    swarm.add(pid(1), mode=CLIENT, deadline=8.0)
    results = swarm.run()
    assert not any(isinstance(a, Declare) for _, _, a in swarm.log)
    # nobody can lead: both fail at the end of their first window (5 s), not at the deadline
    assert all(r.reason == FailureReason.NO_LEADER for r in results.values())
    assert swarm.now == 5.0

    swarm = Swarm(config(target_group_size=4, min_group_size=2))
    swarm.add(pid(0), mode=CLIENT)
    swarm.add(pid(1), mode=AUX)
    swarm.add(pid(2), mode=NODE)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert group.modes[group.index_of(pid(0))] == CLIENT
    assert group.leader in (pid(1), pid(2))


def test_aux_only_group_is_not_assembled():
    swarm = Swarm(config(target_group_size=2, min_group_size=2))
    swarm.add(pid(0), mode=AUX, deadline=8.0)
    swarm.add(pid(1), mode=AUX, deadline=8.0)
    results = swarm.run()
    assert all(r.reason == FailureReason.AUXILIARY_ONLY for r in results.values())
    assert swarm.now == 5.0  # the end of the first window, not the deadline


# Every mix of modes in a group of 2-4 (target_group_size = the number of peers): N node,
# C client (never leads, cannot be dialled), A auxiliary (leads and reduces, sends no tensors).
# A group forms when some peer can lead (N or A) and some peer contributes tensors (N or C).
GROUP = "one group of everyone"
MIX_OUTCOMES = {
    "NN": GROUP, "NC": GROUP, "NA": GROUP, "CA": GROUP,
    "CC": FailureReason.NO_LEADER, "AA": FailureReason.AUXILIARY_ONLY,
    "NNN": GROUP, "NNC": GROUP, "NNA": GROUP, "NCC": GROUP, "NCA": GROUP,
    "NAA": GROUP, "CCA": GROUP, "CAA": GROUP,
    "CCC": FailureReason.NO_LEADER, "AAA": FailureReason.AUXILIARY_ONLY,
    "NNNN": GROUP, "NNNC": GROUP, "NNNA": GROUP, "NNCC": GROUP, "NNCA": GROUP,
    "NNAA": GROUP, "NCCC": GROUP, "NCCA": GROUP, "NCAA": GROUP, "NAAA": GROUP,
    "CCCA": GROUP, "CCAA": GROUP, "CAAA": GROUP,
    "CCCC": FailureReason.NO_LEADER, "AAAA": FailureReason.AUXILIARY_ONLY,
}  # fmt: skip
LETTER_MODES = {"N": NODE, "C": CLIENT, "A": AUX}
# Start orders: everyone at once, or 0.1 s apart with these modes first (clients first: every
# potential leader declares later than the clients' first expiration would allow).
START_ORDERS = ["together", "CAN", "CNA", "NAC", "ACN"]


def test_mix_table_covers_every_mix():
    every = {
        "".join(m) for n in (2, 3, 4) for m in itertools.combinations_with_replacement("NCA", n)
    }
    assert set(MIX_OUTCOMES) == every


@pytest.mark.parametrize("order", START_ORDERS)
@pytest.mark.parametrize("mix", list(MIX_OUTCOMES))
def test_every_mix_of_modes(mix, order):
    mmt, deadline = 5.0, 30.0
    swarm = Swarm(config(target_group_size=len(mix), min_group_size=2, min_matchmaking_time=mmt))
    peers = [(pid(i), LETTER_MODES[letter]) for i, letter in enumerate(mix)]
    if order == "together":
        starts = {p: 0.0 for p, _ in peers}
        for p, mode in peers:
            swarm.add(p, mode=mode, deadline=deadline)
    else:
        starts = start_in_order(swarm, mix, order, deadline=deadline)
    results = swarm.run()
    assert set(results) == {p for p, _ in peers}
    finished_at = {
        src: t for t, src, a in swarm.log if isinstance(a, (GroupAssembled, MatchmakingFailed))
    }
    want = MIX_OUTCOMES[mix]
    if want == GROUP:
        (group,) = swarm.check_consistent()
        assert set(group.peer_ids) == {p for p, _ in peers}
        assert {m.peer_id: m.mode for m in group.members} == dict(peers)
        assert dict(peers)[group.leader] != CLIENT
        # the group is full as soon as the last peer joined: before anyone's window closed
        assert max(finished_at.values()) < min(starts.values()) + mmt
    else:
        for p, _ in peers:
            assert isinstance(results[p], MatchmakingFailed)
            assert results[p].reason == want, results[p]
            # fast: at the end of its first window, not at the deadline
            assert finished_at[p] <= starts[p] + mmt + 1e-9


def start_in_order(swarm: Swarm, mix: str, order: str, **kwargs) -> dict[bytes, float]:
    """Add a peer per letter of ``mix``, starting 0.1 s apart, modes in ``order`` first."""
    ranked = sorted(range(len(mix)), key=lambda i: (order.index(mix[i]), i))
    starts = {pid(i): 0.1 * rank for rank, i in enumerate(ranked)}
    for i, letter in enumerate(mix):
        swarm.add(pid(i), mode=LETTER_MODES[letter], start=starts[pid(i)], **kwargs)
    return starts


@pytest.mark.parametrize("order", START_ORDERS[1:])
@pytest.mark.parametrize("mix", ["AAAAC", "AAAACC"])
def test_full_group_of_auxiliary_peers_makes_room_for_a_sender(mix, order):
    """Four auxiliary peers fill a group of target 4 that can never average; a client that asks
    to join replaces one of them instead of being told GROUP_FULL until the deadline."""
    swarm = Swarm(config(target_group_size=4, min_group_size=2, min_matchmaking_time=5.0))
    start_in_order(swarm, mix, order)
    results = swarm.run()
    groups = swarm.check_consistent()
    clients = {pid(i) for i, letter in enumerate(mix) if letter == "C"}
    assert clients <= {p for g in groups for p in g.peer_ids}  # every client averages
    assert all(CLIENT in g.modes for g in groups)
    left_out = [r for r in results.values() if isinstance(r, MatchmakingFailed)]
    assert all(r.reason == FailureReason.AUXILIARY_ONLY for r in left_out)
    assert len(left_out) == len(mix) - sum(g.size for g in groups)
    assert swarm.now <= 0.1 * len(mix) + 5.0  # nobody waits for the deadline


def test_client_joins_a_leader_that_declared_after_its_step_began():
    swarm = Swarm(config(target_group_size=2, min_matchmaking_time=5.0))
    swarm.add(pid(0), mode=CLIENT, start=0.0)
    swarm.add(pid(1), mode=NODE, start=3.0)  # expires at 8.0, after the client's first 5.0
    swarm.run()
    (group,) = swarm.check_consistent()
    assert group.leader == pid(1)
    assert swarm.results[pid(0)] == GroupAssembled(group, is_leader=False)
    assert swarm.now <= 3.0 + swarm.config.refresh_interval  # its next read, not at 5.0


def test_client_fails_fast_when_its_only_leader_cannot_be_reached():
    swarm = Swarm(config(target_group_size=2, min_matchmaking_time=5.0, request_timeout=2.0))
    swarm.add(pid(0), mode=NODE, start=0.0)
    swarm.run(until=0.0)
    swarm.freeze(pid(0))  # declared, but answers nothing
    swarm.add(pid(1), mode=CLIENT, start=0.5)
    results = swarm.run()
    assert results[pid(1)].reason == FailureReason.NO_LEADER
    assert "could not reach any of the 1 peer(s)" in results[pid(1)].detail
    assert swarm.now == 5.5  # the end of the client's first window


def test_client_fails_fast_when_no_leader_declared_in_its_first_window():
    swarm = Swarm(config(target_group_size=2, min_matchmaking_time=5.0))
    swarm.add(pid(0), mode=CLIENT, start=0.0)
    swarm.add(pid(1), mode=NODE, start=6.0, deadline=8.0)  # too late for the client
    results = swarm.run()
    assert results[pid(0)].reason == FailureReason.NO_LEADER
    assert "no peer that can lead" in results[pid(0)].detail
    assert results[pid(1)].reason == FailureReason.TOO_FEW_PEERS


@pytest.mark.parametrize("mode", [CLIENT, AUX])
def test_client_or_auxiliary_peer_among_another_schema_fails_fast_with_schema_mismatch(mode):
    swarm = Swarm(config(target_group_size=2, min_matchmaking_time=5.0))
    swarm.add(pid(0), mode=NODE, schema_hash=b"other", deadline=30.0)
    swarm.add(pid(1), mode=mode, deadline=30.0)
    swarm.run()
    assert swarm.results[pid(1)].reason == FailureReason.SCHEMA_MISMATCH
    assert [t for t, src, a in swarm.log if src == pid(1) and isinstance(a, MatchmakingFailed)] == [
        5.0
    ]


def test_auxiliary_peer_waits_its_window_for_a_client():
    swarm = Swarm(config(target_group_size=2, min_matchmaking_time=5.0))
    swarm.add(pid(0), mode=AUX, start=0.0)
    swarm.add(pid(1), mode=CLIENT, start=4.9)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert group.modes == tuple(AUX if p == pid(0) else CLIENT for p in group.peer_ids)


def test_auxiliary_peers_that_saw_a_node_do_not_fail_fast():
    swarm = Swarm(config(target_group_size=3, min_group_size=3, min_matchmaking_time=5.0))
    swarm.add(pid(0), mode=AUX, deadline=12.0)
    swarm.add(pid(1), mode=NODE, deadline=12.0)  # too few for min_group_size=3
    results = swarm.run()
    assert {r.reason for r in results.values()} == {FailureReason.TOO_FEW_PEERS}


def test_cancel_disbands_and_withdraws():
    swarm = Swarm(config(target_group_size=4))
    swarm.add(pid(0))
    swarm.add(pid(1))
    swarm.run(until=0.0)
    leader = swarm.cores[pid(0)]
    assert leader.followers == (pid(1),)
    actions = leader.cancel(1.0)
    assert actions[0] == SendToFollower(pid(1), Disbanded())
    withdraw = actions[1]
    assert isinstance(withdraw, Declare) and not withdraw.declaration.looking_for_group
    # the DHT keeps the newer record: the withdrawal outlives the declaration it replaces
    declared = leader.expiration + leader.config.declaration_linger
    assert withdraw.declaration.readable_until > declared
    assert withdraw.declaration.expiration == leader.expiration
    assert actions[2] == MatchmakingFailed(FailureReason.CANCELLED, "matchmaking was cancelled")
    assert leader.cancel(2.0) == [] and leader.tick(3.0) == []


# ---------------------------------------------------------------------------------- leader rules


def make_leader(**kwargs) -> MatchmakingCore:
    core = MatchmakingCore(config(**kwargs), pid(0), SCHEMA, deadline=30.0)
    core.start(0.0)
    return core


def request(expiration=10.0, **kwargs) -> JoinRequest:
    kwargs.setdefault("group_key", "test.0b")
    kwargs.setdefault("schema_hash", SCHEMA)
    return JoinRequest(expiration=expiration, **kwargs)


def reject_reason(actions):
    (action,) = actions
    return action.message.reason if isinstance(action.message, Rejected) else None


def test_reject_reasons():
    leader = make_leader(target_group_size=4)  # expiration 5.0
    # a joiner that ranks before us: refused, and (we ask nobody) asked to lead us instead
    refused, ask = make_leader().handle_join_request(pid(1), request(4.0), 0.1)
    assert refused.message.reason == RejectReason.BAD_EXPIRATION
    assert isinstance(ask, SendJoinRequest) and ask.leader == pid(1)
    # equal expiration: the lower peer id has priority
    assert leader.handle_join_request(pid(1), request(5.0), 0.1)[0].message == Accepted()
    assert reject_reason(leader.handle_join_request(pid(1), request(), 0.1)) == (
        RejectReason.DUPLICATE
    )
    assert reject_reason(leader.handle_join_request(pid(0), request(), 0.1)) == (
        RejectReason.DUPLICATE
    )
    bad_key = request(group_key="test.0b1")
    assert reject_reason(leader.handle_join_request(pid(2), bad_key, 0.1)) == (
        RejectReason.BAD_GROUP_KEY
    )
    bad_schema = request(schema_hash=b"x")
    assert reject_reason(leader.handle_join_request(pid(2), bad_schema, 0.1)) == (
        RejectReason.BAD_SCHEMA_HASH
    )
    assert leader.handle_join_request(pid(2), request(), 0.1)[0].message == Accepted()
    # the fourth member fills the group of 4: it assembles at once
    actions = leader.handle_join_request(pid(3), request(), 0.2)
    assert actions[0] == SendToFollower(pid(3), Accepted())
    assert isinstance(actions[-1], GroupAssembled) and leader.done
    assert reject_reason(leader.handle_join_request(pid(4), request(), 0.3)) == (
        RejectReason.NOT_LOOKING
    )
    assert leader.reject_malformed_request(pid(5))[0].message.reason == (
        RejectReason.PROTOCOL_VIOLATION
    )
    stats = leader.statistics()
    assert stats.rejections_sent[RejectReason.DUPLICATE] == 2
    assert stats.phase == Phase.ASSEMBLED


def test_group_full_and_not_declared():
    leader = make_leader(target_group_size=2, min_group_size=1)
    leader.handle_join_request(pid(1), request(mode=AUX), 0.1)
    assert leader.done  # a NODE leader and an AUX follower: a full, viable group
    client = MatchmakingCore(config(), pid(7), SCHEMA, deadline=30.0, mode=CLIENT)
    client.start(0.0)
    assert reject_reason(client.handle_join_request(pid(8), request(), 0.1)) == (
        RejectReason.NOT_DECLARED
    )
    full = make_leader(target_group_size=2, min_group_size=2, request_timeout=1.0)
    full.handle_join_request(pid(3), request(mode=AUX), 0.1)
    assert full.done
    aux_leader = MatchmakingCore(
        config(target_group_size=2), pid(0), SCHEMA, deadline=30.0, mode=AUX
    )
    aux_leader.start(0.0)
    aux_leader.handle_join_request(pid(3), request(mode=AUX), 0.1)
    assert not aux_leader.done  # two AUX peers: nobody sends, so no group
    assert reject_reason(aux_leader.handle_join_request(pid(4), request(mode=AUX), 0.1)) == (
        RejectReason.GROUP_FULL
    )
    # past its expiration (before tick ran) a leader no longer leads
    assert reject_reason(aux_leader.handle_join_request(pid(4), request(), 5.0)) == (
        RejectReason.NOT_DECLARED
    )
    # a peer with tensors replaces the (latest) AUX follower of a full group that cannot average
    actions = aux_leader.handle_join_request(pid(4), request(mode=CLIENT), 0.2)
    assert actions[:2] == [
        SendToFollower(pid(3), Disbanded()),
        SendToFollower(pid(4), Accepted()),
    ]
    assert aux_leader.done and set(aux_leader.result.group.peer_ids) == {pid(0), pid(4)}


def test_invalid_inputs_raise():
    with pytest.raises(ValueError):
        MatchmakingConfig(prefix="a.b")
    with pytest.raises(ValueError):
        MatchmakingConfig(prefix="p", target_group_size=2, min_group_size=3)
    with pytest.raises(ValueError):
        MatchmakingConfig(prefix="p", request_timeout=0)
    with pytest.raises(ValueError):
        JoinRequest("p.0b", b"", 1.0)
    with pytest.raises(ValueError):
        JoinRequest("p.0b", SCHEMA, math.inf)
    with pytest.raises(ValueError):
        JoinRequest("p.0b", SCHEMA, 1.0, bandwidth=-1.0)
    with pytest.raises(ValueError):
        JoinRequest("p.0b", SCHEMA, 1.0, part_layout=-1)
    with pytest.raises(TypeError):
        GroupMember(pid(1), part_layout=1.0)
    with pytest.raises(ValueError):
        MatchmakingGroup(b"g", "p.0b", pid(0), (GroupMember(pid(1)),))
    with pytest.raises(ValueError):
        make_group_key("p", "012")
    assert is_valid_group_key("p.0b0110") and not is_valid_group_key("p.0b2")
    core = make_leader()
    with pytest.raises(RuntimeError):
        core.start(1.0)


def test_follower_ignores_stale_and_invalid_messages():
    core = MatchmakingCore(config(first_refresh_interval=0.1), pid(5), SCHEMA, deadline=30.0)
    core.start(0.0)
    found = Declaration(pid(1), 3.0, schema_hash=SCHEMA, dht_expiration=8.0)
    actions = core.receive_declarations([found], 0.0)
    # the joiner says how long it waits (request_timeout 2.0, asked at 0.0)
    assert actions == [
        SendJoinRequest(pid(1), request(5.0, gather=b"", patience=2.0, answer_by=2.0))
    ]
    assert core.handle_leader_message(pid(2), Accepted(), 0.1) == []  # not our leader
    assert core.handle_leader_message(pid(1), Accepted(), 0.1) == []
    assert core.phase == Phase.FOLLOWING
    # a group that does not contain us: drop the leader, search again
    stranger = MatchmakingGroup(b"g", "test.0b", pid(1), (GroupMember(pid(1)),))
    actions = core.handle_leader_message(pid(1), BeginAllReduce(stranger), 0.2)
    assert core.phase == Phase.SEARCHING and not core.done
    # nobody left to ask: the key is read again at once (the first re-read was due at 0.1)
    assert actions == [FetchDeclarations("test.0b")]
    assert core.receive_declarations([], 0.2) == []  # still nobody: next read in 0.2 s
    assert core.next_deadline() == pytest.approx(0.4)
    assert core.tick(0.4) == [FetchDeclarations("test.0b")]
    core.receive_declarations([], 0.4)  # the wait doubles up to refresh_interval (1.0)
    assert core.next_deadline() == pytest.approx(0.8)
    for now in (0.8, 1.8):
        assert core.tick(now) == [FetchDeclarations("test.0b")]
        core.receive_declarations([], now)
    assert core.next_deadline() == pytest.approx(2.8)


def test_next_deadline_and_tick_are_idle_safe():
    core = make_leader()
    deadline = core.next_deadline()
    assert deadline <= 5.0
    assert core.tick(deadline - 0.5) == []  # nothing due: no actions, no state change
    assert core.phase == Phase.SEARCHING


# ---------------------------------------------------------------------------------- pure helpers


def test_group_id_and_order_are_deterministic():
    members = [GroupMember(pid(i)) for i in range(5)]
    gid = derive_group_id("p.0b1", pid(0), 5.0, [m.peer_id for m in members])
    assert gid == derive_group_id("p.0b1", pid(0), 5.0, [m.peer_id for m in members[::-1]])
    assert gid != derive_group_id("p.0b1", pid(0), 5.5, [m.peer_id for m in members])
    assert gid != derive_group_id("p.0b1", pid(0), 5.0, [m.peer_id for m in members], b"n")
    assert order_members(gid, members) == order_members(gid, members[::-1])
    orders = {tuple(m.peer_id for m in order_members(bytes([k]), members)) for k in range(20)}
    assert len(orders) > 10  # the order depends on the id, not on who joined first


def test_next_group_bits_sends_members_to_distinct_buckets():
    for size, target, bits in ((4, 4, "10"), (2, 2, "01"), (3, 4, "110"), (2, None, "1")):
        results = [next_group_bits(bits, b"gid", i, size, target) for i in range(size)]
        assert len(set(results)) == size
        assert all(len(r) == len(bits) for r in results)
    # the old last bits become the first ones
    assert next_group_bits("01", b"gid", 0, 2, 2)[0] == "1"
    assert next_group_bits("", b"gid", 0, 4, 4) == ""
    assert next_group_bits("0110", b"g", 0, 1, 1) == "0110"
    with pytest.raises(ValueError):
        next_group_bits("01", b"gid", 2, 2, 2)
    with pytest.raises(ValueError):
        next_group_bits("01", b"gid", 0, 5, 4)


# ---------------------------------------------------------------------------------- moshpit


def moshpit(num_peers: int, nbits: int, target: int, rounds: int, seed: int = 0):
    """Run ``rounds`` rounds of matchmaking + in-group averaging; return the variances."""
    rng = random.Random(seed)
    values = {pid(i): rng.gauss(0.0, 10.0) for i in range(num_peers)}
    bits = {pid(i): format(i % (1 << nbits), f"0{nbits}b") for i in range(num_peers)}
    mean = statistics.fmean(values.values())
    variances = [statistics.pvariance(values.values())]
    cfg = config(target_group_size=target, min_group_size=target)
    for r in range(rounds):
        swarm = Swarm(cfg)
        for peer in values:
            swarm.add(peer, group_bits=bits[peer], deadline=20.0, nonce=bytes([r]))
        results = swarm.run()
        assert all(isinstance(results[p], GroupAssembled) for p in values), results
        for group in swarm.check_consistent():
            assert group.size == target
            assert len({bits[p] for p in group.peer_ids}) == 1  # a group shares one key
            avg = statistics.fmean(values[p] for p in group.peer_ids)
            for index, peer in enumerate(group.peer_ids):
                values[peer] = avg
                bits[peer] = next_group_bits(bits[peer], group.group_id, index, group.size, target)
        assert statistics.fmean(values.values()) == pytest.approx(mean, abs=1e-9)
        buckets = collections.Counter(bits.values())
        assert set(buckets.values()) == {num_peers >> nbits}  # the rotation keeps buckets even
        variances.append(statistics.pvariance(values.values()))
    return variances


def test_moshpit_16_peers_2_bits_groups_of_4_average_in_2_rounds():
    variances = moshpit(16, nbits=2, target=4, rounds=3)
    assert variances[0] > 1.0
    assert variances[1] > 1e-6  # one round only averages within each bucket
    assert variances[2] == pytest.approx(0.0, abs=1e-18)


def test_moshpit_8_peers_2_bits_groups_of_2_average_in_3_rounds():
    variances = moshpit(8, nbits=2, target=2, rounds=4, seed=1)
    assert variances[0] > 1.0
    assert variances[1] < variances[0] and variances[2] < variances[1]
    assert variances[3] == pytest.approx(0.0, abs=1e-18)


# ---------------------------------------------------------------------------------- slow paths


def _slow_path_swarm(
    timeouts: dict[bytes, float] | None, expected: int | None, old: bool = False
) -> Swarm:
    """Leader pid(0), a follower on a fast path (pid(1)) and one on a slow path (pid(2): 1.5 s
    each way, as through a relay on a loaded machine; ``request_timeout`` is 2 s); ``old``:
    the joiners send no patience (older peers)."""
    swarm = Swarm(config(request_timeout=2.0, min_matchmaking_time=5.0))
    if old:
        swarm.old_joiners = {pid(1), pid(2)}
    swarm.latency[frozenset((pid(0), pid(2)))] = 1.5
    swarm.add(pid(0), expected_group_size=expected)
    swarm.add(pid(1), start=0.01, expected_group_size=expected)
    swarm.add(pid(2), start=0.01, expected_group_size=expected, request_timeouts=timeouts)
    return swarm


@pytest.mark.parametrize("expected", [3, None])
def test_a_joiner_on_a_slow_path_waits_as_long_as_the_path_needs(expected):
    """The race behind partial rounds over relays (docs/reliability.md): a joiner whose leader
    answers slower than ``request_timeout`` leaves, while the leader, which counted it, starts
    the group with it (at once when ``expected_group_size`` is reached, else at its expiration:
    the joiner asked again through the leader's other follower, and its late request is
    counted too): the group's all-reduce runs a member short. With the path's answer time
    learned (``request_timeouts``, from ``AnswerTimes``) all three average together. (Since the
    joiners send their patience, the leader no longer counts the one that gave up:
    ``test_a_leader_does_not_count_a_joiner_that_gave_up``; older joiners as before.)"""
    swarm = _slow_path_swarm(None, expected, old=True)
    results = swarm.run()
    assert isinstance(results[pid(2)], MatchmakingFailed)  # it gave up on its leader ...
    assert pid(2) in results[pid(0)].group.peer_ids  # ... which started a group with it in it
    with pytest.raises(AssertionError, match="disagrees"):
        swarm.check_consistent()

    swarm = _slow_path_swarm({pid(0): 4.0}, expected)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(0), pid(1), pid(2)}


def test_request_timeouts_also_extend_the_wait_for_the_group():
    """A follower waits for its leader's group until its expiration plus the leader's request
    timeout: a slow path's start message arrives after ``request_timeout``."""
    cfg = config(request_timeout=1.0, min_matchmaking_time=5.0, target_group_size=None)
    for timeouts, joined in ((None, False), ({pid(0): 3.0}, True)):
        swarm = Swarm(cfg)
        swarm.latency[frozenset((pid(0), pid(1)))] = 1.2  # > request_timeout past expiration
        swarm.add(pid(0), deadline=12.0)
        # pid(1) expires with the leader: the group begins at 5.0 and arrives at 6.2
        swarm.add(pid(1), deadline=12.0, request_timeouts=timeouts)
        core = swarm.cores[pid(1)]
        swarm.run()
        assert isinstance(swarm.results[pid(1)], GroupAssembled) == joined, swarm.results
        if joined:
            swarm.check_consistent()
        assert core.statistics().requests_sent >= 1


def test_request_timeouts_must_be_positive():
    for bad in (0.0, -1.0, math.nan, math.inf, "1"):
        with pytest.raises(ValueError, match="request timeout"):
            MatchmakingCore(config(), pid(0), SCHEMA, deadline=10.0, request_timeouts={pid(1): bad})


def test_a_new_scheduled_time_applies_to_the_next_declaration():
    """The shell moves ``scheduled_time`` during a round (``Matchmaking.set_scheduled_time``):
    our next declaration expires no earlier than the new time."""
    core = MatchmakingCore(
        config(min_matchmaking_time=5.0), pid(0), SCHEMA, deadline=30.0, scheduled_time=8.0
    )
    declared = [a.declaration.expiration for a in core.start(0.0) if isinstance(a, Declare)]
    assert declared == [8.0]
    core.scheduled_time = 20.0
    assert core.scheduled_time == 20.0
    renewed = [a.declaration.expiration for a in core.tick(8.0) if isinstance(a, Declare)]
    assert renewed == [20.0]
    assert core.expiration == 20.0


def _unseen_peer_swarm(expected: int | None, latency: float, read_delay: float = 0.0) -> Swarm:
    """pid(0) declares first (it should lead) but the others' DHT reads miss its declaration,
    as seen under load behind NATs; pid(0) sees them, but they expire later, so it may not
    follow them. Messages to and from pid(0) take ``latency`` each way, DHT reads
    ``read_delay``."""
    swarm = Swarm(config(request_timeout=2.0, min_matchmaking_time=5.0))
    swarm.read_delay = read_delay
    swarm.hide = {pid(1): {pid(0)}, pid(2): {pid(0)}}
    for other in (pid(1), pid(2)):
        swarm.latency[frozenset((pid(0), other))] = latency
    swarm.add(pid(0), start=0.0, expected_group_size=expected)
    swarm.add(pid(1), start=0.3, expected_group_size=expected)
    swarm.add(pid(2), start=1.0, expected_group_size=expected)
    return swarm


@pytest.mark.parametrize("latency, read_delay", [(0.0, 1.0), (0.5, 0.0), (0.5, 1.0)])
def test_a_peer_nobody_sees_joins_the_group_of_a_peer_it_saw(latency, read_delay):
    """At its expiration the unseen peer declares again, later than the peers it saw, and asks
    them at once from its last read (a new read, ``read_delay``, would come after their group
    assembled); the leader, which expects three peers, holds its group of two open once while
    its follower still waits, so the late request (``latency``) still finds it: all three in
    one group. (Before: the unseen peer was left out, as in the NAT runs.)"""
    swarm = _unseen_peer_swarm(expected=3, latency=latency, read_delay=read_delay)
    swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(0), pid(1), pid(2)}
    assert group.leader == pid(1)
    # the leader held only as long as its follower waits (pid(2) expires at 6.0)
    assert swarm.now <= 6.0 + swarm.config.request_timeout / 2 + 2 * latency + read_delay


def test_without_expected_peers_a_leader_assembles_at_its_expiration():
    """No ``expected_group_size`` (a plain averager): no hold, the group of two assembles at the
    leader's expiration, before the unseen peer's slow request arrives."""
    swarm = _unseen_peer_swarm(expected=None, latency=0.5)
    results = swarm.run()
    groups = swarm.check_consistent()
    assert {g.peer_ids for g in groups} == {results[pid(1)].group.peer_ids}
    assert set(results[pid(1)].group.peer_ids) == {pid(1), pid(2)}


def test_a_leader_holds_for_expected_peers_only_while_its_followers_wait():
    """Three peers expected, two present: the leader holds its group open past its expiration
    (5.0) until its follower's expiration plus half a ``request_timeout`` (6.0 + 1.0), then
    assembles the two; the follower, which waits until 6.0 + 2.0, gets the group."""
    swarm = Swarm(config(request_timeout=2.0, min_matchmaking_time=5.0))
    swarm.add(pid(0), expected_group_size=3)
    swarm.add(pid(1), start=1.0, expected_group_size=3)
    results = swarm.run()
    (group,) = swarm.check_consistent()
    assert set(group.peer_ids) == {pid(0), pid(1)}
    assembled = [t for t, src, a in swarm.log if isinstance(a, GroupAssembled) and src == pid(0)]
    assert assembled == [pytest.approx(7.0)]
    assert results[pid(0)].is_leader
    # the held declaration was renewed (visible to late peers) with the hold's end
    declared = [a.declaration.expiration for a in swarm.sent(Declare, pid(0))]
    assert declared == [pytest.approx(5.0), pytest.approx(7.0)]


# ---------------------------------------------------------------------------------- patience


@pytest.mark.parametrize("expected", [3, None])
def test_a_leader_does_not_count_a_joiner_that_gave_up(expected):
    """The leader's side of the slow-path race: the joiner's request says how long it waits
    (``patience``, ``answer_by``); it took 1.5 s to arrive, so an answer taking as long would
    come after the joiner's 2 s: the leader does not count it. No group lists a member whose
    own round failed (with older joiners it does: the test above)."""
    swarm = _slow_path_swarm(None, expected)
    results = swarm.run()
    groups = swarm.check_consistent()  # no member whose own round failed
    assert pid(2) not in results[pid(0)].group.peer_ids
    assert set(results[pid(0)].group.peer_ids) == {pid(0), pid(1)}
    assert swarm.cores[pid(0)].statistics().joiners_past_patience >= 1
    assert all(pid(2) not in g.peer_ids for g in groups)


def test_a_held_group_drops_a_follower_past_its_patience():
    """A leader holding for an expected peer assembles before its follower's patience runs out
    (less the time the follower's request took); a follower accepted but already past its
    patience at the assembly is not counted (it gets ``Disbanded``)."""
    leader = make_leader(target_group_size=None, request_timeout=2.0)  # expiration 5.0
    # an old joiner (no patience): counted as before
    old = request(6.0, group_key=leader.group_key)
    assert isinstance(leader.handle_join_request(pid(1), old, 1.0)[-1].message, Accepted)
    # a new joiner sent at 0.5 with 3 s of patience, arrived at 0.75 (0.25 s on the way)
    new = request(6.0, group_key=leader.group_key, patience=3.0, answer_by=3.5)
    assert isinstance(leader.handle_join_request(pid(2), new, 0.75)[-1].message, Accepted)
    assert leader.statistics().num_followers == 2
    # it waits for the group until 6.0 + 3.0; the start message may take 0.5 s: counted
    actions = leader.tick(5.0)
    assert any(isinstance(a, GroupAssembled) for a in actions)
    (assembled,) = [a for a in actions if isinstance(a, GroupAssembled)]
    assert set(assembled.group.peer_ids) == {pid(0), pid(1), pid(2)}

    held = MatchmakingCore(
        config(target_group_size=None, request_timeout=2.0),
        pid(0),
        SCHEMA,
        deadline=30.0,
        expected_group_size=3,
    )
    held.start(0.0)
    late = request(6.0, group_key=held.group_key, patience=3.0, answer_by=3.5)
    held.handle_join_request(pid(2), late, 0.75)
    # holds (3 expected) until the follower's give-up time less its path: 9.0 - 1.0 (half a
    # request_timeout is the least margin)
    held.tick(5.0)
    assert held.next_deadline() == pytest.approx(8.0)
    (assembled,) = [a for a in held.tick(8.0) if isinstance(a, GroupAssembled)]
    assert set(assembled.group.peer_ids) == {pid(0), pid(2)}


def test_a_follower_past_its_patience_is_disbanded_not_counted():
    """(The holds above end in time, so this guards the rule itself.)"""
    leader = make_leader(target_group_size=None, request_timeout=2.0)  # expiration 5.0
    # sent at 1.5 with 1 s of patience, arrived at 1.7 (0.2 s on the way): it waits for the
    # group until 6.0 + 1.0
    joiner = request(6.0, group_key=leader.group_key, patience=1.0, answer_by=2.5)
    other = request(6.0, group_key=leader.group_key, patience=3.0, answer_by=4.0)
    leader.handle_join_request(pid(1), joiner, 1.7)
    leader.handle_join_request(pid(2), other, 1.5)
    # a start message sent at 6.75 may reach pid(1) at 6.95, in time; one sent at 6.85 cannot
    assert leader._forget_followers_past_patience(6.75) == []
    actions = leader._forget_followers_past_patience(6.85)
    assert actions == [SendToFollower(pid(1), Disbanded())]
    assert leader.statistics().num_followers == 1
    assert leader.statistics().joiners_past_patience == 1


def test_a_request_arriving_too_late_for_its_answer_is_not_counted():
    leader = make_leader(target_group_size=None, request_timeout=2.0)
    # sent at 0.0 with 2 s of patience, arrived at 0.9: an answer may take 1.5 times as long
    # (the paths of a loaded machine vary) and come at 2.25 > 2.0
    late = request(6.0, group_key=leader.group_key, patience=2.0, answer_by=2.0)
    assert reject_reason(leader.handle_join_request(pid(1), late, 0.9)) == RejectReason.NOT_LOOKING
    # arrived at 0.6: the answer comes by 1.5, in time
    ok = request(6.0, group_key=leader.group_key, patience=2.0, answer_by=2.0)
    assert isinstance(leader.handle_join_request(pid(2), ok, 0.6)[-1].message, Accepted)
    stats = leader.statistics()
    assert stats.num_followers == 1 and stats.joiners_past_patience == 1


def test_patience_must_be_positive_and_come_with_answer_by():
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="patience"):
            request(patience=bad, answer_by=1.0)
    with pytest.raises(ValueError, match="together"):
        request(patience=1.0)
    with pytest.raises(ValueError, match="answer_by"):
        request(patience=1.0, answer_by=math.nan)


def test_patience_survives_the_wire_and_older_joiners_send_none():
    from swarmtrain.averaging.matchmaking import decode_join_request, encode_join_request

    request = JoinRequest("p.0b", SCHEMA, 7.0, patience=2.5, answer_by=3.5)
    wire = encode_join_request(request)
    assert decode_join_request(wire) == request
    # an older joiner's request has neither field: the leader reads None (and counts it as
    # before); one field without the other is malformed
    wire.ClearField("patience")
    with pytest.raises(ValueError, match="together"):
        decode_join_request(wire)
    wire.ClearField("answer_by")
    old = decode_join_request(wire)
    assert old.patience is None and old.answer_by is None
    leader = make_leader(target_group_size=None)
    old = dataclasses.replace(old, group_key=leader.group_key, expiration=6.0)
    assert isinstance(leader.handle_join_request(pid(1), old, 1.0)[-1].message, Accepted)
    (assembled,) = [a for a in leader.tick(5.0) if isinstance(a, GroupAssembled)]
    assert set(assembled.group.peer_ids) == {pid(0), pid(1)}


def test_a_hold_whose_tick_comes_late_keeps_the_follower_it_held_for():
    """Seen in a NAT run at load ~20: the hold ended where the follower's patience, less 1.5
    times its request's time, ran out; the tick came 70 ms late and the follower was dropped
    as past its patience (the leader assembled without it). The drop allows only the request's
    own time, so a late tick keeps it."""
    held = MatchmakingCore(
        config(target_group_size=None, request_timeout=2.0),
        pid(0),
        SCHEMA,
        deadline=30.0,
        expected_group_size=3,
    )
    held.start(0.0)  # expiration 5.0
    # sent at 0.0 with 6 s of patience, arrived at 1.4: it waits for the group until 12.0
    slow = request(6.0, group_key=held.group_key, patience=6.0, answer_by=6.0)
    held.handle_join_request(pid(1), slow, 1.4)
    held.tick(5.0)
    assert held.next_deadline() == pytest.approx(12.0 - 1.5 * 1.4)
    (assembled,) = [a for a in held.tick(9.9 + 0.3) if isinstance(a, GroupAssembled)]
    assert set(assembled.group.peer_ids) == {pid(0), pid(1)}
