"""The pure progress core: epoch/ETA math, adaptive refresh, staleness, publishing, warnings.

No network and no clock: every event carries its own ``now``.
"""

from __future__ import annotations

import math

import pytest

from swarmtrain.optim import (
    ClockSkewDetected,
    GlobalProgress,
    ImplausibleProgress,
    LocalProgress,
    LonePeer,
    PerformanceEMA,
    ProgressConfig,
    ProgressCore,
    TargetNotReached,
)
from swarmtrain.optim.progress_types import describe_eta

T0 = 1_000_000.0


def make_core(target=100, now=T0, client_mode=False, **settings) -> ProgressCore:
    config = ProgressConfig(target_batch_size=target, **settings)
    return ProgressCore(config, peer_id=b"me", client_mode=client_mode, now=now)


def record(peer, epoch, samples, sps=10.0, time=T0, client_mode=False) -> LocalProgress:
    return LocalProgress(peer, epoch, samples, sps, time, client_mode)


def fetch(core, now, *records, expiration=None):
    """A DHT fetch that returns ``records``, each under its peer id (its verified subkey)."""
    entries = {r.peer_id: (r, expiration or now + 60) for r in records}
    return core.on_fetch(entries, now)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "settings",
    [
        {"target_batch_size": 0},
        {"target_batch_size": True},
        {"target_batch_size": 1.5},
        {"min_refresh_period": 0},
        {"min_refresh_period": 20.0, "max_refresh_period": 10.0},
        {"default_refresh_period": math.inf},
        {"expected_drift_rate": -0.1},
        {"performance_ema_alpha": 0.0},
        {"performance_ema_alpha": 1.5},
        {"metadata_expiration": -1},
        {"stall_factor": 0.5},
        {"gossip_period": math.nan},
        {"quorum_fraction": 1.0},
        {"quorum_fraction": -0.1},
        {"max_rate_factor": 0.5},
    ],
)
def test_config_rejects_bad_values(settings):
    settings = {"target_batch_size": 10, **settings}
    with pytest.raises((ValueError, TypeError)):
        ProgressConfig(**settings)


def test_local_progress_validates_and_round_trips():
    progress = record(b"p", 3, 7, sps=2, time=5)
    as_dict = progress.to_dict()
    assert isinstance(as_dict["samples_per_second"], float) and isinstance(as_dict["time"], float)
    assert LocalProgress.from_dict(as_dict) == progress
    with pytest.raises(ValueError):
        record(b"p", -1, 0)
    with pytest.raises(ValueError):
        record(b"p", 0, 0, sps=math.nan)
    with pytest.raises(TypeError):
        LocalProgress(b"p", 0, 0, 1.0, 0.0, client_mode=1)


# --------------------------------------------------------------------- EMA


def test_performance_ema_first_update_is_exact_then_smooths():
    ema = PerformanceEMA(alpha=0.5, now=0.0)
    assert ema.samples_per_second == pytest.approx(0, abs=1e-9)
    assert ema.update(10, now=1.0) == pytest.approx(10.0)  # bias-corrected: exact at once
    # 10 samples in 4 s: seconds/sample 0.4; EMA (0.5*0.4 + 0.25*0.1) / (1 - 0.25) = 0.3
    assert ema.update(10, now=5.0) == pytest.approx(1 / 0.3)
    with pytest.raises(ValueError):
        ema.update(0, now=6.0)


def test_performance_ema_pause_and_reset():
    ema = PerformanceEMA(alpha=1.0, now=0.0)
    ema.pause(now=2.0)  # 2 s of work before the pause
    ema.resume(now=100.0)  # 98 s of averaging do not count
    assert ema.update(6, now=101.0) == pytest.approx(2.0)  # 6 samples in 3 s
    ema.pause(now=102.0)
    assert ema.paused
    assert ema.update(2, now=150.0) == pytest.approx(2.0)  # counted while paused: 1 s
    ema.resume(now=150.0)
    ema.reset_timer(now=200.0)
    assert ema.update(4, now=202.0) == pytest.approx(2.0)


