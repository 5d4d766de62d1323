"""Samples and speeds count only when vouched for (issue 17 item 4, Sybils claiming samples).

Free identities whose records sit at the honest peers' epoch, claiming samples and speed, used
to end epochs early (each counted up to ``max_rate_factor`` times the reference speed). Once a
peer has round partners, a record's samples and speed count only if its owner is vouched for:
a live partner, a trusted peer, a peer some vouched record lists as its partner, or a peer known
from before (``swarmtrain.optim.progress_votes``). No network and no clock: the core tests pass
``now``; the swarms run in memory on a jumping clock (``PartialGroupSim``).
"""

from __future__ import annotations

import random

import pytest
from test_optim_epoch_core import TARGET, SwarmSim
from test_optim_progress_partners import PartialGroupSim

from swarmtrain.optim import LocalProgress, ProgressConfig, ProgressCore
from swarmtrain.optim.progress_records import _INVALID, _parse_progress
from swarmtrain.optim.progress_votes import MAX_LISTED_PARTNERS

T0 = 1_000_000.0
SYBILS = [f"sybil-{i}".encode() for i in range(10)]


def make_core(**settings) -> ProgressCore:
    config = ProgressConfig(target_batch_size=100, **settings)
    return ProgressCore(config, peer_id=b"me", client_mode=False, now=T0 - 10)


def record(
    peer: bytes, epoch: int, samples: int = 10, *, rate: float = 1.0, partners=(), now=T0
) -> LocalProgress:
    return LocalProgress(peer, epoch, samples, rate, now, False, tuple(partners))


def fetch(core: ProgressCore, now: float, *records: LocalProgress) -> None:
    core.on_fetch({r.peer_id: (r, now + 60) for r in records}, now)


def claims(now: float, samples: int = 90, rate: float = 1e6) -> list[LocalProgress]:
    """Sybil records at our epoch, claiming most of the target at a huge speed."""
    return [record(key, 3, samples, rate=rate, now=now) for key in SYBILS]


def with_partner(**settings) -> ProgressCore:
    """A core at epoch 3 (10 samples) that averaged with ``b``."""
    core = make_core(**settings)
    core.report_local_progress(3, 10, T0)
    core.on_round_partners([b"b"], 2, T0)
    return core


def test_unvouched_records_at_our_epoch_count_as_peers_but_not_samples_or_speed():
    # no partner yet: every record counts (capped per identity): the target is reached at once
    core = make_core()
    core.report_local_progress(3, 10, T0)
    fetch(core, T0 + 1, record(b"b", 3), *claims(T0 + 1))
    assert core.global_progress.samples_accumulated >= 100
    assert core.ready_to_update_epoch(T0 + 1)

    core = with_partner()
    fetch(core, T0 + 1, record(b"b", 3), *claims(T0 + 1))
    progress = core.global_progress
    assert progress.samples_accumulated == 20  # ours and b's
    assert progress.samples_per_second < 10  # ours and b's (1 sample/s each, about)
    assert progress.num_peers == 2 + len(SYBILS)  # still seen (matchmaking waits for them)
    assert core.num_unvouched_peers == len(SYBILS)
    assert not core.ready_to_update_epoch(T0 + 5)
    # one epoch ahead, their carried samples do not count either
    fetch(core, T0 + 6, record(b"b", 3), *[record(k, 4, 90, rate=1e6, now=T0 + 6) for k in SYBILS])
    assert core.global_progress.samples_accumulated == 20


def test_our_partners_lists_vouch_one_step_and_nobody_vouches_for_themselves():
    core = with_partner()
    honest = [
        record(b"b", 3, partners=[b"c"]),
        record(b"c", 3, partners=[b"b", b"d"]),
        record(b"d", 3, partners=[b"c"]),
    ]
    # Sybils list each other, us and our partner: that vouches for nobody
    sybils = [record(k, 3, 90, rate=1e6, partners=[b"me", b"b", *SYBILS]) for k in SYBILS]
    fetch(core, T0 + 1, *honest, *sybils)
    assert core.global_progress.samples_accumulated == 30  # us, b, and c whom b lists
    assert core.num_unvouched_peers == 1 + len(SYBILS)  # d: c is not our partner
    # c and d vouched for once stay vouched (known) while their records live
    fetch(core, T0 + 2, record(b"b", 3, partners=[b"c", b"d"], now=T0 + 2))
    assert core.num_unvouched_peers == len(SYBILS)
    fetch(core, T0 + 3, record(b"b", 3, now=T0 + 3))
    assert core.global_progress.samples_accumulated == 40
    # a Sybil that our partner lists (it averaged with it) is vouched for, but not those it
    # lists: one round with a partner of ours buys one identity
    fetch(core, T0 + 4, record(b"b", 3, partners=[SYBILS[0]], now=T0 + 4))
    assert core.num_unvouched_peers == len(SYBILS) - 1


