"""Records of peers that cannot be dialled (a killed run's) stop steering the progress core.

Pure: the decisions of ``OwnerLiveness`` and how ``ProgressCore`` uses them; every event carries
its own ``now``. The real run that needs this is in ``tests/test_optim_rerun.py``.
"""

from __future__ import annotations

import pytest

from swarmtrain.optim import LocalProgress, ProgressConfig, ProgressCore
from swarmtrain.optim.progress_liveness import (
    OwnerCandidate,
    OwnerLiveness,
    Probe,
    ProbeOutcome,
)

T0 = 1_000_000.0
REACHABLE, UNREACHABLE, UNKNOWN = (
    ProbeOutcome.REACHABLE,
    ProbeOutcome.UNREACHABLE,
    ProbeOutcome.UNKNOWN,
)


def make_core(now=T0, **settings) -> ProgressCore:
    config = ProgressConfig(target_batch_size=100, **settings)
    return ProgressCore(config, peer_id=b"me", client_mode=False, now=now)


def key(peer: bytes) -> bytes:
    """A record's key: the peer id it is bound to (its signed subkey)."""
    return peer


def fetch(core, now, *records, expiration=None):
    entries = {key(r.peer_id): (r, expiration or now + 60) for r in records}
    return core.on_fetch(entries, now)


def at(peer: bytes, epoch: int, samples: int = 0, time=T0, client_mode=False) -> LocalProgress:
    return LocalProgress(peer, epoch, samples, 10.0, time, client_mode)


def candidate(peer=b"a", expiration=T0 + 60) -> OwnerCandidate:
    return OwnerCandidate(key(peer), peer, expiration)


# ------------------------------------------------------------ OwnerLiveness


def test_only_records_ahead_of_us_from_dialable_peers_are_probed():
    core = make_core()
    core.update_epoch(3, T0)
    fetch(
        core,
        T0,
        *(at(b"ahead", 4), at(b"level", 3), at(b"behind", 1), at(b"client", 4, client_mode=True)),
    )
    assert core.probes_due(T0) == [Probe(key(b"ahead"), b"ahead", T0 + 60)]


def test_a_probe_in_flight_or_a_confirmed_owner_is_not_probed_again():
    liveness = OwnerLiveness(retry_period=10.0)
    (probe,) = liveness.due([candidate()], T0)
    assert liveness.due([candidate()], T0 + 1) == []  # still in flight
    assert liveness.on_result(probe, REACHABLE, T0 + 1) is False  # nothing was ignored
    assert liveness.due([candidate(expiration=T0 + 90)], T0 + 30) == []
    # another peer id under the same key is another claim: probed
    assert len(liveness.due([OwnerCandidate(key(b"a"), b"b", T0 + 90)], T0)) == 1


def test_an_unreachable_owner_is_ignored_until_it_stores_a_newer_record():
    liveness = OwnerLiveness(retry_period=10.0)
    (probe,) = liveness.due([candidate(expiration=T0 + 60)], T0)
    assert liveness.on_result(probe, UNREACHABLE, T0 + 3) is True
    assert not liveness.counts(key(b"a"), T0 + 60)
    assert liveness.ignored() == 1
    assert liveness.due([candidate(expiration=T0 + 60)], T0 + 100) == []  # still that record
    assert liveness.counts(key(b"a"), T0 + 61)  # a newer record: its owner was alive to store it
    liveness.prune({key(b"a"): T0 + 61})
    assert liveness.ignored() == 0


def test_a_failed_owner_is_retried_only_after_the_retry_period():
    liveness = OwnerLiveness(retry_period=10.0)
    (probe,) = liveness.due([candidate(expiration=T0 + 60)], T0)
    liveness.on_result(probe, UNREACHABLE, T0 + 3)
    newer = candidate(expiration=T0 + 65)
    assert liveness.due([newer], T0 + 5) == []  # counts again, but no new dial yet
    assert liveness.counts(newer.key, newer.expiration_time)
    (again,) = liveness.due([newer], T0 + 13)
    assert again.version == T0 + 65


def test_an_owner_without_known_address_counts_only_while_another_owner_answered():
    liveness = OwnerLiveness(retry_period=10.0)
    probes = {p.peer_id: p for p in liveness.due([candidate(b"a"), candidate(b"b")], T0)}
    assert liveness.on_result(probes[b"a"], UNKNOWN, T0) is True
    assert not liveness.counts(key(b"a"), T0 + 60)  # nobody reached: a swarm that is gone?
    assert liveness.ignored() == 1
    assert liveness.on_result(probes[b"b"], REACHABLE, T0 + 1) is True
    assert liveness.counts(key(b"a"), T0 + 60)  # the swarm lives: benefit of the doubt
    assert liveness.ignored() == 0
    assert liveness.due([candidate(b"a")], T0 + 5) == []
    assert len(liveness.due([candidate(b"a")], T0 + 10)) == 1  # retried: an address may come
    liveness.prune({key(b"a"): T0 + 60})  # the reachable owner's record is gone
    assert not liveness.counts(key(b"a"), T0 + 60)
    assert liveness.counts(key(b"a"), T0 + 61)  # stored again since: its owner lives


