"""A group of AllReduceCores wired in memory, driven by hypothesis in random orders: parts and
results arrive interleaved across links (in order on each link, as on a stream), peers die,
send NaN or replay parts, claim implausible weights, and the clock jumps past deadlines. The
model plays the shell: it learns of completed parts only from ``take_completed``. Whatever
happens: a sender's part is accepted at most once, bans and failures are never undone, every
result is finite, no completed part leaves a sender without its result, every core finishes by
the deadline, and a round without faults gives everyone the exact weighted mean."""

from __future__ import annotations

import collections
import math

import torch
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from swarmtrain.averaging.allreduce_core import (
    DEFAULT_MAX_PEER_WEIGHT,
    AllReduceCore,
    AllReduceGroup,
    AveragingMode,
    Failure,
)
from swarmtrain.averaging.part_reducer import TensorPartReducer

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
SENDER_TIMEOUT, REDUCER_TIMEOUT = 5.0, 10.0
NUMELS = (7, 3)
IMPLAUSIBLE = DEFAULT_MAX_PEER_WEIGHT * 1000  # a liar's weight: honest reducers refuse it


class AllReduceSwarm(RuleBasedStateMachine):
    @initialize(
        modes=st.lists(st.sampled_from([NODE, NODE, CLIENT, AUX]), min_size=2, max_size=4),
        weights=st.lists(
            st.sampled_from([0.0, 1.0, 2.5, 7.0, IMPLAUSIBLE]), min_size=4, max_size=4
        ),
        seed=st.integers(0, 2**16),
        part_size_bytes=st.sampled_from([4, 8, 64]),
    )
    def setup(self, modes, weights, seed, part_size_bytes):
        if not any(m != CLIENT for m in modes):
            modes[0] = NODE
        if not any(m != AUX for m in modes):
            modes[-1] = NODE  # at least one sender
        fractions = [0 if m == CLIENT else 1 + i % 2 for i, m in enumerate(modes)]
        self.group = AllReduceGroup(b"group", tuple(range(len(modes))), fractions, modes)
        generator = torch.Generator().manual_seed(seed)
        self.now = 0.0
        self.weights = [0.0 if m == AUX else weights[i] for i, m in enumerate(modes)]
        self.inputs = [[torch.randn(n, generator=generator) for n in NUMELS] for _ in modes]
        self.cores = [
            AllReduceCore(
                self.group,
                i,
                [t.clone() for t in self.inputs[i]],
                weight=self.weights[i],
                part_size_bytes=part_size_bytes,
                sender_timeout=SENDER_TIMEOUT,
                reducer_timeout=REDUCER_TIMEOUT,
                now=0.0,
                max_peer_weight=max(DEFAULT_MAX_PEER_WEIGHT, self.weights[i]),
            )
            for i in range(len(modes))
        ]
        self.links: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self.dead: set[int] = set()
        self.faults = 0  # kills, poison, replays, tampering (timeouts are seen in statistics)
        self.accepted: set[tuple[int, int, int]] = set()  # (reducer, sender, part)
        self.results_sent: set[tuple[int, int, int]] = set()  # (reducer, sender, part)
        self.received: dict[tuple[int, int], dict[int, torch.Tensor]] = collections.defaultdict(
            dict
        )
        self.history: list[tuple] = []  # each core's last (bans, failures, parts reduced)
        for sender, core in enumerate(self.cores):
            if not core.is_sender:
                continue
            for reducer in core.remote_reducers():
                link = self.links[(sender, reducer)]
                link.append(("open",))
                for k in range(core.num_parts_for(reducer)):
                    link.append(("part", k, core.container.input_part(reducer, k).clone()))
        self.history = [self.snapshot(core) for core in self.cores]

    @staticmethod
    def snapshot(core: AllReduceCore):
        stats = core.statistics()
        return set(stats.banned_senders), set(stats.failed_reducers), stats.parts_reduced

    # ------------------------------------------------------------------ delivery

    def pending(self) -> list[tuple[int, int]]:
        return sorted(link for link, queue in self.links.items() if queue)

    @precondition(lambda self: self.pending())
    @rule(choice=st.integers(0, 1000))
    def deliver(self, choice):
        src, dst = link = self.pending()[choice % len(self.pending())]
        message = self.links[link].popleft()
        if src in self.dead or dst in self.dead:
            return
        if message[0] == "open":
            self.cores[dst].open_sender(src, self.group.group_id, self.weights[src], self.now)
            self.announce(dst)
        elif message[0] == "part":
            self.receive_part(dst, src, message[1], message[2])
        else:  # a result
            _, k, delta = message
            self.cores[dst].receive_delta(src, k, delta, unchanged=delta is None, now=self.now)

    def receive_part(self, reducer: int, sender: int, k: int, tensor: torch.Tensor) -> None:
        core = self.cores[reducer]
        outcome = core.receive_part(sender, k, tensor, self.now)
        if outcome.reject is None:
            assert (reducer, sender, k) not in self.accepted, "a part was accepted twice"
            self.accepted.add((reducer, sender, k))
            self.received[(reducer, sender)][k] = tensor
        self.announce(reducer)

    def announce(self, reducer: int) -> None:
        """What the shell does after every call into a core: the parts it completed get their
        results out (``take_completed``, whichever call completed them)."""
        for done in self.cores[reducer].take_completed():
            self.send_results(reducer, done)

    def send_results(self, reducer: int, k: int) -> None:
        """Part ``k`` of ``reducer``'s slice is complete: its result to every sender that sent
        it (the shell does this for each sender's stream)."""
        core = self.cores[reducer]
        for (r, sender), parts in self.received.items():
            if r != reducer or k not in parts or core.sender_banned(sender):
                continue
            delta = core.delta_for(sender, k, parts[k])
            self.links[(reducer, sender)].append(("result", k, delta))
            self.results_sent.add((reducer, sender, k))
            core.result_sent(sender, k, self.now)

    # ------------------------------------------------------------------ faults

    @rule(peer=st.integers(0, 3))
    def kill(self, peer):
        peer %= len(self.cores)
        if peer not in self.dead:
            self.dead.add(peer)
            self.faults += 1

    @rule(peer=st.integers(0, 3), reducer=st.integers(0, 3))
    def poison_next_part(self, peer, reducer):
        link = self.links.get((peer % len(self.cores), reducer % len(self.cores)))
        for index, message in enumerate(link or ()):
            if message[0] == "part":
                link[index] = ("part", message[1], torch.full_like(message[2], math.nan))
                self.faults += 1
                return

    @precondition(lambda self: self.accepted)
    @rule(choice=st.integers(0, 1000))
    def replay_a_part(self, choice):
        reducer, sender, k = sorted(self.accepted)[choice % len(self.accepted)]
        if reducer in self.dead:
            return
        self.faults += 1
        outcome = self.cores[reducer].receive_part(
            sender, k, self.received[(reducer, sender)][k], self.now
        )
        assert outcome.reject is not None, "a replayed part was accepted"
        self.announce(reducer)

    @rule(peer=st.integers(0, 3), sender=st.integers(0, 3))
    def tamper_next_result(self, peer, sender):
        link = self.links.get((peer % len(self.cores), sender % len(self.cores)))
        for index, message in enumerate(link or ()):
            if message[0] == "result" and message[2] is not None:
                link[index] = ("result", message[1], message[2] * math.inf)
                self.faults += 1
                return

    @rule(dt=st.sampled_from([0.1, 1.0, 4.0, 6.0, 11.0]))
    def advance_clock(self, dt):
        self.now += dt
        self.enforce_deadlines()

    def enforce_deadlines(self) -> None:
        """What the shell does when timers fire."""
        for index, core in enumerate(self.cores):
            if index in self.dead:
                continue
            core.ban_missing_senders(self.now)
            for sender in self.group.sender_indices:
                if sender != index and self.now >= core.sender_deadline(sender):
                    core.ban_sender(sender, Failure.TIMEOUT)
            self.announce(index)
            for reducer in core.remote_reducers():
                if self.now >= core.reducer_deadline(reducer):
                    core.fail_reducer(reducer, Failure.TIMEOUT)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def nothing_is_undone_and_results_are_finite(self):
        for index, core in enumerate(self.cores):
            bans, failures, reduced = self.snapshot(core)
            old_bans, old_failures, old_reduced = self.history[index]
            assert old_bans <= bans and old_failures <= failures and old_reduced <= reduced
            self.history[index] = (bans, failures, reduced)
            for k in range(core.num_local_parts):
                if core.is_part_ready(k):
                    result = core.reducer.result(k)
                    assert result is None or bool(torch.isfinite(result).all())
            stats = core.statistics()
            assert stats.parts_received <= stats.parts_expected
            assert stats.parts_reduced <= stats.parts_to_reduce

    def teardown(self):
        if not hasattr(self, "cores"):
            return
        # deliver what is left, then let every deadline pass
        while self.pending():
            self.deliver(0)
        self.check_no_result_owed()
        self.now += REDUCER_TIMEOUT + 1
        self.enforce_deadlines()
        while self.pending():
            self.deliver(0)
        faulty = self.faults > 0
        for index, core in enumerate(self.cores):
            if index in self.dead:
                continue
            stats = core.statistics()
            faulty = faulty or bool(stats.banned_senders or stats.failed_reducers)
            core.expire(self.now)
            assert core.finished
            deltas = core.deltas()
            if deltas is not None:
                assert all(bool(torch.isfinite(d).all()) for d in deltas)
        event("faults" if faulty else "no faults: exact mean checked")
        if not faulty:
            self.check_exact_mean()

    def check_no_result_owed(self) -> None:
        """With every message delivered, each complete part's result went to every sender
        that gave it (the shell heard of every completion)."""
        for (reducer, sender), parts in self.received.items():
            core = self.cores[reducer]
            if reducer in self.dead or core.sender_banned(sender):
                continue
            for k in parts:
                if core.is_part_ready(k):
                    assert (reducer, sender, k) in self.results_sent, (
                        f"part {k} of reducer {reducer} completed, but sender {sender} never "
                        "got its result"
                    )

    def check_exact_mean(self) -> None:
        senders = self.group.sender_indices
        total = sum(self.weights[i] for i in senders)
        for index, core in enumerate(self.cores):
            deltas = core.deltas()
            if deltas is None:
                continue
            for t, (local, delta) in enumerate(zip(self.inputs[index], deltas, strict=True)):
                if total == 0:  # nobody had weight: everyone keeps its own values
                    assert torch.equal(delta, torch.zeros_like(delta))
                    continue
                mean = sum(self.weights[i] * self.inputs[i][t].double() for i in senders) / total
                assert torch.allclose((local + delta).double(), mean, atol=1e-5, rtol=1e-5)