# ---------------------------------------------------------- global progress


def test_lone_peer_counts_its_own_samples_and_eta():
    core = make_core(target=100)
    assert core.global_progress.next_fetch_time == T0  # first fetch at once
    assert not core.is_active
    core.report_local_progress(0, 10, now=T0 + 1)  # 10 samples/s
    progress = core.global_progress
    assert (progress.epoch, progress.samples_accumulated, progress.num_peers) == (0, 10, 1)
    assert progress.eta_next_epoch == pytest.approx(T0 + 1 + 9.0)
    assert core.is_active
    fetch(core, T0 + 1)  # nobody else: refresh after default_refresh_period
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 1 + 3.0)


def test_eta_is_unknown_until_someone_reports_a_speed():
    # the review's "ETA 51200000000000000000000.00 s": no speed, so no estimate to print
    core = make_core(target=512)
    assert describe_eta(core.global_progress, T0) == "unknown (no speed reported yet)"
    core.report_local_progress(0, 0, now=T0)  # announced, no samples yet
    assert describe_eta(core.global_progress, T0) == "unknown (no speed reported yet)"
    fetch(core, T0 + 1, record(b"a", 0, 12, sps=0.0, time=T0 + 1))
    assert describe_eta(core.global_progress, T0 + 1).startswith("unknown")
    fetch(core, T0 + 2, record(b"a", 0, 112, sps=100.0, time=T0 + 2))
    assert core.global_progress.samples_per_second == pytest.approx(100.0)
    assert describe_eta(core.global_progress, T0 + 2) == "4.00 s"
    # reached: nothing to wait (at its 100 samples/s: a jump at 0 samples/s would not count)
    fetch(core, T0 + 3, record(b"a", 0, 600, sps=100.0, time=T0 + 3))
    assert describe_eta(core.global_progress, T0 + 3) == "0.00 s"


def test_global_epoch_samples_and_eta_from_peers():
    core = make_core(target=100)
    core.report_local_progress(0, 10, now=T0 + 1)  # local rate 10/s
    progress = fetch(
        core,
        T0 + 1,
        record(b"a", 1, 20, sps=10, time=T0 + 1),
        record(b"b", 1, 30, sps=20, time=T0),  # 1 s old: +20 estimated samples
        record(b"c", 0, 50, sps=10, time=T0 + 1),  # behind (still averaging): not counted
        record(b"d", 2, 90, sps=10, time=T0 + 1, client_mode=True),  # clients set no epoch
        record(b"e", 1, 0, sps=0.0, time=T0 + 1),  # a, b and e: 3 of the 5 voters are at 1
    )
    assert progress.epoch == 1
    assert progress.samples_accumulated == 50
    assert (progress.num_peers, progress.num_clients) == (6, 1)
    # estimated 20 + 30 + 20 = 70; 30 remaining at the 10 + 20 samples/s of a and b (we, c and
    # the client report other epochs)
    assert progress.eta_next_epoch == pytest.approx(T0 + 1 + 1.0)
    assert core.ready_to_update_epoch(T0 + 1)  # the swarm is ahead of us
    assert core.estimated_next_update_time(T0 + 1) == T0 + 1


def test_ready_when_target_reached_or_eta_passed():
    core = make_core(target=100)
    core.report_local_progress(0, 10, now=T0 + 1)
    fetch(core, T0 + 1, record(b"a", 0, 40, sps=10, time=T0 + 1))
    assert not core.ready_to_update_epoch(T0 + 1)
    eta = core.global_progress.eta_next_epoch
    assert eta == pytest.approx(T0 + 1 + 50 / 20)
    assert core.estimated_next_update_time(T0 + 1) == eta
    assert core.ready_to_update_epoch(eta)  # the deadline passed
    fetch(core, T0 + 2, record(b"a", 0, 90, sps=10, time=T0 + 2))
    assert core.global_progress.samples_accumulated == 100
    assert core.ready_to_update_epoch(T0 + 2)


