"""EpochCore: the Optimizer's epoch decisions, every mode and event order, without a network.

The last tests drive whole swarms of cores in memory (ProgressCore for the tracker, a FIFO
gossip queue, gradient rounds that finish when every peer joined, a clock that jumps to the
next event): the epoch-end logic the real-swarm tests used to bound loosely, checked here
deterministically.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random

import pytest

from swarmtrain.optim.epoch_core import (
    AccumulateBatch,
    AuxiliaryCatchUp,
    BatchCheck,
    EnterEpoch,
    EpochCore,
    EpochModes,
    FinishEpoch,
    RoundWait,
    SkipBatch,
    SwarmView,
)
from swarmtrain.optim.progress_core import ProgressCore
from swarmtrain.optim.progress_types import ProgressConfig

TARGET = 96
INF = math.inf

# Optimizer's resolved modes (resolve_modes' defaults filled in)
MODES = {
    "plain": EpochModes(offload_optimizer=False, delay_state_averaging=False),
    "offload": EpochModes(offload_optimizer=True),
    "delay_step": EpochModes(offload_optimizer=True, delay_optimizer_step=True),
    "delay_grads": EpochModes(
        offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True
    ),
    "delay_grads_reuse": EpochModes(
        offload_optimizer=True,
        delay_optimizer_step=True,
        delay_grad_averaging=True,
        reuse_grad_buffers=True,
    ),
    "local": EpochModes(use_local_updates=True),
    "local_delay_step": EpochModes(
        use_local_updates=True, offload_optimizer=True, delay_optimizer_step=True
    ),
    "auxiliary": EpochModes(auxiliary=True, offload_optimizer=True),
    "client": EpochModes(client_mode=True, offload_optimizer=True),
}


def swarm(epoch: int = 0, peers: int = 2, samples: int = 0, eta: float = INF) -> SwarmView:
    return SwarmView(epoch, peers, samples, TARGET, eta)


def end_epoch(
    core: EpochCore,
    local_epoch: int = 0,
    view: SwarmView | None = None,
    *,
    averaged: bool | None = True,
    state_round_running: bool = False,
    has_scaler: bool = False,
):
    """One epoch end: (the round plan, the decision after the round)."""
    view = swarm(local_epoch) if view is None else view
    plan = core.begin_epoch_end(local_epoch, view, has_scaler)
    if not plan.begin_round:
        averaged = None
    elif plan.wait is RoundWait.IN_WORKER:
        averaged = None  # the worker waits for it
    return plan, core.on_round_result(averaged, state_round_running)


# ------------------------------------------------------------------ the table of modes

#: mode -> (round wait, wait for the last gradients, optimizer step, step here on the
#: averager's buffers, delayed step, weight, serve state)
EXPECTED = {
    "plain": (RoundWait.HERE, False, True, True, False, None, True),
    "offload": (RoundWait.HERE, False, True, False, False, None, True),
    "delay_step": (RoundWait.HERE_CONSUME_IN_WORKER, True, True, False, True, None, True),
    "delay_grads": (RoundWait.IN_WORKER, True, True, False, True, None, True),
    "delay_grads_reuse": (RoundWait.IN_WORKER, True, True, False, True, None, True),
    "local": (RoundWait.NONE, False, False, False, False, None, True),
    "local_delay_step": (RoundWait.NONE, False, False, False, False, None, True),
    "auxiliary": (RoundWait.HERE, False, True, False, False, 0.0, True),
    "client": (RoundWait.HERE, False, True, False, False, None, False),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_ends_an_epoch_as_its_table_row_says(mode):
    wait, consumed, step, step_now, delayed, weight, serve = EXPECTED[mode]
    core = EpochCore(MODES[mode])
    plan, decision = end_epoch(core, 3, swarm(3, peers=1 if mode == "auxiliary" else 2))
    assert plan.wait is wait and plan.begin_round == (wait is not RoundWait.NONE)
    assert plan.wait_gradients_consumed == consumed
    assert plan.weight == weight and plan.epoch == 3 and plan.others_seen
    assert plan.num_peers_present == 2
    assert not plan.tag_along and not plan.unscale_before_round
    assert isinstance(decision, FinishEpoch)
    assert decision.next_epoch == 4 and decision.average_state
    assert decision.optimizer_step == step
    assert decision.step_with_averaged_now == step_now
    assert decision.increment_in_state_step == (not step_now)
    assert decision.delay_optimizer_step == delayed
    assert decision.delay_state_averaging == MODES[mode].delay_state_averaging
    assert decision.state_round_weight == (0.0 if mode == "auxiliary" else None)
    advanced = core.on_epoch_finished(4, {"a": 4, "b": 4}.values())
    assert advanced.epoch == 4 and advanced.adopted_from is None
    assert advanced.serve_state == serve
    stats = core.statistics()
    assert stats.epochs_ended == stats.state_rounds == 1


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_takes_a_finite_batch(mode):
    modes = MODES[mode]
    core = EpochCore(modes)
    check = core.batch_check(has_scaler=False)
    assert check is BatchCheck.CHECK_FINITE
    assert core.on_batch(check, True) == AccumulateBatch(
        local_step=modes.use_local_updates, delay_optimizer_step=modes.delay_optimizer_step
    )
    assert core.statistics().batches_accumulated == 1


def test_modes_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="average_state_every"):
        EpochModes(average_state_every=0)
    with pytest.raises(ValueError, match="matchmaking_time"):
        EpochModes(matchmaking_time=0)
    with pytest.raises(ValueError, match="auxiliary"):
        EpochModes(auxiliary=True, offload_optimizer=True, delay_optimizer_step=True)
    with pytest.raises(ValueError, match="delay_optimizer_step"):
        EpochModes(delay_grad_averaging=True)
    with pytest.raises(ValueError, match="offload_optimizer"):
        EpochModes(delay_optimizer_step=True)
    with pytest.raises(RuntimeError, match="begin_epoch_end"):
        EpochCore(EpochModes()).on_round_result(True, False)


# ------------------------------------------------------------------ a step, on a jumping clock


def test_the_round_is_scheduled_within_matchmaking_time_of_the_eta():
    core = EpochCore(EpochModes(matchmaking_time=2.0))
    now = 1000.0
    plan = core.on_progress(0, swarm(0, samples=10, eta=now + 30), now)
    assert not plan.schedule_round and not plan.end_epoch and plan.seconds_left == 30
    now += 28.5  # the clock jumps: 1.5 s left
    plan = core.on_progress(0, swarm(0, samples=80, eta=1030.0), now)
    assert plan.schedule_round and not plan.end_epoch and plan.seconds_left == 1.5
    now += 1.5  # the ETA passed, the target was not reached: the epoch ends anyway
    assert core.on_progress(0, swarm(0, samples=90, eta=1030.0), now).end_epoch
    # the target reached before the ETA, or the swarm ahead: the epoch ends too
    assert core.on_progress(0, swarm(0, samples=TARGET, eta=now + 9), now).end_epoch
    assert core.on_progress(0, swarm(1, eta=now + 9), now).end_epoch
    assert not core.on_progress(1, swarm(1, samples=95, eta=now + 9), now).end_epoch


def test_an_unknown_eta_schedules_nothing_and_ends_only_at_the_target():
    core = EpochCore(EpochModes())
    plan = core.on_progress(0, swarm(0, samples=50), 1e9)
    assert not plan.schedule_round and not plan.end_epoch
    assert core.on_progress(0, swarm(0, samples=TARGET), 1e9).end_epoch


def test_alone_or_with_local_updates_nothing_is_scheduled():
    now = 50.0
    lone = EpochCore(EpochModes()).on_progress(0, swarm(0, peers=1, eta=now), now)
    assert not lone.schedule_round and not lone.others_seen and lone.end_epoch
    local = EpochCore(MODES["local"]).on_progress(0, swarm(0, eta=now), now)
    assert not local.schedule_round and local.end_epoch


def test_a_lone_peer_at_the_target_waits_for_its_confirming_fetch():
    core = EpochCore(EpochModes())
    confirming = SwarmView(0, 1, TARGET, TARGET, 0.0, confirming_alone=True)
    assert not core.on_progress(0, confirming, 1.0).end_epoch
    assert core.on_progress(0, SwarmView(0, 1, TARGET, TARGET, 0.0), 1.0).end_epoch


def test_an_auxiliary_peer_counts_itself_and_leaves_a_finished_round_alone():
    core = EpochCore(MODES["auxiliary"])
    now = 10.0
    plan = core.on_progress(2, swarm(2, peers=1, eta=now + 1), now)
    assert plan.others_seen and plan.num_peers_present == 2 and plan.schedule_round
    assert not core.on_progress(2, swarm(2, peers=0, eta=now + 1), now).others_seen
    late = core.on_progress(2, swarm(3, peers=2, eta=now + 1), now)  # the swarm left epoch 2
    assert not late.schedule_round and late.end_epoch


# ------------------------------------------------------------------ behind the swarm


def test_behind_by_one_is_the_normal_race_unless_the_epoch_was_entered_late():
    core = EpochCore(MODES["offload"])
    assert not core.is_behind(3, 3)
    assert not core.is_behind(3, 4)  # the swarm reached the target: end 3 with its round
    _, decision = end_epoch(core, 3, swarm(4, peers=3), averaged=False)  # the round failed
    assert isinstance(decision, FinishEpoch) and decision.optimizer_step  # local gradients
    assert core.is_behind(4, 5)  # entered 4 after the swarm left it
    assert core.after_failed_catch_up(4, 5, no_donor=False, now=0.0) == EnterEpoch(
        5, own_state=True
    )
    assert not core.is_behind(5, 5) and not core.is_behind(5, 6)


@pytest.mark.parametrize("behind", [2, 3, 7])
def test_behind_by_several_epochs_loads_the_state(behind):
    core = EpochCore(MODES["offload"])
    assert not core.is_behind(5, 5)
    assert core.is_behind(5, 5 + behind)
    # a donor one epoch behind the swarm was about to move on: take the swarm's epoch
    assert core.after_load(4 + behind, 5 + behind) == EnterEpoch(5 + behind, own_state=False)
    assert core.after_load(5 + behind, 5 + behind).epoch == 5 + behind
    assert core.after_load(5, 5 + behind).epoch == 5  # an old donor: still behind next step
    # no donor could serve: wait for one (the swarm is far ahead) unless nobody shares a state
    assert core.after_failed_catch_up(5, 5 + behind, no_donor=False, now=0.0) is None
    assert core.after_failed_catch_up(5, 5 + behind, no_donor=True, now=0.0).epoch == 5 + behind
    assert core.after_failed_catch_up(5, 5, no_donor=True, now=0.0) is None
    stats = core.statistics()
    assert (stats.epochs_entered, stats.epochs_entered_without_state) == (4, 1)


def test_an_auxiliary_peer_catches_up_only_when_two_epochs_behind():
    core = EpochCore(MODES["auxiliary"])
    assert not core.is_behind(0, 1)  # a newcomer one behind: it catches up by itself
    assert core.is_behind(0, 2)
    assert (
        core.after_failed_catch_up(0, 1, no_donor=True, now=0.0) is None
    )  # it never takes an epoch


def _catch_up_attempts(core: EpochCore, swarm_epoch: int, seconds: float, no_donor: bool):
    """A peer at epoch 0 steps every 25 ms; every catch-up fails: the times it tries."""
    attempts, now = [], 0.0
    while now < seconds:
        if core.is_behind(0, swarm_epoch) and core.catch_up_due(now):
            attempts.append(now)  # (it warns "behind the swarm" and tries to load)
            assert core.after_failed_catch_up(0, swarm_epoch, no_donor, now=now) is None
        now = round(now + 0.025, 3)
    return attempts


@pytest.mark.parametrize("mode", ["offload", "auxiliary"])
def test_a_peer_whose_catch_ups_fail_backs_off_instead_of_retrying_every_step(mode):
    core = EpochCore(MODES[mode])
    # every donor fails (or, auxiliary, there is none): 2000 steps in 50 s, 6 tries (not 2000)
    attempts = _catch_up_attempts(core, 3, 50.0, no_donor=mode == "auxiliary")
    assert attempts == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0]
    stats = core.statistics()
    assert stats.catch_ups_failed == 6 and stats.catch_ups_backed_off == 2000 - 6
    assert core.retry_in == 32.0
    # the waits stop doubling at CATCH_UP_MAX_DELAY (60 s)
    assert _catch_up_attempts(core, 3, 300.0, no_donor=False)[:3] == [63.0, 123.0, 183.0]


def test_a_load_or_an_epoch_end_ends_the_back_off():
    core = EpochCore(MODES["offload"])
    assert core.is_behind(0, 3) and core.catch_up_due(0.0)
    assert core.after_failed_catch_up(0, 3, no_donor=False, now=0.0) is None
    assert not core.catch_up_due(0.5)
    core.after_load(3, 3)  # a later attempt loaded the state: the next one (if any) at once
    assert core.catch_up_due(0.5)
    assert core.after_failed_catch_up(3, 6, no_donor=False, now=1.0) is None
    assert not core.catch_up_due(1.5)
    core.on_epoch_finished(3, [6])  # it got there another way (a state round's epoch)
    assert core.catch_up_due(1.5)


def test_an_auxiliary_peer_whose_catch_up_fails_stays_in_its_epoch_while_donors_exist():
    core = EpochCore(MODES["auxiliary"])
    # a donor exists but its state could not be loaded: stay, try again after the back-off
    assert core.after_failed_auxiliary_catch_up(4, no_donor=False, now=10.0) is None
    assert core.retry_in == 1.0 and not core.catch_up_due(10.5) and core.catch_up_due(11.0)
    assert core.after_failed_auxiliary_catch_up(4, no_donor=False, now=11.0) is None
    assert core.retry_in == 2.0
    # nobody can serve a state: move on with its own
    assert core.after_failed_auxiliary_catch_up(4, no_donor=True, now=12.0) == EnterEpoch(
        5, own_state=True
    )
    assert core.catch_up_due(12.0)
    stats = core.statistics()
    assert (stats.catch_ups_failed, stats.epochs_entered_without_state) == (2, 1)
    # once the swarm left its epoch, only a state after that epoch's step will do
    assert core.auxiliary_catch_up_epoch(4, 5) == 5
    assert core.auxiliary_catch_up_epoch(4, 4) == 4


def test_a_state_group_in_a_later_epoch_takes_us_there():
    core = EpochCore(MODES["plain"])
    advanced = core.on_epoch_finished(4, [4, 6, True])  # bools are not epochs
    assert (advanced.epoch, advanced.adopted_from) == (6, 4)
    assert core.on_epoch_finished(7, [5, 7]).adopted_from is None
    assert core.on_epoch_finished(8, None).epoch == 8
    assert core.statistics().epochs_adopted == 1


# ------------------------------------------------------------------ failed and skipped rounds


@pytest.mark.parametrize("mode", ["plain", "offload", "delay_step", "client"])
def test_a_failed_gradient_round_steps_on_the_local_gradients(mode):
    core = EpochCore(MODES[mode])
    _, decision = end_epoch(core, 0, averaged=False)
    assert isinstance(decision, FinishEpoch) and decision.optimizer_step
    assert decision.average_state  # the state round can still pull this peer in


def test_an_auxiliary_peer_whose_round_failed_catches_up():
    core = EpochCore(MODES["auxiliary"])
    _, decision = end_epoch(core, 0, swarm(0, peers=2), averaged=False)
    assert decision == AuxiliaryCatchUp(load_state=True)
    _, decision = end_epoch(core, 0, swarm(0, peers=0), averaged=False)  # alone: move on
    assert decision == AuxiliaryCatchUp(load_state=False)
    # a group in another epoch did not bring this epoch's gradients
    assert not core.round_averaged(3, [3, 4])
    assert core.round_averaged(3, [3, 3]) and not core.round_averaged(3, None)
    assert EpochCore(MODES["offload"]).round_averaged(3, [3, 4])
    assert core.statistics().auxiliary_catch_ups == 2


def test_an_auxiliary_peer_the_swarm_left_tags_along_then_catches_up():
    core = EpochCore(MODES["auxiliary"])
    plan, decision = end_epoch(core, 2, swarm(3, peers=2))
    assert plan.tag_along and not plan.begin_round and plan.wait is RoundWait.NONE
    assert decision == AuxiliaryCatchUp(load_state=True)
    assert core.statistics().rounds_tagged_along == 1


def test_a_delayed_state_round_still_running_skips_this_epochs_round():
    core = EpochCore(MODES["delay_step"])
    plan, decision = end_epoch(core, 0, state_round_running=True)
    assert plan.wait_gradients_consumed  # the last round's gradients go first
    assert decision.state_round_skipped and not decision.average_state
    assert decision.optimizer_step and decision.delay_optimizer_step  # training goes on
    _, decision = end_epoch(core, 1)  # it finished: the next epoch averages
    assert decision.average_state and not decision.state_round_skipped
    # synchronous state rounds never overlap: nothing to skip
    _, decision = end_epoch(EpochCore(MODES["plain"]), 0, state_round_running=True)
    assert decision.average_state
    stats = core.statistics()
    assert (stats.state_rounds, stats.state_rounds_skipped) == (1, 1)


def test_the_state_is_averaged_every_k_epochs_when_others_are_seen():
    core = EpochCore(dataclasses.replace(MODES["offload"], average_state_every=3))
    averaged = [end_epoch(core, e)[1].average_state for e in range(7)]
    assert averaged == [False, False, True, False, False, True, False]


def test_the_last_peer_leaving_makes_this_one_step_alone():
    core = EpochCore(MODES["delay_step"])
    now = 100.0
    assert core.on_progress(5, swarm(5, peers=2, eta=now + 1), now).schedule_round
    plan = core.on_progress(5, swarm(5, peers=1, eta=now + 1), now + 0.5)  # it said goodbye
    assert not plan.schedule_round and not plan.others_seen
    round_plan, decision = end_epoch(core, 5, swarm(5, peers=1), averaged=False)
    assert not round_plan.others_seen  # the round loads the local mean gradient
    assert decision.optimizer_step and not decision.average_state


# ------------------------------------------------------------------ non-finite gradients


def test_a_grad_scaler_unscales_each_batch_and_its_skips_are_counted():
    core = EpochCore(MODES["offload"])
    check = core.batch_check(has_scaler=True)
    assert check is BatchCheck.UNSCALE
    assert core.on_batch(check, False) == SkipBatch(False, False, warn=False)
    assert isinstance(core.on_batch(check, True), AccumulateBatch)
    plan, _ = end_epoch(core, 0, has_scaler=True)
    assert not plan.unscale_before_round
    stats = core.statistics()
    assert (stats.batches_skipped, stats.batches_accumulated) == (1, 1)


def test_a_grad_scaler_with_reused_buffers_unscales_before_the_round():
    core = EpochCore(MODES["delay_grads_reuse"])
    check = core.batch_check(has_scaler=True)
    assert check is BatchCheck.NONE
    assert isinstance(core.on_batch(check, True), AccumulateBatch)
    plan, decision = end_epoch(core, 0, has_scaler=True)
    assert plan.unscale_before_round and decision.optimizer_step  # weight 0 if non-finite
    assert not end_epoch(core, 1, has_scaler=False)[0].unscale_before_round


@pytest.mark.parametrize(
    ("mode", "reset", "clear"),
    [
        ("offload", False, False),  # the accumulators never saw the batch
        ("delay_grads_reuse", True, False),  # .grad held the epoch's sum: start over
        ("local", False, True),  # .grad would reach the local optimizer step
    ],
)
def test_a_non_finite_batch_without_a_scaler_is_dropped_with_a_warning(mode, reset, clear):
    core = EpochCore(MODES[mode])
    decision = core.on_batch(core.batch_check(has_scaler=False), False)
    assert decision == SkipBatch(reset_accumulators=reset, clear_grads=clear, warn=True)
    assert core.statistics().batches_skipped == 1


# ------------------------------------------------------------------ one peer, many epochs


def test_one_peer_through_a_round_a_failure_a_skip_and_a_catch_up():
    """A scripted life: every decision in order, on a clock that jumps."""
    core = EpochCore(MODES["delay_step"])
    log = []
    now, epoch = 0.0, 0
    for step, (swarm_epoch, samples, eta, finite) in enumerate(
        [
            (0, 40, 10.0, True),
            (0, 90, 1.5, True),  # within matchmaking_time: schedule
            (0, 100, 1.0, True),  # target: end epoch 0 (averaged)
            (1, 20, 30.0, False),  # a NaN batch
            (1, 100, 0.0, True),  # end epoch 1: the round fails, state round still running
            (3, 0, 30.0, True),  # the swarm is two epochs ahead
        ]
    ):
        now += 1.0 + step
        if core.is_behind(epoch, swarm_epoch):
            log.append(("catch_up", epoch, swarm_epoch))
            epoch = core.after_load(swarm_epoch - 1, swarm_epoch).epoch
            continue
        batch = core.on_batch(BatchCheck.CHECK_FINITE, finite)
        if isinstance(batch, SkipBatch):
            log.append(("skip", epoch))
            continue
        plan = core.on_progress(epoch, swarm(swarm_epoch, 2, samples, now + eta), now)
        if plan.schedule_round:
            log.append(("schedule", epoch))
        if plan.end_epoch:
            failed = epoch == 1
            _, done = end_epoch(
                core, epoch, swarm(swarm_epoch), averaged=not failed, state_round_running=failed
            )
            epoch = core.on_epoch_finished(done.next_epoch).epoch
            log.append(("end", done.next_epoch, done.average_state))
    assert log == [
        ("schedule", 0),
        ("schedule", 0),
        ("end", 1, True),
        ("skip", 1),
        ("schedule", 1),
        ("end", 2, False),
        ("catch_up", 2, 3),
    ]
    assert epoch == 3


# ------------------------------------------------------------------ whole swarms in memory


@dataclasses.dataclass
class SimPeer:
    key: bytes
    step_time: float
    progress: ProgressCore
    core: EpochCore
    epoch: int = 0
    samples: int = 0
    in_round: bool = False
    contributed: dict[int, int] = dataclasses.field(default_factory=dict)


class SwarmSim:
    """Peers that step at their own speeds, report to their ProgressCore, gossip their records
    (delivered ``gossip_delay`` later), and end epochs when their EpochCore says so. The
    gradient round of epoch ``e`` finishes ``round_time`` after the last peer joined it (plus
    a seeded jitter per peer); the first round is slower (dials, first matchmaking)."""

    BATCH = 4

    def __init__(
        self,
        step_times: list[float],
        *,
        seed: int = 0,
        round_time: float = 0.3,
        first_round_time: float = 2.0,
        gossip_delay: float = 0.02,
        jitter: float = 0.2,
    ):
        self.now = 1000.0
        self.rng = random.Random(seed)
        self.round_time, self.first_round_time = round_time, first_round_time
        self.gossip_delay, self.jitter = gossip_delay, jitter
        config = ProgressConfig(TARGET, gossip_period=0.1, min_refresh_period=0.2)
        self.peers = [
            SimPeer(
                key=f"peer-{i}".encode(),
                step_time=step_time,
                progress=ProgressCore(
                    config,
                    peer_id=f"peer-{i}".encode(),
                    client_mode=False,
                    now=self.now,
                ),
                core=EpochCore(MODES["offload"]),
            )
            for i, step_time in enumerate(step_times)
        ]
        self.joined: dict[int, set[bytes]] = {}
        self._events: list = []
        self._seq = itertools.count()
        for peer in self.peers:
            self._at(self.now + peer.step_time * self.rng.random(), "step", peer)

    def _at(self, when: float, kind: str, *payload) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload))

    def _publish(self, peer: SimPeer, record) -> None:
        for other in self.peers:
            if other is not peer:
                self._at(self.now + self.gossip_delay, "gossip", other, peer.key, record)

    def run(self, epochs: int) -> None:
        while min(p.epoch for p in self.peers) < epochs:
            self.now, _, kind, payload = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(*payload)

    def _on_gossip(self, peer: SimPeer, key: bytes, record) -> None:
        peer.progress.on_gossip(key, record, self.now + 60.0, self.now)

    def _on_step(self, peer: SimPeer) -> None:
        core, progress = peer.core, peer.progress
        assert not core.is_behind(peer.epoch, progress.global_progress.epoch)
        assert isinstance(core.on_batch(BatchCheck.CHECK_FINITE, True), AccumulateBatch)
        peer.samples += self.BATCH
        self._publish(peer, progress.report_local_progress(peer.epoch, peer.samples, self.now))
        plan = core.on_progress(peer.epoch, progress.global_progress, self.now)
        if not plan.end_epoch:
            self._at(self.now + peer.step_time, "step", peer)
            return
        core.begin_epoch_end(peer.epoch, progress.global_progress, has_scaler=False)
        progress.pause(self.now)
        peer.in_round = True
        self.joined.setdefault(peer.epoch, set()).add(peer.key)
        self._join_round(peer)

    def _join_round(self, peer: SimPeer) -> None:
        """``peer`` joined the round of its epoch (in ``self.joined``): one group of all."""
        if len(self.joined[peer.epoch]) == len(self.peers):  # the group is complete: it runs
            duration = self.first_round_time if peer.epoch == 0 else self.round_time
            for member in self.peers:
                delay = duration + self.jitter * self.rng.random()
                self._at(self.now + delay, "round_done", member)

    def _on_round_done(self, peer: SimPeer) -> None:
        decision = peer.core.on_round_result(True, state_round_running=False)
        assert isinstance(decision, FinishEpoch)
        advanced = peer.core.on_epoch_finished(decision.next_epoch)
        peer.contributed[peer.epoch] = peer.samples
        peer.epoch, peer.samples, peer.in_round = advanced.epoch, 0, False
        peer.progress.resume(self.now)
        peer.progress.update_epoch(peer.epoch, self.now)
        self._publish(peer, peer.progress.local_progress)
        self._at(self.now + peer.step_time, "step", peer)

    def epoch_sizes(self, epochs: int) -> list[int]:
        return [sum(p.contributed[e] for p in self.peers) for e in range(epochs)]


class StallingSwarmSim(SwarmSim):
    """A loaded box: each step's duration varies (lognormal) and some steps stall for 0.3-1 s
    (the trainer thread lost the GIL or the CPU)."""

    stall_probability = 0.05

    def _at(self, when: float, kind: str, *payload) -> None:
        if kind == "step":
            duration = (when - self.now) * self.rng.lognormvariate(0.0, 0.5)
            if self.rng.random() < self.stall_probability:
                duration += self.rng.uniform(0.3, 1.0)
            when = self.now + duration
        super()._at(when, kind, *payload)


def _run_swarm(sim_type: type[SwarmSim], seed: int, epochs: int = 6) -> SwarmSim:
    rng = random.Random(seed)
    sim = sim_type([rng.uniform(0.03, 0.12) for _ in range(3)], seed=seed)
    sim.run(epochs)
    assert all(len(members) == 3 for members in sim.joined.values())  # nobody left behind
    for peer in sim.peers:
        stats = peer.core.statistics()
        assert stats.epochs_ended >= epochs and stats.epochs_adopted == 0
    return sim


@pytest.mark.parametrize("seed", range(6))
def test_steady_swarms_end_each_epoch_at_the_target(seed):
    """What ``test_peers_advance_together_and_learn`` bounded loosely on a real swarm (epoch
    sizes in 0.4-1.5x, later 0.8-1.2x the target): three peers of different speeds, a slow
    first round, uneven round ends. Each epoch ends when the target is reached, overshooting
    by at most one batch per peer (the steps under way when the others saw it)."""
    sim = _run_swarm(SwarmSim, seed)
    for epoch, size in enumerate(sim.epoch_sizes(6)):
        assert TARGET <= size <= TARGET + 3 * SwarmSim.BATCH, (epoch, sim.epoch_sizes(6))


@pytest.mark.parametrize("seed", range(6))
def test_stalling_swarms_end_epochs_on_the_eta_before_the_target(seed):
    """Why the real-swarm bounds were load-sensitive (docs/STATUS.md, #6): the ETA
    extrapolates each peer's samples at its samples/s since its last report, also through a
    stall, so on a loaded box epochs end on the ETA short of the target (here 0.6-1.0x). This
    pins today's behaviour; a better ETA should raise the lower bound."""
    sim = _run_swarm(StallingSwarmSim, seed)
    sizes = sim.epoch_sizes(6)
    assert all(TARGET * 0.5 <= size <= TARGET + 3 * SwarmSim.BATCH for size in sizes), sizes
    assert min(sizes) < TARGET  # the stalls did cut epochs short