def test_a_record_stored_during_a_failed_probe_still_counts():
    liveness = OwnerLiveness(retry_period=10.0)
    (probe,) = liveness.due([candidate(expiration=T0 + 60)], T0)
    liveness.on_result(probe, UNREACHABLE, T0 + 3)  # the probe saw version T0 + 60
    assert liveness.counts(key(b"a"), T0 + 62)  # stored at T0 + 2: the owner lives


def test_keys_without_records_are_forgotten():
    liveness = OwnerLiveness(retry_period=10.0)
    (probe,) = liveness.due([candidate()], T0)
    liveness.on_result(probe, REACHABLE, T0)
    liveness.prune({})
    assert len(liveness.due([candidate()], T0 + 1)) == 1  # a new record, a new probe


@pytest.mark.parametrize("period", [0, -1, float("inf"), float("nan")])
def test_retry_period_must_be_positive_and_finite(period):
    with pytest.raises(ValueError, match="retry_period"):
        OwnerLiveness(retry_period=period)


# ------------------------------------------------- ProgressCore with probes


def test_a_killed_runs_records_stop_steering_a_newcomer_once_their_owners_fail_a_dial():
    core = make_core()
    dead = [at(b"d1", 190), at(b"d2", 190), at(b"d3", 189)]
    assert fetch(core, T0, *dead).epoch == 190  # today: the newcomer would load state
    probes = core.probes_due(T0)
    assert sorted(p.peer_id for p in probes) == [b"d1", b"d2", b"d3"]
    assert core.probes_due(T0) == []  # in flight
    for probe in probes:
        core.on_probe_result(probe, UNREACHABLE, T0 + 1)
    progress = core.global_progress
    assert (progress.epoch, progress.num_peers) == (0, 0)
    assert core.peers(T0 + 1) == {}
    assert core.num_unreachable_ignored == 3
    # the same records fetched again change nothing
    assert fetch(core, T0 + 5, *dead, expiration=T0 + 60).epoch == 0
    assert core.probes_due(T0 + 20) == []


def test_a_killed_run_whose_addresses_nobody_knows_does_not_steer_a_newcomer():
    core = make_core()
    fetch(core, T0, at(b"d1", 101), at(b"d2", 101))
    for probe in core.probes_due(T0):
        core.on_probe_result(probe, UNKNOWN, T0)
    assert (core.global_progress.epoch, core.global_progress.num_peers) == (0, 0)


def test_live_peers_ahead_still_steer_and_a_dead_one_among_them_does_not_count():
    core = make_core()
    fetch(
        core,
        T0,
        *(at(b"live1", 7, 40), at(b"far", 7, 30), at(b"dead", 8, 90)),
    )
    outcomes = {b"live1": REACHABLE, b"far": UNKNOWN, b"dead": UNREACHABLE}
    for probe in core.probes_due(T0):
        core.on_probe_result(probe, outcomes[probe.peer_id], T0 + 1)
    progress = core.global_progress
    assert progress.epoch == 7 and progress.num_peers == 2  # an unknown address: benefit of doubt
    assert set(core.peers(T0 + 1)) == {key(b"live1"), key(b"far")}


def test_an_ignored_owner_that_stores_again_counts_again():
    core = make_core()
    fetch(core, T0, at(b"a", 4), at(b"b", 4), expiration=T0 + 60)
    for probe in core.probes_due(T0):  # a network hiccup: both dials failed
        core.on_probe_result(probe, UNREACHABLE, T0 + 1)
    assert core.global_progress.epoch == 0
    progress = fetch(core, T0 + 2, at(b"a", 4, 10), at(b"b", 4, 10), expiration=T0 + 62)
    assert (progress.epoch, progress.num_peers) == (4, 2)
    assert core.num_unreachable_ignored == 0


def test_probe_settings_are_validated():
    with pytest.raises(ValueError, match="probe_timeout"):
        ProgressConfig(target_batch_size=1, probe_timeout=0)
    with pytest.raises(ValueError, match="probe_retry_period"):
        ProgressConfig(target_batch_size=1, probe_retry_period=-1.0)