def test_update_epoch_moves_global_epoch_and_resets_samples():
    core = make_core(target=100)
    core.report_local_progress(0, 60, now=T0 + 1)
    fetch(core, T0 + 1, record(b"a", 0, 40, time=T0 + 1))
    assert core.fetched_this_epoch
    assert core.update_epoch(None, now=T0 + 2) == 1
    progress = core.global_progress
    assert (progress.epoch, progress.samples_accumulated) == (1, 0)
    assert not core.fetched_this_epoch
    assert not core.ready_to_update_epoch(T0 + 2)  # a fresh ETA, not the old one
    local = core.local_progress
    assert (local.epoch, local.samples_accumulated, local.time) == (1, 0, T0 + 2)
    assert local.samples_per_second == pytest.approx(60.0)
    assert core.update_epoch(7, now=T0 + 3) == 7


def test_adaptive_refresh_period():
    # 2 peers, 70 samples to go at 10/s: ETA 7 s, refresh in 7 * 2 / max(2 + 3, 2 * 1.2) s
    core = make_core(target=100)
    core.report_local_progress(0, 10, now=T0 + 1)
    fetch(core, T0 + 1, record(b"a", 0, 20, sps=0.0, time=T0 + 1))
    assert core.global_progress.eta_next_epoch == pytest.approx(T0 + 1 + 7.0)
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 1 + 7.0 * 2 / 5)
    # clipped to [min, max]
    fetch(core, T0 + 2, record(b"a", 0, 99, sps=0.0, time=T0 + 2))
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 2 + 0.5)
    slow = make_core(target=10**9)
    slow.report_local_progress(0, 1, now=T0 + 1)
    fetch(slow, T0 + 1, record(b"a", 0, 0, sps=0.0, time=T0 + 1))
    assert slow.global_progress.next_fetch_time == pytest.approx(T0 + 1 + 10.0)


def test_gossip_only_brings_the_next_fetch_earlier():
    core = make_core(target=1000)
    core.report_local_progress(0, 1, now=T0 + 1)
    fetch(core, T0 + 1, record(b"a", 0, 0, sps=1.0, time=T0 + 1))
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 11)  # max period
    for i in range(20):  # a steady flow of gossip never postpones the fetch
        now = T0 + 1 + i * 0.1
        core.on_gossip(b"a", record(b"a", 0, i, sps=1.0, time=now), now + 60, now)
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 11)
    # news that the epoch nearly ended brings it to the last fetch + the min period (from a peer
    # new to us: in an epoch we joined midway its samples are taken on trust; a's own jump to
    # 999 at 1 sample/s would be capped by its speed)
    core.on_gossip(b"c", record(b"c", 0, 999, sps=1.0, time=T0 + 4), T0 + 70, now=T0 + 4)
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 1 + 0.5)


def test_fetch_failure_retries_after_default_period():
    core = make_core()
    core.on_fetch_failed(T0)
    assert core.global_progress.next_fetch_time == T0 + 3.0
    assert core.num_fetches == 0


def test_a_peer_alone_at_the_target_fetches_once_before_it_ends_the_epoch():
    # peers that start together publish their first records with their first steps: a peer
    # whose last fetch saw nobody must look again before it ends an epoch alone
    core = make_core(target=100)
    fetch(core, T0)  # the first fetch, before anyone trained: nobody
    core.report_local_progress(0, 60, now=T0 + 1)
    assert not core.global_progress.confirming_alone
    core.report_local_progress(0, 100, now=T0 + 2)  # alone at the target
    progress = core.global_progress
    assert progress.confirming_alone and progress.samples_accumulated == 100
    assert progress.next_fetch_time == T0 + 2  # at once
    assert not core.ready_to_update_epoch(T0 + 2)
    core.report_local_progress(0, 130, now=T0 + 2.01)  # still confirming while it trains on
    assert core.global_progress.confirming_alone
    assert not core.ready_to_update_epoch(T0 + 2.01)
    fetch(core, T0 + 2.05)  # nobody else: the epoch ends alone
    assert not core.global_progress.confirming_alone
    assert core.ready_to_update_epoch(T0 + 2.05)
    # the next epoch asks again
    core.update_epoch(None, now=T0 + 3)
    core.report_local_progress(1, 100, now=T0 + 4)
    assert core.global_progress.confirming_alone
    assert not core.ready_to_update_epoch(T0 + 4)


