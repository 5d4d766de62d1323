"""A peer two or more epochs behind its partners follows them past its own vote.

With a single round partner, "two of two" (the partner and our own vote) kept a peer that
stalled (a loaded box) in its epoch while the swarm went on: records two ahead were ignored as
implausible, the global epoch stayed ours, so the Optimizer's catch-up (``EpochSync``) never
triggered, and the peer trained alone until its partner expired ``partner_window`` epochs
later. Now (``progress_votes``, the "behind" rules) it follows a quorum of its partners two or
more ahead at once when a peer it knows independently of them is there too, or once it has
been behind for ``ProgressCore.stall_bound()``; both need a quorum of every live peer. A lying
partner alone, Sybils alone, or a lying partner with Sybils it vouches for itself do not move
it (the last ones only after the stall bound: docs/security.md).

No network and no clock: every call passes ``now``, and the clock jumps.
"""

from __future__ import annotations

import pytest

from swarmtrain.optim import LocalProgress, ProgressConfig, ProgressCore
from swarmtrain.optim.epoch_core import EpochCore, EpochModes

T0 = 1_000_000.0
TARGET = 100
EPOCH = 10.0  #: an honest epoch: four peers at 2.5 samples/s each
RATE = TARGET / EPOCH / 4
SYBILS = [f"sybil-{i}".encode() for i in range(10)]
HONEST = [b"a", b"b", b"c"]  #: ``a`` is our only round partner


def make_core(**settings) -> ProgressCore:
    config = ProgressConfig(target_batch_size=TARGET, **settings)
    return ProgressCore(config, peer_id=b"me", client_mode=False, now=T0 - 20)


def record(
    peer: bytes, epoch: int, samples: int = 0, *, partners=(), now: float = T0, rate: float = RATE
) -> LocalProgress:
    return LocalProgress(peer, epoch, samples, rate, now, False, tuple(partners))


def fetch(core: ProgressCore, now: float, *records: LocalProgress) -> int:
    return core.on_fetch({r.peer_id: (r, now + 60) for r in records}, now).epoch


def trained_at(epoch: int) -> ProgressCore:
    """The issue's repro core: at ``epoch``, trained (it votes), at 1 sample/s."""
    core = make_core()
    core.report_local_progress(epoch, 10, T0)
    return core