def test_peers_known_before_our_partners_stay_vouched_while_their_records_live():
    """A swarm larger than its groups: peers that never averaged with us (nor with our
    partners lately) count, because we counted them before we had partners."""
    core = make_core()
    core.report_local_progress(3, 10, T0)
    fetch(core, T0 + 1, record(b"b", 3), record(b"x", 3), record(b"y", 3, partners=[b"x"]))
    core.on_round_partners([b"b"], 3, T0 + 2)  # x and y are in another group, for good
    fetch(core, T0 + 3, *claims(T0 + 3))
    assert core.global_progress.samples_accumulated == 40  # us, b, x, y
    # a known peer that leaves is forgotten: back, it counts only when someone vouches for it
    core.on_fetch({b"x": (None, T0 + 62)}, T0 + 4)
    fetch(core, T0 + 5, record(b"x", 3, now=T0 + 5))
    assert core.global_progress.samples_accumulated == 30
    fetch(core, T0 + 6, record(b"b", 3, partners=[b"x"], now=T0 + 6))
    assert core.global_progress.samples_accumulated == 40


def test_a_peer_whose_vouchers_all_left_does_not_count_every_record_again():
    core = with_partner()
    fetch(core, T0 + 1, record(b"b", 3))
    core.on_fetch({b"b": (None, T0 + 62)}, T0 + 2)  # our only partner (and known peer) left
    fetch(core, T0 + 3, *claims(T0 + 3))
    assert core.global_progress.samples_accumulated == 10  # ours alone
    assert core.num_unvouched_peers == len(SYBILS)
    # whoever averages with us next counts again
    core.on_round_partners([b"c"], 3, T0 + 4)
    fetch(core, T0 + 5, record(b"c", 3, now=T0 + 5))
    assert core.global_progress.samples_accumulated == 20


def test_records_list_our_partners_and_older_records_without_the_field_still_parse():
    core = make_core()
    core.report_local_progress(1, 4, T0)
    assert core.local_progress.partners == () and "partners" not in core.local_progress.to_dict()
    core.on_round_partners([b"b", b"c"], 1, T0)
    core.on_round_partners([b"d"], 2, T0)
    assert core.local_progress.partners == (b"d", b"b", b"c")  # most recent round first
    assert core.next_gossip_time(T0) is not None  # published at once
    value = core.local_progress.to_dict()
    assert value["partners"] == [b"d", b"b", b"c"]
    assert _parse_progress(value) == core.local_progress == LocalProgress.from_dict(value)
    old = {k: v for k, v in value.items() if k != "partners"}  # a record of an older version
    assert _parse_progress(old).partners == ()  # type: ignore[union-attr]
    for bad in ([b""], [b"x" * 200], [b"p%d" % i for i in range(MAX_LISTED_PARTNERS + 1)], ["s"]):
        assert _parse_progress({**value, "partners": bad}) is _INVALID
        with pytest.raises((TypeError, ValueError)):
            LocalProgress(b"a", 1, 1, 1.0, T0, False, tuple(bad))
    many = [b"p%03d" % i for i in range(2 * MAX_LISTED_PARTNERS)]
    core.on_round_partners(many, 3, T0)
    assert len(core.local_progress.partners) == MAX_LISTED_PARTNERS