def test_the_confirming_fetch_finds_the_peers_that_started_together():
    core = make_core(target=100)
    fetch(core, T0)
    core.report_local_progress(0, 100, now=T0 + 1)
    assert not core.ready_to_update_epoch(T0 + 1)
    # two peers that started with us: 32 samples each, at 64 samples/s like us
    progress = fetch(
        core,
        T0 + 1.1,
        record(b"a", 0, 32, sps=64.0, time=T0 + 1.1),
        record(b"b", 0, 32, sps=64.0, time=T0 + 1.1),
    )
    assert not progress.confirming_alone
    assert (progress.epoch, progress.num_peers) == (0, 3)
    assert progress.samples_accumulated == 164
    assert core.ready_to_update_epoch(T0 + 1.1)  # together: one epoch, one round


def test_a_failed_fetch_does_not_hold_a_lone_peer_back():
    core = make_core(target=100)
    core.report_local_progress(0, 100, now=T0 + 1)
    assert not core.ready_to_update_epoch(T0 + 1)
    core.on_fetch_failed(T0 + 1.5)  # the DHT cannot tell: train on alone
    assert core.ready_to_update_epoch(T0 + 1.5)


def test_a_fetch_that_ended_before_the_target_does_not_confirm():
    core = make_core(target=100)
    core.report_local_progress(0, 90, now=T0 + 1)
    fetch(core, T0 + 1)  # 10 samples short (the estimate too)
    core.report_local_progress(0, 100, now=T0 + 2)
    assert core.global_progress.confirming_alone
    fetch(core, T0 + 2)  # a fetch that ends at that moment counts
    assert core.ready_to_update_epoch(T0 + 2)


# ------------------------------------------------ lying peers (audit 3) and honest ones


def implausible(core, now):
    return [w for w in core.warnings(now) if isinstance(w, ImplausibleProgress)]


def test_epoch_claim_far_ahead_is_ignored_and_reported_once():
    for honest in ([], [record(b"b", 3, 20, time=T0)]):  # a swarm of 2, and one of 3
        core = make_core(target=100)
        core.update_epoch(3, now=T0)
        core.report_local_progress(3, 10, now=T0 + 1)
        liar = record(b"evil", 10**9, 1, time=T0 + 1)
        progress = fetch(core, T0 + 1, liar, *honest)
        assert progress.epoch == 3 and not core.ready_to_update_epoch(T0 + 1)
        assert progress.num_peers == 1 + len(honest)  # the liar is not counted at all
        (warning,) = implausible(core, T0 + 1)
        assert (warning.peer_id, warning.key, warning.epoch) == (b"evil", b"evil", 10**9)
        assert b"evil".hex() in str(warning) and "epoch 1000000000" in str(warning)
        fetch(core, T0 + 2, liar, *honest)
        assert implausible(core, T0 + 2) == []  # once per peer
        assert core.global_progress.epoch == 3


