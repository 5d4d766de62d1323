"""Matchmaking under random event orders (the in-memory swarm of
tests/test_averaging_matchmaking_core.py driven by hypothesis): peers join at random times with
random modes and windows, die, go silent or miss each other's declarations, and the clock jumps.
Whatever happens, members agree on their group, nobody is in two groups, groups stay within
[min_group_size, target_group_size] and can average, and every live peer ends with a result by
its deadline. Also: the wire decoders of matchmaking take any bytes."""

from __future__ import annotations

import math

from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_averaging_matchmaking_core import Swarm, config, pid

from swarmtrain.averaging.matchmaking import (
    decode_declaration,
    decode_join_request,
    decode_leader_message,
)
from swarmtrain.averaging.matchmaking_core import (
    GroupAssembled,
    LeaderMessage,
    MatchmakingFailed,
    _is_viable,
)
from swarmtrain.proto import matchmaking_pb2 as pb

NODE_MODES = ["node", "node", "node", "client", "aux"]


class MatchmakingSwarm(RuleBasedStateMachine):
    @initialize(
        target_size=st.sampled_from([None, 2, 3, 4]),
        min_size=st.integers(1, 3),
        request_timeout=st.sampled_from([0.5, 2.0]),
    )
    def setup(self, target_size, min_size, request_timeout):
        from swarmtrain.averaging.allreduce_core import AveragingMode

        self.modes = {
            "node": AveragingMode.NODE,
            "client": AveragingMode.CLIENT,
            "aux": AveragingMode.AUX,
        }
        if target_size is not None:
            min_size = min(min_size, target_size)
        self.swarm = Swarm(
            config(
                target_group_size=target_size,
                min_group_size=min_size,
                request_timeout=request_timeout,
            )
        )
        self.count = 0
        self.deadlines: dict[bytes, float] = {}

    @precondition(lambda self: self.count < 10)
    @rule(
        mode=st.sampled_from(NODE_MODES),
        start=st.floats(0.0, 6.0),
        window=st.floats(1.0, 6.0),
        duration=st.floats(2.0, 30.0),
        bandwidth=st.sampled_from([None, 0.0, 1.0, 1e9]),
        expected=st.sampled_from([None, 2, 3, 5]),
        patience=st.sampled_from([None, 0.1, 4.0]),
    )
    def add_peer(self, mode, start, window, duration, bandwidth, expected, patience):
        peer = pid(self.count)
        self.count += 1
        start = self.swarm.now + start
        self.deadlines[peer] = start + duration
        self.swarm.add(
            peer,
            start=start,
            config=config(
                target_group_size=self.swarm.config.target_group_size,
                min_group_size=self.swarm.config.min_group_size,
                request_timeout=self.swarm.config.request_timeout,
                min_matchmaking_time=window,
            ),
            deadline=start + duration,
            mode=self.modes[mode],
            bandwidth=bandwidth,
            gather=peer,
            # a leader holds a smaller group open once for the peers it expects
            expected_group_size=expected,
            # learned answer timeouts for the peers added before (as the shell passes them)
            request_timeouts={pid(i): patience for i in range(self.count - 1) if patience},
        )

    def started(self) -> list[bytes]:
        waiting = {peer for _, peer in self.swarm.pending_starts}
        return [p for p in sorted(self.swarm.cores) if p not in waiting]

    @precondition(lambda self: self.count)
    @rule(choice=st.integers(0, 99))
    def kill(self, choice):
        peers = self.started()
        if peers:
            self.swarm.kill(peers[choice % len(peers)])
            # a follower whose leader died may find its own expiration already passed: its
            # shell ticks at once (next_deadline() <= now), before the clock moves on
            swarm = self.swarm
            for peer in sorted(swarm.cores):
                core = swarm.cores[peer]
                if swarm.alive(peer) and not core.done and core.next_deadline() <= swarm.now:
                    swarm.dispatch(peer, core.tick(swarm.now))
                    swarm.drain()

    @precondition(lambda self: self.count)
    @rule(choice=st.integers(0, 99))
    def freeze(self, choice):
        peers = self.started()
        if peers:
            self.swarm.freeze(peers[choice % len(peers)])

    @precondition(lambda self: self.count >= 2)
    @rule(a=st.integers(0, 99), b=st.integers(0, 99))
    def hide(self, a, b):
        peers = sorted(self.swarm.cores)
        viewer, hidden = peers[a % len(peers)], peers[b % len(peers)]
        self.swarm.hide.setdefault(viewer, set()).add(hidden)

    @rule(dt=st.sampled_from([0.0, 0.3, 1.0, 2.5, 7.0]))
    def advance_clock(self, dt):
        self.swarm.run(until=self.swarm.now + dt)

    @invariant()
    def groups_are_consistent(self):
        if not hasattr(self, "swarm"):
            return
        swarm = self.swarm
        config = swarm.config
        groups = {r.group.group_id: r.group for r in swarm.results.values() if hasattr(r, "group")}
        seen: set[bytes] = set()
        for group in groups.values():
            assert config.min_group_size <= group.size <= (config.target_group_size or math.inf)
            for peer in group.peer_ids:
                assert peer not in seen, f"{peer} is in two groups"
                seen.add(peer)
                if peer in swarm.results:  # members agree on their group
                    assert getattr(swarm.results[peer], "group", None) == group
                else:  # (a silent member never heard of it)
                    assert peer in swarm.frozen
        for peer, result in swarm.results.items():
            if isinstance(result, GroupAssembled):
                group = result.group
                assert _is_viable(group.members)
                assert result.is_leader == (group.leader == peer)
                leader = group.members[group.index_of(group.leader)]
                assert leader.mode != self.modes["client"]  # clients never lead
                assert all(m.gather == m.peer_id for m in group.members)
            else:
                assert isinstance(result, MatchmakingFailed) and result.detail

    def teardown(self):
        if not hasattr(self, "swarm"):
            return
        swarm = self.swarm
        swarm.run()
        self.groups_are_consistent()
        for peer, core in swarm.cores.items():
            if swarm.alive(peer):
                assert core.done, f"{peer} never finished"
                assert peer in swarm.results
        assert swarm.now <= max(self.deadlines.values(), default=0.0) + 1e-9


TestMatchmakingSwarm = MatchmakingSwarm.TestCase


@given(st.binary(max_size=60), st.binary(max_size=8), st.floats(allow_nan=True))
def test_declarations_from_the_dht_decode_or_are_skipped(raw, peer_id, expiration):
    declaration = decode_declaration(peer_id, raw, expiration)
    if declaration is not None:
        assert declaration.peer_id == peer_id and not math.isnan(declaration.expiration)


@given(st.binary(max_size=120))
def test_join_requests_decode_or_raise_value_error(raw):
    try:
        message = pb.MatchmakingJoinRequest.FromString(raw)
    except DecodeError:
        return
    try:
        decode_join_request(message)
    except (ValueError, TypeError):
        pass


@given(st.binary(max_size=200), st.binary(min_size=1, max_size=8))
def test_leader_messages_decode_or_raise_value_error(raw, leader):
    try:
        message = pb.MatchmakingResponse.FromString(raw)
    except DecodeError:
        return
    try:
        decoded = decode_leader_message(leader, message)
    except (ValueError, TypeError):
        return
    assert isinstance(decoded, LeaderMessage.__args__)