def test_trusted_peers_vote_and_vouch_for_a_peer_without_partners():
    def trusted(key: bytes, epoch: int, now: float = T0) -> LocalProgress:
        return record(key, epoch, 10, partners=[b"b"], now=now)

    sybils_ahead = [record(k, 6, 90, rate=1e6) for k in SYBILS]
    # a newcomer without partners follows the Sybils' quorum...
    core = make_core()
    fetch(core, T0, trusted(b"t", 5), trusted(b"u", 5), record(b"b", 5), *sybils_ahead)
    assert core.global_progress.epoch == 6
    # ... unless it trusts the organisers' peers: they vote, and vouch for their partners
    core = make_core(trusted_peers=[b"t", b"u"])
    fetch(core, T0, trusted(b"t", 5), trusted(b"u", 5), record(b"b", 5), *sybils_ahead)
    assert core.global_progress.epoch == 5 and core.num_unvouched_ahead == len(SYBILS) + 1
    core.update_epoch(5, T0 + 1)
    sybils = [record(k, 5, 90, rate=1e6) for k in SYBILS]
    fetch(core, T0 + 2, trusted(b"t", 5), trusted(b"u", 5), record(b"b", 5), *sybils)
    assert core.global_progress.samples_accumulated == 30  # t, u and b (we have none yet)
    assert not core.ready_to_update_epoch(T0 + 2)
    # one trusted peer ahead is not a quorum with us; both are
    fetch(core, T0 + 3, trusted(b"t", 6, T0 + 3))
    assert core.global_progress.epoch == 5
    fetch(core, T0 + 4, trusted(b"u", 6, T0 + 4))
    assert core.global_progress.epoch == 6
    # at a run's start (no trusted peer has averaged yet) every record counts, as before
    core = make_core(trusted_peers=[b"t"])
    fetch(core, T0, record(b"t", 0, 10), record(b"b", 0, 10))
    assert core.global_progress.samples_accumulated == 20


def test_trusted_peers_are_validated():
    assert ProgressConfig(10, trusted_peers=[b"a", b"a"]).trusted_peers == frozenset({b"a"})
    for bad in (b"a", "a", [b""], ["a"], [1]):
        with pytest.raises(TypeError):
            ProgressConfig(10, trusted_peers=bad)


# ------------------------------------------------------------------ whole swarms in memory


def _run(seed: int, peers: int, group_size: int, epochs: int, **kwargs) -> PartialGroupSim:
    rng = random.Random(seed)
    sim = PartialGroupSim(
        [rng.uniform(0.03, 0.12) for _ in range(peers)], seed=seed, group_size=group_size, **kwargs
    )
    sim.run(epochs, until=1200.0)
    return sim


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("speed", [50.0, 1e6])
@pytest.mark.parametrize("lead", [0, 1])
def test_sybils_claiming_samples_do_not_shorten_an_honest_swarms_epochs(seed, speed, lead):
    """Eight Sybil records (6 honest peers in groups of 3) at the honest peers' epoch (or one
    ahead), claiming the whole target at an honest peer's speed (50 samples/s) or at 1e6
    samples/s, from the first epoch on. Before vouching: epochs of 0.25-0.75x the target
    (median), one step per peer at 1e6 samples/s. Now each epoch ends at the target, exactly as
    in the same swarm without Sybils."""
    attack = {"sybils": 8, "sybil_samples": TARGET, "sybil_speed": speed, "sybil_lead": lead}
    sim = _run(seed, 6, 3, 6, **attack)
    sizes = sim.epoch_sizes(6)
    assert all(TARGET <= size <= TARGET + 6 * SwarmSim.BATCH for size in sizes[1:]), sizes
    assert sizes == _run(seed, 6, 3, 6).epoch_sizes(6)
    assert sim.catch_ups == 0 and sim.max_lead <= 1
    for peer in sim.peers:
        assert peer.progress.num_unvouched_peers == 8
        assert peer.core.statistics().epochs_adopted == 0


@pytest.mark.parametrize("seed", [3])
def test_a_group_that_keeps_to_itself_still_counts_toward_everyones_target(seed):
    """16 peers in groups of 4 for 12 epochs: the four slowest end each epoch last and average
    only among themselves from epoch 5 on (seed 3), so after ``partner_window`` epochs no round
    links them to the others. Vouching by partner lists alone then split the swarm in two
    (epochs of up to 2.4x the target); known peers stay vouched, and the epochs are the same as
    under the old rule (every record counts)."""
    sim = _run(seed, 16, 4, 12)
    sizes = sim.epoch_sizes(12)
    assert all(TARGET <= size <= TARGET + 16 * SwarmSim.BATCH for size in sizes[1:]), sizes
    assert sizes == _run(seed, 16, 4, 12, report_partners=False).epoch_sizes(12)
    clique = [b"peer-3", b"peer-10", b"peer-12", b"peer-13"]
    assert all(sorted(clique) in map(sorted, sim.groups[e]) for e in range(5, 12))