def test_samples_far_beyond_the_speed_do_not_end_the_epoch():
    core = make_core(target=1000)
    core.report_local_progress(0, 10, now=T0 + 1)
    fetch(core, T0 + 1, record(b"a", 0, 10, sps=10, time=T0 + 1))
    core.update_epoch(1, now=T0 + 2)  # we saw epoch 1 begin: nobody's samples on trust now
    fetch(core, T0 + 2, record(b"a", 1, 0, sps=10, time=T0 + 2))
    assert core.global_progress.epoch == 1
    core.report_local_progress(1, 20, now=T0 + 4)
    liar = record(b"evil", 1, 10**12, sps=1e12, time=T0 + 4)
    progress = fetch(core, T0 + 4, record(b"a", 1, 20, sps=10, time=T0 + 4), liar)
    # the liar counts at most 8x the typical 10 samples/s over the 2 s of the epoch, plus 1 s
    assert progress.samples_accumulated == 20 + 20 + 8 * 10 * 3
    assert not core.ready_to_update_epoch(T0 + 4)
    assert progress.samples_per_second == pytest.approx(10 + 10 + 80)  # its speed capped too
    assert progress.eta_next_epoch > T0 + 4 + 5
    (warning,) = implausible(core, T0 + 4)
    assert (warning.peer_id, warning.samples, warning.allowed) == (b"evil", 10**12, 240)
    assert "240 of the 1000000000000 samples" in str(warning)
    # and it cannot come back with a jump either: +80 samples/s at most
    fetch(core, T0 + 5, liar)
    assert core.global_progress.samples_accumulated == 20 + 20 + 8 * 10 * 4


def test_samples_of_a_new_peer_in_a_witnessed_epoch_count_since_it_began():
    core = make_core(target=1000)
    core.report_local_progress(0, 10, now=T0 + 1)
    core.update_epoch(1, now=T0 + 2)
    fetch(core, T0 + 12, record(b"late", 1, 90, sps=10, time=T0 + 12))  # seen after 10 s
    assert core.global_progress.samples_accumulated == 90
    assert implausible(core, T0 + 12) == []


def test_peer_that_just_stepped_still_counts_toward_the_epoch_in_a_swarm_of_two():
    core = make_core(target=100)
    core.report_local_progress(0, 30, now=T0 + 3)  # 10 samples/s
    fetch(core, T0 + 3, record(b"a", 0, 30, sps=10, time=T0 + 3))
    core.on_gossip(b"a", record(b"a", 0, 40, sps=10, time=T0 + 4), T0 + 64, now=T0 + 4)
    core.report_local_progress(0, 50, now=T0 + 5)
    # a reached the target in its view (our 50 + its 50) and stepped; its report of 50 was
    # never sent, its step was: extrapolated from its last report, it still counts
    core.on_gossip(b"a", record(b"a", 1, 0, sps=10, time=T0 + 5), T0 + 65, now=T0 + 5)
    progress = core.global_progress
    assert progress.epoch == 0  # one of two peers does not make a quorum...
    assert progress.samples_accumulated == 100  # ...but the epoch did reach its target
    assert progress.num_peers == 2
    assert core.ready_to_update_epoch(T0 + 5)
    assert implausible(core, T0 + 5) == []
    core.update_epoch(None, now=T0 + 5.1)  # we step too: together again
    assert core.global_progress.epoch == 1 and core.global_progress.samples_accumulated == 0


def test_swarm_that_stepped_is_ahead_of_a_peer_that_did_not():
    core = make_core(target=100)
    core.update_epoch(5, now=T0)
    progress = fetch(core, T0 + 1, record(b"a", 6, 0, time=T0 + 1), record(b"b", 6, 0, time=T0))
    assert progress.epoch == 6 and core.ready_to_update_epoch(T0 + 1)


def test_burst_after_a_pause_counts_in_full():
    core = make_core(target=10_000)
    core.report_local_progress(0, 10, now=T0 + 1)
    core.update_epoch(1, now=T0 + 1)
    fetch(core, T0 + 1, record(b"a", 1, 0, sps=10, time=T0 + 1))
    fetch(core, T0 + 2, record(b"a", 1, 10, sps=10, time=T0 + 2))
    # silent for 20 s (its network was down), then all it accumulated at 10 samples/s at once
    fetch(core, T0 + 22, record(b"a", 1, 210, sps=10, time=T0 + 22))
    assert core.global_progress.samples_accumulated == 210
    assert implausible(core, T0 + 22) == []


