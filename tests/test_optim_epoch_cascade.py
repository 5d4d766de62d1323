"""The one-epoch-behind cascade (issue 18, seen behind NATs), reproduced without sockets.

A peer misses one gradient round (its matchmaking declaration reached the others too late).
Its round goes on looking for a group after the swarm moved past that epoch; when it gives up,
it steps alone and enters the next epoch. If it gives up ``matchmaking_time`` late (the old
rule), it enters that epoch just before the others finish it: its first look sees the swarm in
the same epoch (so it is not "behind" and does not catch up), but the others' round for that
epoch assembled before its join request could arrive, so it misses that round too, and so on
for good. :func:`left_behind_grace` gives up at once when every other peer present is past the
round's epoch, so the peer enters the next epoch with the others and joins their next round.

The timeline below is a model of the real run's timings (5.5 s of compute per epoch,
``matchmaking_time`` 5 s, a join that takes 1 s over a relay); the decisions in it are the
real ones: ``EpochCore.is_behind`` (catch up?) and ``left_behind_grace`` (when to give up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from swarmtrain.optim._epoch_sync import LATE_START_GRACE, left_behind_grace
from swarmtrain.optim.epoch_core import EpochCore, EpochModes


@dataclass(frozen=True)
class Timings:
    compute: float = 5.5  # from entering an epoch until the swarm reaches its target
    matchmaking_time: float = 5.0
    allreduce: float = 0.5
    step: float = 0.1
    gossip: float = 0.2  # until a new epoch shows in the others' trackers
    join: float = 1.0  # from a joiner's first request until the leader counts it
    load_state: float = 3.0


@dataclass
class Swarm:
    """Two peers in lockstep (they always meet); ``entered[e]``: when they entered epoch e."""

    t: Timings
    entered: list[float] = field(default_factory=lambda: [0.0])

    def matchmaking_opens(self, epoch: int) -> float:  # pre-scheduled: the ETA is within M
        return self.entered[epoch] + max(0.0, self.t.compute - self.t.matchmaking_time)

    def assembles(self, epoch: int) -> float:  # the leader's expiration
        return self.matchmaking_opens(epoch) + self.t.matchmaking_time

    def enter(self, epoch: int) -> float:
        while len(self.entered) <= epoch:
            e = len(self.entered) - 1
            end = max(self.assembles(e), self.entered[e] + self.t.compute)
            self.entered.append(end + self.t.allreduce + self.t.step)
        return self.entered[epoch]

    def epoch_seen_at(self, now: float) -> int:
        epoch = 0
        while self.enter(epoch + 1) + self.t.gossip <= now:
            epoch += 1
        return epoch


def run_late_peer(epochs: int, missed: int, knows_other_epochs: bool) -> list[int]:
    """The epochs whose round the third peer was in (the full group), over ``epochs`` of the
    swarm; it misses the round of epoch ``missed`` (its declaration went unseen)."""
    t = Timings()
    swarm, core = Swarm(t), EpochCore(EpochModes(matchmaking_time=t.matchmaking_time))
    in_group: list[int] = []
    epoch, now = 0, 0.0
    while epoch < epochs:
        if core.is_behind(epoch, swarm.epoch_seen_at(now)):  # the first look at this epoch
            now += t.load_state
            enter = core.after_load(swarm.epoch_seen_at(now), swarm.epoch_seen_at(now))
            epoch = enter.epoch
            continue
        begins = max(now, swarm.matchmaking_opens(epoch))
        if epoch != missed and begins + t.join <= swarm.assembles(epoch):
            in_group.append(epoch)
            epoch, now = epoch + 1, swarm.enter(epoch + 1)
            continue
        # still looking for a group when the others leave the epoch
        others_left = swarm.enter(epoch + 1) + t.gossip
        other_epochs = [epoch + 1, epoch + 1] if knows_other_epochs else None
        begun_after_left = swarm.epoch_seen_at(begins) > epoch
        grace = left_behind_grace(t.matchmaking_time, epoch, epoch, other_epochs, begun_after_left)
        now = max(begins, others_left) + grace + t.step  # gives up, steps alone
        epoch += 1
    return in_group


def test_the_old_rule_stays_one_epoch_behind_after_one_missed_round():
    """The mechanism: with the others' epochs unknown (the rule before the fix), one missed
    round (epoch 16 of 22) costs every epoch after it."""
    in_group = run_late_peer(22, missed=16, knows_other_epochs=False)
    assert in_group == list(range(16))


def test_a_peer_that_missed_one_round_joins_the_next_one():
    in_group = run_late_peer(22, missed=16, knows_other_epochs=True)
    assert in_group == [e for e in range(22) if e != 16]


@pytest.mark.parametrize("missed", [0, 1, 5])
def test_one_missed_round_costs_one_round_wherever_it_falls(missed):
    in_group = run_late_peer(12, missed=missed, knows_other_epochs=True)
    assert in_group == [e for e in range(12) if e != missed]


def test_the_grace_is_kept_while_another_peer_may_still_be_in_the_round():
    # another late peer is still in epoch 7: the two may still meet in its round
    assert left_behind_grace(5.0, 7, 7, [8, 7], begun_after_left=False) == 5.0
    assert left_behind_grace(5.0, 7, 7, [8, 7], begun_after_left=True) == LATE_START_GRACE
    # unknown (no tracker records): the old rule
    assert left_behind_grace(5.0, 7, 7, None, begun_after_left=False) == 5.0
    assert left_behind_grace(0.1, 7, 7, None, begun_after_left=True) == 0.1
    # delayed updates: peers in epoch 8 may still run the round of 7 (left_at is 8)
    assert left_behind_grace(5.0, 7, 8, [8, 8], begun_after_left=False) == 5.0


def test_the_round_is_given_up_at_once_when_nobody_else_can_join_it():
    assert left_behind_grace(5.0, 7, 7, [8, 9], begun_after_left=False) == 0.0
    assert left_behind_grace(5.0, 7, 7, [8], begun_after_left=True) == 0.0
    assert left_behind_grace(5.0, 7, 8, [9, 9], begun_after_left=False) == 0.0
    # a peer behind (loading the state, say) will not join this round either
    assert left_behind_grace(5.0, 7, 7, [8, 4], begun_after_left=False) == 0.0
