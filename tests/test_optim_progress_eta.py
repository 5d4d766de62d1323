"""The swarm's samples and ETA in an epoch (``estimate_epoch``): pure, credits from a
``SampleCredits`` as the core keeps them."""

import math

import pytest

from swarmtrain.optim.progress_eta import estimate_epoch
from swarmtrain.optim.progress_types import EPS, ImplausibleProgress, LocalProgress
from swarmtrain.optim.progress_votes import CREDIT_SLACK, SampleCredits

T0 = 1_000.0
TARGET = 1000


def record(peer: bytes, epoch: int, samples: int, rate: float, time: float = T0):
    return LocalProgress(peer, epoch, samples, rate, time, False)


def credits_for(*records: LocalProgress, started_at: float = T0) -> SampleCredits:
    """Credits of peers seen entering the global epoch at ``started_at`` (witnessed)."""
    credits = SampleCredits()
    for progress in records:
        credits.track(
            progress.peer_id,
            None,
            progress,
            started_at,
            global_epoch=progress.epoch,
            epoch_started_at=started_at,
            witnessed=True,
            target=TARGET,
        )
    return credits


def test_alone_the_eta_is_what_remains_at_our_speed_from_our_last_report():
    local = record(b"me", 3, 100, 10.0, time=T0)
    estimate = estimate_epoch(3, local, {}, SampleCredits(), None, math.inf, TARGET, T0 + 20)
    assert estimate.samples == 100 and estimate.rate == 10.0
    assert estimate.eta == pytest.approx((TARGET - 100 - 20 * 10.0) / (10.0 + EPS))
    assert estimate.implausible == ()
    nobody = estimate_epoch(3, None, {}, SampleCredits(), None, math.inf, TARGET, T0)
    assert nobody.samples == 0 and nobody.rate == 0 and nobody.eta == TARGET / EPS


def test_peers_behind_and_unvouched_peers_add_neither_samples_nor_speed():
    others = {
        b"a": record(b"a", 3, 200, 10.0),
        b"behind": record(b"behind", 2, 900, 50.0),
        b"free": record(b"free", 3, 500, 50.0),
    }
    credits = credits_for(*others.values(), started_at=T0 - 100)
    estimate = estimate_epoch(3, None, others, credits, {b"a"}, 100.0, TARGET, T0)
    assert estimate.samples == 200 and estimate.rate == 10.0
    everyone = estimate_epoch(3, None, others, credits, None, 100.0, TARGET, T0)
    assert everyone.samples == 700 and everyone.rate == 60.0


def test_claims_are_capped_by_their_credit_and_twice_over_it_reported_even_unvouched():
    liar = record(b"liar", 3, 10_000, 1e9)
    credits = credits_for(liar, started_at=T0 - 10)
    bound = 5.0 * (10 + CREDIT_SLACK)  # max_rate 5 samples/s since it entered the epoch
    estimate = estimate_epoch(3, None, {b"liar": liar}, credits, set(), 5.0, TARGET, T0)
    assert estimate.samples == 0 and estimate.rate == 0.0  # nobody vouches for it
    assert estimate.implausible == (
        (b"liar", ImplausibleProgress(b"liar", b"liar", 3, 10_000, 3, int(bound))),
    )
    counted = estimate_epoch(3, None, {b"liar": liar}, credits, None, 5.0, TARGET, T0)
    assert counted.samples == int(bound) and counted.rate == 5.0


def test_a_peer_that_stepped_ahead_still_counts_its_samples_of_the_epoch_it_left():
    before = record(b"a", 3, 400, 10.0, time=T0)
    credits = credits_for(before, started_at=T0 - 100)
    after = record(b"a", 4, 0, 10.0, time=T0 + 1)
    credits.track(
        b"a",
        before,
        after,
        T0 + 1,
        global_epoch=3,
        epoch_started_at=T0 - 100,
        witnessed=True,
        target=TARGET,
    )
    estimate = estimate_epoch(3, None, {b"a": after}, credits, None, 100.0, TARGET, T0 + 1)
    assert estimate.samples == 410  # its last report, extrapolated to when it stepped
    assert estimate.rate == 0.0  # it trains toward the next epoch now