def test_late_joiner_follows_the_swarm_even_a_swarm_of_one():
    for others in ([record(b"a", 50, 10)], [record(b"a", 50, 10), record(b"b", 50, 5)]):
        core = make_core(target=100)  # not trained yet: it does not vote
        core.announce(now=T0)  # waiting for peers does not make it vote either
        assert fetch(core, T0, *others).epoch == 50
        assert core.ready_to_update_epoch(T0)  # the Optimizer loads the state
        assert implausible(core, T0) == []
    # a peer that trained holds its ground against one peer alone (it may lie), not two
    core = make_core(target=100)
    core.report_local_progress(0, 5, now=T0)
    assert fetch(core, T0, record(b"a", 50, 10)).epoch == 0
    assert fetch(core, T0 + 1, record(b"a", 50, 10), record(b"b", 50, 5)).epoch == 50


def test_quorum_is_more_than_half_of_the_voters():
    core = make_core(target=100)
    core.update_epoch(5, now=T0)
    ahead = [record(bytes([i]), 20, 0) for i in range(2)]
    behind = [record(bytes([10 + i]), 5, 0) for i in range(2)]
    assert fetch(core, T0, *ahead, *behind).epoch == 5  # 2 of 5 at 20: ignored
    assert len(implausible(core, T0)) == 2
    more = [record(bytes([8]), 20, 0), record(bytes([9]), 20, 0)]
    assert fetch(core, T0 + 1, *ahead, *more, *behind).epoch == 20  # 4 of 7


def test_many_records_claimed_by_one_peer_count_once():
    """One vote per peer id: a record counts only under the peer id it names (its verified
    subkey). One peer writing many subkeys, or under another peer's id, counts once."""
    core = make_core(target=100)
    core.update_epoch(3, now=T0)
    core.report_local_progress(3, 10, now=T0 + 1)  # 10 samples/s
    honest = [record(b"h1", 3, 10), record(b"h2", 3, 10)]
    # 20 subkeys of one peer, each claiming the next epoch: as 20 votes they were a quorum
    # (20 of 24 voters at epoch 4) and sent every honest peer into a state download
    flood = {f"sybil{i}".encode(): (record(b"evil", 4, 90), T0 + 60) for i in range(20)}
    own = {b"evil": (record(b"evil", 4, 90), T0 + 60)}
    mine = {b"me": (record(b"evil", 4, 90), T0 + 60)}  # under our id: never from the network
    entries = {r.peer_id: (r, T0 + 60) for r in honest} | flood | own | mine
    progress = core.on_fetch(entries, T0 + 1)
    assert core.num_unbound_refused == 20
    assert set(core.peers(T0 + 1)) == {b"h1", b"h2", b"evil"}
    assert (progress.epoch, progress.num_peers) == (3, 4)  # h1, h2, evil and this peer
    assert not core.ready_to_update_epoch(T0 + 1)
    # the only record ahead of us is probed once, by the id it is bound to
    assert [(p.key, p.peer_id) for p in core.probes_due(T0 + 1)] == [(b"evil", b"evil")]
    # newer records under the honest peers' ids that name another peer: refused, over gossip
    # and from the DHT; the honest records stay
    for key in (b"h1", b"h2"):
        assert not core.on_gossip(key, record(b"evil", 4, 0), T0 + 120, now=T0 + 2)
    fetch_hijack = {b"h1": (record(b"evil", 9, 99), T0 + 90), b"h2": (None, T0 + 90)}
    progress = core.on_fetch(fetch_hijack, T0 + 2)
    assert core.num_unbound_refused == 23  # (a departure names nobody: h2 left, see below)
    assert core.peers(T0 + 2)[b"h1"] == honest[0]
    assert (progress.epoch, progress.num_peers) == (3, 3)
    # the honest peers stepping is a quorum with the liar: the epoch moves on what peers vouch
    fetch(core, T0 + 3, record(b"h1", 4, 0), record(b"h2", 4, 0), expiration=T0 + 100)
    assert core.global_progress.epoch == 4