TestAllReduceSwarm = AllReduceSwarm.TestCase


@given(
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.booleans()), max_size=30),
    st.sampled_from(["mean", "centered_clip"]),
    st.integers(0, 2**16),
)
def test_part_reducer_under_random_orders(weights, events, aggregation, seed):
    """Senders contribute parts (or get banned) in any order: each part is taken once per
    sender, completes when every unbanned sender gave it, and is the weighted mean (or a finite
    CenteredClip inside the contributions' range) of what was given."""
    generator = torch.Generator().manual_seed(seed)
    numels = (4, 1, 3)
    reducer = TensorPartReducer(numels, [torch.float32] * 3, len(weights), aggregation=aggregation)
    data = [[torch.randn(n, generator=generator) for n in numels] for _ in weights]
    given_parts: dict[int, set[int]] = collections.defaultdict(set)
    completed: set[int] = set()
    for sender, part, ban in [*events, *((s, p, False) for s in range(5) for p in range(3))]:
        sender %= len(weights)
        if ban:
            done = reducer.ban(sender)
        elif reducer.is_banned(sender) or sender in given_parts[part] or part in completed:
            try:
                reducer.accumulate(sender, part, data[sender][part], weights[sender])
            except ValueError:
                continue
            raise AssertionError("a repeated, late or banned contribution was taken")
        else:
            done = reducer.accumulate(sender, part, data[sender][part], weights[sender])
            given_parts[part].add(sender)
        assert not completed & set(done)
        completed |= set(done)
        for k in done:
            contributors = sorted(given_parts[k])
            total = sum(weights[s] for s in contributors)
            result = reducer.result(k)
            if total == 0:
                assert result is None
                continue
            stacked = torch.stack([data[s][k] for s in contributors]).double()
            if aggregation == "mean":
                mean = sum(weights[s] * data[s][k].double() for s in contributors) / total
                assert torch.allclose(result.double(), mean, atol=1e-5)
            else:
                assert bool(torch.isfinite(result).all())
                low, high = stacked.min(dim=0).values, stacked.max(dim=0).values
                assert bool(((result >= low - 1e-4) & (result <= high + 1e-4)).all())
    assert reducer.finished and completed == {0, 1, 2}