def honest_swarm(now: float, start: float = T0, epoch: int = 3) -> list[LocalProgress]:
    """``a``, ``b``, ``c`` in step: in ``epoch`` from ``start``, one epoch per ``EPOCH`` s;
    ``a`` averaged with us and with ``b``, ``b`` and ``c`` with each other."""
    done = int((now - start) // EPOCH)
    samples = int(RATE * (now - start - done * EPOCH))
    lists = {b"a": [b"me", b"b"], b"b": [b"a", b"c"], b"c": [b"b"]}
    return [record(key, epoch + done, samples, partners=lists[key], now=now) for key in HONEST]


def in_step_at_3(*, seen_first: bool) -> ProgressCore:
    """A peer that entered epoch 3 at ``T0`` with the swarm (its epoch 2 lasted ``EPOCH``), its
    last round with ``a`` alone. ``seen_first``: it saw ``b`` and ``c`` at its first look,
    before it had partners (known independently of ``a``); else it knows ``b`` only from
    ``a``'s partner list, and ``c`` not at all."""
    core = make_core()
    core.report_local_progress(2, 10, T0 - EPOCH)
    if seen_first:
        swarm = honest_swarm(T0 - EPOCH + 1, start=T0 - EPOCH, epoch=2)
        assert fetch(core, T0 - EPOCH + 1, *swarm) == 2
    core.on_round_partners([b"a"], 2, T0 - 1)
    core.update_epoch(3, T0)
    core.report_local_progress(3, 5, T0 + 2)
    assert fetch(core, T0 + 2, *honest_swarm(T0 + 2)) == 3
    assert core.num_live_partners == 1
    return core


# ------------------------------------------------------------------ the repro


def test_the_repro_is_followed_once_the_epoch_stalls_and_not_before():
    core = trained_at(3)
    core.on_round_partners([b"a"], 3, T0)
    # a partner and a record we never saw before: as far as this peer can tell, a partner and a
    # Sybil; it cannot follow them at once (that would hand every lone liar the same power)
    assert fetch(core, T0 + 1, record(b"a", 5), record(b"b", 5)) == 3
    # its epoch: 90 samples to go at 0.5 samples/s (its first ETA, alone): stalled after 3x
    assert core.epoch_duration() == 180
    bound = core.stall_bound()
    assert bound == 3 * 180
    assert fetch(core, T0 + bound - 1, record(b"a", 5), record(b"b", 5)) == 3
    # behind for the stall bound: it follows, and its Optimizer catches up (EpochSync)
    assert fetch(core, T0 + bound, record(b"a", 5), record(b"b", 5)) == 5
    assert core.num_followed_stalled == 1 and core.num_followed_seconded == 0
    epochs = EpochCore(EpochModes())
    assert epochs.is_behind(3, core.global_progress.epoch)


def test_the_repro_is_followed_at_once_when_the_other_peer_was_known_before():
    core = trained_at(3)
    assert fetch(core, T0, record(b"a", 3), record(b"b", 3)) == 3  # our first look: no partners
    core.on_round_partners([b"a"], 3, T0)
    # two epochs ahead one second after it entered an epoch of 180 s is not plausible yet...
    assert fetch(core, T0 + 1, record(b"a", 5), record(b"b", 5)) == 3
    assert core.plausible_lead(1.0) == 1 and core.plausible_lead(30.0) == 2
    # ... after 30 s it is (a swarm up to max_rate_factor times faster than its estimate)
    assert fetch(core, T0 + 30, record(b"a", 5), record(b"b", 5)) == 5
    assert core.num_followed_seconded == 1
    assert EpochCore(EpochModes()).is_behind(3, core.global_progress.epoch)


# ------------------------------------------------------------------ a stalled peer


@pytest.mark.parametrize("lead", [2, 5])
@pytest.mark.parametrize("seen_first", [True, False], ids=["known", "listed-by-partner"])
def test_a_stalled_single_partner_peer_follows_the_swarm(lead, seen_first):
    core = in_step_at_3(seen_first=seen_first)
    epochs = EpochCore(EpochModes())
    assert not epochs.is_behind(3, core.global_progress.epoch)  # the first look at epoch 3
    bound = core.stall_bound()
    assert bound == 3 * EPOCH  # stall_factor times its last epoch (above min_stall_time)
    # the box stalls: no report, no fetch, while the swarm goes on `lead` epochs
    resumed = T0 + lead * EPOCH + EPOCH / 2
    assert honest_swarm(resumed)[0].epoch == 3 + lead
    # seen first: b and c second a at once; else (only a vouches for them) it waits until it
    # has been behind for the stall bound: since its last look in step (T0 + 2; the stall counts)
    followed_at = resumed if seen_first else max(resumed, T0 + 2 + bound)
    now = resumed
    while now < followed_at:
        assert fetch(core, now, *honest_swarm(now)) == 3
        now += 1.0
    swarm = honest_swarm(followed_at)
    swarm_epoch = swarm[0].epoch
    assert fetch(core, followed_at, *swarm) == swarm_epoch >= 3 + lead
    assert (core.num_followed_seconded, core.num_followed_stalled) == (
        (1, 0) if seen_first else (0, 1)
    )
    # the Optimizer catches up: it loads the state of the swarm's epoch and is in step again
    assert epochs.is_behind(3, swarm_epoch)
    enter = epochs.after_load(swarm_epoch, swarm_epoch)
    core.update_epoch(enter.epoch, followed_at + 1)
    core.on_round_partners([b"a", b"b"], enter.epoch, followed_at + 2)
    assert fetch(core, followed_at + 2, *honest_swarm(followed_at + 2)) == swarm_epoch
    assert not epochs.is_behind(enter.epoch, core.global_progress.epoch)


def at(epoch: int, now: float) -> list[LocalProgress]:
    """The honest peers in ``epoch`` (a swarm that stays there for this test)."""
    lists = {b"a": [b"me", b"b"], b"b": [b"a", b"c"], b"c": [b"b"]}
    return [record(key, epoch, 10, partners=lists[key], now=now) for key in HONEST]


@pytest.mark.parametrize("stepped_at", [26.0, 40.0], ids=["before-the-bound", "after-the-bound"])
def test_stepping_alone_from_two_behind_keeps_the_clock_and_the_bound(stepped_at):
    # the flake of test_late_joiner_loads_state_and_catches_up: the peer's round of epoch 3
    # waited long while the swarm went two ahead; it then stepped alone, one behind
    core = in_step_at_3(seen_first=False)
    bound = core.stall_bound()
    epochs = EpochCore(EpochModes())
    assert not epochs.is_behind(3, core.global_progress.epoch)
    assert fetch(core, T0 + 25, *at(5, T0 + 25)) == 3  # b is vouched for by a alone: no witness
    core.update_epoch(4, T0 + stepped_at)  # its own round failed: it steps alone
    # an epoch stepped alone while behind is no measure of the swarm's epochs
    assert core.epoch_duration() == EPOCH and core.stall_bound() == bound
    first_look = core.global_progress.epoch
    if T0 + stepped_at < T0 + 2 + bound:  # behind since its last look in step (T0 + 2)
        assert first_look == 4
        assert not epochs.is_behind(4, first_look)
        now = T0 + 2 + bound
        assert fetch(core, now, *at(5, now)) == 5  # one ahead, on the same clock: it follows
        plan = epochs.on_progress(4, core.global_progress, now)
        assert plan.end_epoch  # and ends its epoch at once (its round gives up: peers moved on)
    else:  # its first look at epoch 4 sees the swarm past it: it loads the state
        assert first_look == 5
        assert epochs.is_behind(4, first_look)
    assert core.num_followed_stalled == 1


def test_a_lead_must_be_plausible_for_the_time_since_we_entered_our_epoch():
    # epochs of 10 s, max_rate_factor 8: 1.25 s per epoch at the most (a swarm that grew)
    core = in_step_at_3(seen_first=True)
    assert [core.plausible_lead(t) for t in (0.0, 1.0, 1.25, 10.0)] == [1, 1, 2, 9]
    now = T0 + 3  # the swarm claims 30 epochs ahead after 3 s: followed as far as plausible
    swarm = [record(k, 33, partners=[b"a", b"b", b"c"], now=now) for k in HONEST]
    assert fetch(core, now, *swarm) == 3 + core.plausible_lead(3.0) == 6
    # (records beyond our epoch + 1 are ignored as before: they count when it looks again)


# ------------------------------------------------------------------ attacks


def liar_and_sybils(epoch: int, now: float, sybils: int) -> list[LocalProgress]:
    """Our partner ``a`` claims ``epoch`` and vouches for ``sybils`` identities claiming it too
    (they list each other: partner lists are signed by whoever writes them, so free)."""
    keys = SYBILS[:sybils]
    return [
        record(b"a", epoch, partners=[b"me", *keys], now=now),
        *(record(k, epoch, partners=[b"a", *keys], now=now) for k in keys),
    ]


def at_our_epoch(now: float) -> list[LocalProgress]:
    """The honest peers ``b`` and ``c``, still in our epoch (a slow swarm)."""
    return [record(k, 3, 10, partners=[b"b", b"c"], now=now) for k in (b"b", b"c")]


@pytest.mark.parametrize("claim", [5, 8, 10**6])
@pytest.mark.parametrize("seen_first", [True, False], ids=["known", "listed-by-partner"])
def test_a_lying_partner_alone_never_moves_a_peer(claim, seen_first):
    core = in_step_at_3(seen_first=seen_first)
    for now in (T0 + 3, T0 + core.stall_bound(), T0 + 10 * core.stall_bound()):
        assert fetch(core, now, *liar_and_sybils(claim, now, 0), *at_our_epoch(now)) == 3
    assert core.num_followed_seconded == core.num_followed_stalled == 0


@pytest.mark.parametrize("claim", [5, 8, 10**6])
def test_sybils_alone_never_move_a_peer_with_a_partner(claim):
    core = in_step_at_3(seen_first=True)
    for now in (T0 + 3, T0 + core.stall_bound(), T0 + 10 * core.stall_bound()):
        sybils = [record(k, claim, partners=SYBILS, now=now) for k in SYBILS]
        honest = [record(b"a", 3, 10, partners=[b"me"], now=now), *at_our_epoch(now)]
        assert fetch(core, now, *honest, *sybils) == 3
    assert core.num_followed_seconded == core.num_followed_stalled == 0


@pytest.mark.parametrize("claim", [5, 8, 10**6])
@pytest.mark.parametrize("seen_first", [True, False], ids=["known", "listed-by-partner"])
def test_a_lying_partner_with_sybils_moves_a_peer_only_after_the_stall_bound(claim, seen_first):
    core = in_step_at_3(seen_first=seen_first)
    bound = core.stall_bound()
    in_step = T0 + 2  # its last look in step: the claims arrive after it
    # its own Sybils are no witnesses (only it vouches for them), even outnumbering b and c
    for now in (T0 + 3, in_step + bound / 2, in_step + bound - 0.5):
        assert fetch(core, now, *liar_and_sybils(claim, now, 10), *at_our_epoch(now)) == 3
    assert core.num_followed_seconded == 0
    # the documented bound: once it has been behind for the stall bound, a quorum of every peer
    # but it (the liar and 10 Sybils of 13) with a partner among it moves it, at most as far as
    # the time since it entered its epoch makes plausible
    now = in_step + bound
    moved = fetch(core, now, *liar_and_sybils(claim, now, 10), *at_our_epoch(now))
    assert moved == min(claim, 3 + core.plausible_lead(now - T0))
    assert core.num_followed_stalled == 1
    # with the honest peers in the majority, not even then
    core = in_step_at_3(seen_first=seen_first)
    now = T0 + 10 * bound
    honest = [record(k, 3, 10, now=now) for k in (b"b", b"c", b"d", b"e", b"f", b"g")]
    assert fetch(core, now, *liar_and_sybils(claim, now, 5), *honest) == 3


def test_a_witness_must_be_known_through_someone_else_than_the_partners_it_seconds():
    core = in_step_at_3(seen_first=False)
    # b is known only through a's list: it cannot second a (a liar lists its own Sybils)
    now = T0 + 3
    swarm = [record(k, 5, partners=[b"a", b"b", b"c"], now=now) for k in HONEST]
    assert fetch(core, now, *swarm) == 3
    # a peer that was our partner in an earlier round, outside the window, is its own witness
    core = make_core()
    core.report_local_progress(0, 10, T0 - 19)
    core.on_round_partners([b"c"], 0, T0 - 19)
    assert fetch(core, T0 - 19, record(b"c", 0, now=T0 - 19)) == 0
    for epoch in range(1, 6):  # five epochs of 3 s, the last rounds with a alone
        core.on_round_partners([b"a"], epoch - 1, T0 - 19 + 3 * epoch - 1)
        core.update_epoch(epoch, T0 - 19 + 3 * epoch)
    assert core.num_live_partners == 0  # c's round was more than partner_window epochs ago
    now = T0 + 6
    assert fetch(core, now, *[record(k, 7, partners=[b"me"], now=now) for k in (b"a", b"c")]) == 7
    assert core.num_followed_seconded == 1