def test_stale_departed_and_older_records():
    core = make_core(target=100)
    b = record(b"b", 0, 10, client_mode=True)  # a client: it does not vote on the epoch
    fetch(core, T0, record(b"a", 2, 10), b, expiration=T0 + 10)
    assert core.global_progress.epoch == 2
    assert set(core.peers(T0)) == {b"a", b"b"}
    # an older record does not replace a newer one, from gossip or from the DHT
    assert not core.on_gossip(b"a", record(b"a", 9, 10), T0 + 5, now=T0)
    assert core.global_progress.epoch == 2
    assert core.on_gossip(b"a", record(b"a", 3, 10), T0 + 20, now=T0)
    fetch(core, T0 + 1, record(b"a", 2, 10), expiration=T0 + 10)
    assert core.global_progress.epoch == 3
    # a stale record is dropped on arrival, a held one when it expires
    assert not core.on_gossip(b"c", record(b"c", 9, 10), T0 + 1, now=T0 + 1)
    assert not core.on_gossip(b"me", record(b"me", 9, 10), T0 + 60, now=T0 + 1)
    fetch(core, T0 + 11)
    assert set(core.peers(T0 + 11)) == {b"a"}
    # a departure record (None) removes the peer
    assert core.on_gossip(b"a", None, T0 + 30, now=T0 + 12)
    assert core.peers(T0 + 12) == {}
    progress = core.global_progress
    assert (progress.epoch, progress.num_peers) == (0, 0)


def test_dht_records_of_the_same_version_merge_once():
    core = make_core()
    fetch(core, T0, record(b"a", 0, 10), expiration=T0 + 60)
    merged = core.num_merged
    fetch(core, T0 + 1, record(b"a", 0, 10), expiration=T0 + 60)
    assert core.num_merged == merged


# -------------------------------------------------------------- publishing


def test_store_and_gossip_schedule():
    core = make_core(gossip_period=0.5, metadata_expiration=60)
    assert core.take_store(T0) is None and core.take_gossip(T0) is None  # not active
    assert core.next_store_time(T0) == T0 + 30
    assert core.next_gossip_time(T0) is None
    assert not core.has_published
    core.report_local_progress(0, 5, now=T0 + 1)
    assert core.next_store_time(T0 + 1) == T0 + 1
    assert core.next_gossip_time(T0 + 1) == T0 + 1
    assert core.take_gossip(T0 + 1).samples_accumulated == 5
    assert core.take_store(T0 + 1).samples_accumulated == 5
    assert core.has_published
    core.report_local_progress(0, 6, now=T0 + 1.1)
    assert core.next_gossip_time(T0 + 1.1) == pytest.approx(T0 + 1.5)  # throttled
    core.update_epoch(None, now=T0 + 1.2)
    assert core.next_gossip_time(T0 + 1.2) == T0 + 1.2  # a new epoch goes out at once
    assert core.take_gossip(T0 + 1.2).epoch == 1
    assert core.next_gossip_time(T0 + 1.2) is None
    assert core.next_store_time(T0 + 1.2) == T0 + 1.2


def test_auxiliary_peer_never_publishes_and_lagging_peer_stops():
    core = make_core()
    core.report_local_progress(0, 0, now=T0 + 1)
    assert core.take_gossip(T0 + 1) is None and core.take_store(T0 + 1) is None
    assert core.global_progress.num_peers == 0
    core.report_local_progress(0, 5, now=T0 + 2)
    assert core.take_store(T0 + 2) is not None
    fetch(core, T0 + 3, record(b"a", 3, 0), record(b"b", 3, 0))  # 2 of 3 two epochs ahead
    assert not core.is_active and core.take_store(T0 + 3) is None


def test_announced_peer_publishes_and_counts_before_its_first_samples():
    core = make_core()
    fetch(core, T0, record(b"a", 0, 0, sps=0.0))
    assert core.global_progress.num_peers == 1  # only the other one: we have no samples yet
    core.announce(now=T0 + 1)
    assert core.is_active and core.global_progress.num_peers == 2
    published = core.take_store(T0 + 1)
    assert (published.epoch, published.samples_accumulated) == (0, 0)
    assert core.take_gossip(T0 + 1) is not None


# ---------------------------------------------------------------- warnings


def test_clock_skew_from_future_records_and_late_gossip():
    core = make_core(max_clock_skew=5.0, gossip_period=0.5)
    fetch(core, T0, record(b"a", 0, 1, time=T0 + 30), record(b"b", 0, 1, time=T0 - 40))
    warnings = core.warnings(T0)
    assert warnings == [ClockSkewDetected(b"a", pytest.approx(30.0))]
    assert "ahead" in str(warnings[0])
    # gossip travels in milliseconds: a report 20 s old means a clock 20 s behind ours
    core.on_gossip(b"c", record(b"c", 0, 1, time=T0 - 20), T0 + 40, now=T0)
    core.on_gossip(b"d", record(b"d", 0, 1, time=T0 - 3), T0 + 57, now=T0)
    (warning,) = core.warnings(T0)
    assert warning.peer_id == b"c" and warning.offset == pytest.approx(-19.5)
    assert "behind" in str(warning)
    fetch(core, T0 + 1, record(b"a", 0, 2, time=T0 + 31))
    assert core.warnings(T0 + 1) == []  # once per peer


def test_lone_peer_warning_after_timeout_and_rearmed():
    core = make_core(lone_peer_timeout=30)
    fetch(core, T0)
    assert core.warnings(T0 + 29) == []
    fetch(core, T0 + 20)
    (warning,) = core.warnings(T0 + 31)
    assert warning == LonePeer(0, pytest.approx(31.0))
    # it may only be waiting to load the state: say what is seen, not what it is doing
    assert "training alone" not in str(warning) and "initial_peers" in str(warning)
    assert core.warnings(T0 + 100) == []
    fetch(core, T0 + 101, record(b"a", 0, 1, time=T0 + 101))
    fetch(core, T0 + 200)  # alone again (a's record expired)
    assert core.warnings(T0 + 229) == []
    assert len(core.warnings(T0 + 231)) == 1


def test_target_not_reached_after_stall_factor_times_eta():
    core = make_core(target=100, stall_factor=3, lone_peer_timeout=1000)
    core.report_local_progress(0, 10, now=T0 + 1)  # 10/s: ETA 9 s, the epoch should take 10
    fetch(core, T0 + 1)
    assert core.warnings(T0 + 29) == []
    (warning,) = core.warnings(T0 + 31)
    assert isinstance(warning, TargetNotReached)
    assert (warning.epoch, warning.samples_accumulated) == (0, 10)
    assert warning.expected == pytest.approx(10.0)
    assert core.warnings(T0 + 100) == []  # once per epoch
    core.update_epoch(None, now=T0 + 101)
    assert core.warnings(T0 + 102) == []


def test_short_epochs_do_not_warn_before_min_stall_time():
    core = make_core(target=100, stall_factor=3, min_stall_time=30, lone_peer_timeout=1000)
    core.report_local_progress(0, 50, now=T0 + 1)  # 50/s: the epoch should take 2 s
    fetch(core, T0 + 1)
    assert core.warnings(T0 + 20) == []  # 10x the expected time, but under 30 s
    (warning,) = core.warnings(T0 + 32)
    assert isinstance(warning, TargetNotReached)


def test_no_stall_warning_when_speed_is_unknown_or_target_reached():
    core = make_core(target=100)
    fetch(core, T0)
    assert core.warnings(T0 + 1000) == [LonePeer(0, pytest.approx(1000.0))]
    done = make_core(target=10)
    done.report_local_progress(0, 10, now=T0 + 1)
    assert done.warnings(T0 + 1000) == []


def test_global_progress_is_frozen():
    core = make_core()
    with pytest.raises(AttributeError):
        core.global_progress.epoch = 3  # type: ignore[misc]
    assert isinstance(core.global_progress, GlobalProgress)
