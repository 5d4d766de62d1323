"""When the progress core fetches the DHT: a slow read does not hold the next one back.

Pure, on a jumping clock: first the schedule alone (``FetchSchedule``, ``fetch_period``), then
the core driven as the tracker's fetch loop drives it (``fetch_due``, ``on_fetch_started``,
``on_fetch`` when the read ends), against a DHT whose reads take the times a test gives and
return what was stored when they began. Measured behind NATs at load ~20
(docs/reliability.md, "The tracker's epoch over relays"): progress reads took 0.1-0.5 s
mostly, 4-14 s now and then; a tracker that waited for each read before it began the next saw
a record stored during a slow read only after that read, then a period, then another read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from swarmtrain.optim import LocalProgress, ProgressConfig, ProgressCore
from swarmtrain.optim.progress_core import MAX_FETCHES_IN_FLIGHT
from swarmtrain.optim.progress_fetch_schedule import FetchSchedule, fetch_period

T0 = 1_000_000.0
TARGET = 100
PERIOD = 0.5  # min_refresh_period: the swarm is at its target, so the period is the shortest


# ---------------------------------------------------------------- the schedule alone


def test_the_first_fetch_is_due_at_creation_and_each_start_gets_a_new_number():
    schedule = FetchSchedule(T0)
    assert schedule.due(T0) and not schedule.due(T0 - 0.1)
    assert schedule.last_end is None and schedule.in_flight == 0
    assert schedule.no_result_since(T0 - 100)
    first, second = schedule.start(T0), schedule.start(T0)
    assert first != second and schedule.running(first) and schedule.running(second)


def test_a_start_or_a_result_puts_the_next_fetch_a_period_later():
    schedule = FetchSchedule(T0)
    number = schedule.start(T0)
    assert schedule.reschedule(T0, PERIOD, started=True) == T0 + PERIOD
    assert not schedule.due(T0 + PERIOD - 0.01) and schedule.due(T0 + PERIOD)
    schedule.end(number, T0 + 0.3)
    assert schedule.last_end == T0 + 0.3 and schedule.in_flight == 0
    assert schedule.reschedule(T0 + 0.3, PERIOD, fetched=True) == T0 + 0.3 + PERIOD


def test_other_events_only_bring_the_next_fetch_earlier_never_before_the_last_plus_a_period():
    schedule = FetchSchedule(T0)
    schedule.end(schedule.start(T0), T0 + 0.4)
    schedule.reschedule(T0 + 0.4, 3.0, fetched=True)
    assert schedule.next_time == T0 + 3.4
    # a shorter period (more peers, a nearer ETA): earlier, from the last fetch's end
    assert schedule.reschedule(T0 + 0.5, PERIOD) == T0 + 0.4 + PERIOD
    # a longer one never postpones it
    assert schedule.reschedule(T0 + 0.6, 10.0) == T0 + 0.4 + PERIOD
    # a fetch still out anchors the period at its start when that is later than the last end
    schedule.start(T0 + 1.0)
    schedule.next_time = T0 + 9.0
    assert schedule.reschedule(T0 + 1.1, PERIOD) == T0 + 1.0 + PERIOD


def test_at_most_max_fetches_run_beside_a_slow_read_and_an_end_frees_a_slot():
    schedule, now = FetchSchedule(T0), T0
    numbers = []
    for _ in range(MAX_FETCHES_IN_FLIGHT):
        now = max(now, schedule.next_time)
        assert schedule.due(now)
        numbers.append(schedule.start(now))
        schedule.reschedule(now, PERIOD, started=True)  # the first read is slow: still out
    assert numbers and schedule.in_flight == MAX_FETCHES_IN_FLIGHT
    assert schedule.next_start(now + 100) == float("inf") and not schedule.due(now + 100)
    schedule.fail(numbers[0], now + 1)
    assert schedule.in_flight == MAX_FETCHES_IN_FLIGHT - 1
    assert not schedule.running(numbers[0]) and schedule.running(numbers[1])
    assert schedule.next_start(now + 1) == schedule.next_time < float("inf")


def test_a_result_makes_the_fetches_begun_before_it_obsolete_and_keeps_the_later_ones():
    schedule = FetchSchedule(T0)
    slow, fast, later = schedule.start(T0), schedule.start(T0 + 3.0), schedule.start(T0 + 3.1)
    schedule.end(fast, T0 + 3.2)
    assert not schedule.running(slow)  # it would bring an older view: stop it
    assert schedule.running(later) and schedule.in_flight == 1
    assert not schedule.no_result_since(T0 + 3.0) and schedule.no_result_since(T0 + 3.05)
    schedule.end(slow, T0 + 6.0)  # an obsolete result that came anyway
    assert schedule.in_flight == 1 and schedule.last_end == T0 + 6.0
    assert not schedule.no_result_since(T0 + 3.0)  # it says nothing about when it began
    schedule.end(None, T0 + 7.0)  # a fetch the caller did not number: begun at its end
    assert not schedule.no_result_since(T0 + 7.0) and schedule.running(later)


def test_a_failure_counts_as_an_answer_and_the_retry_time_is_the_callers():
    schedule = FetchSchedule(T0)
    number = schedule.start(T0)
    schedule.fail(number, T0 + 2.0)
    assert schedule.in_flight == 0 and schedule.last_end == T0 + 2.0
    assert not schedule.no_result_since(T0 + 2.0)
    retry = T0 + 5.0
    assert schedule.reschedule(T0 + 2.0, PERIOD, at=retry) == retry
    # later events keep it, but may not bring it before the failure plus the period
    assert schedule.reschedule(T0 + 2.1, PERIOD) == T0 + 2.0 + PERIOD


def test_alone_at_the_target_a_fetch_is_due_at_once_unless_one_began_since():
    schedule = FetchSchedule(T0)
    schedule.end(schedule.start(T0), T0 + 0.1)
    schedule.reschedule(T0 + 0.1, 3.0, fetched=True)
    before = schedule.start(T0 + 0.2)  # begun before this peer reached its target
    schedule.reschedule(T0 + 0.2, 3.0, started=True)
    alone_since = T0 + 0.3
    assert schedule.reschedule(T0 + 0.3, 3.0, confirm_since=alone_since) == T0 + 0.3
    after = schedule.start(T0 + 0.3)
    assert schedule.reschedule(T0 + 0.3, 3.0, started=True, confirm_since=alone_since) == (
        T0 + 3.3
    )  # one began since: no other at once
    assert schedule.reschedule(T0 + 0.4, 3.0, confirm_since=alone_since) == T0 + 3.3
    schedule.end(before, T0 + 0.5)
    assert schedule.no_result_since(alone_since)  # it ended after, but began before
    schedule.end(after, T0 + 0.6)
    assert not schedule.no_result_since(alone_since)


def test_the_period_is_the_share_of_the_eta_left_before_more_peers_may_join():
    config = ProgressConfig(target_batch_size=TARGET)
    assert fetch_period(config, 100.0, 1, alone=True) == config.default_refresh_period
    # eta * n / max(n + drift_peers, n * (1 + drift_rate)): 20 * 2 / max(5, 2.4)
    assert fetch_period(config, 20.0, 2, alone=False) == pytest.approx(8.0)
    assert fetch_period(config, 10.0, 20, alone=False) == pytest.approx(200 / 24)
    drifty = ProgressConfig(target_batch_size=TARGET, expected_drift_peers=18.0)
    assert fetch_period(drifty, 20.0, 2, alone=False) == pytest.approx(2.0)  # sooner
    assert fetch_period(config, 1e9, 5, alone=False) == config.max_refresh_period
    assert fetch_period(config, 0.0, 5, alone=False) == config.min_refresh_period


def test_a_slow_read_gets_company_a_period_after_it_began():
    schedule, now = FetchSchedule(T0), T0
    slow = schedule.start(now)
    schedule.reschedule(now, PERIOD, started=True)
    now += PERIOD
    assert schedule.due(now)  # the slow read is still out: the next one starts beside it
    fast = schedule.start(now)
    schedule.reschedule(now, PERIOD, started=True)
    schedule.end(fast, now + 0.2)
    schedule.reschedule(now + 0.2, PERIOD, fetched=True)
    assert not schedule.running(slow)  # obsolete: the tracker cancels it
    assert schedule.next_time == pytest.approx(now + 0.2 + PERIOD)


# ------------------------------------------------------ the core, as the tracker drives it


def _record(epoch: int, samples: int, time: float) -> LocalProgress:
    return LocalProgress(b"peer", epoch, samples, 10.0, time, False)


class SlowDHT:
    """The progress key's content over time; a read returns what was stored when it began."""

    def __init__(self, changes: list[tuple[float, LocalProgress]]):
        self.changes = sorted(changes, key=lambda change: change[0])

    def read(self, started: float) -> dict[bytes, tuple[LocalProgress, float]]:
        stored = [record for at, record in self.changes if at <= started]
        return {stored[-1].peer_id: (stored[-1], started + 60.0)} if stored else {}


def run_fetches(
    core: ProgressCore,
    dht: SlowDHT,
    read_times: Iterator[float],
    until: float,
    *,
    sequential: bool = False,
) -> list[tuple[float, float]]:
    """Drive ``core``'s fetches on a jumping clock until ``until``; returns (start, end) of
    each fetch. ``sequential``: begin a fetch only when none is out (the tracker before)."""
    now, running, done = T0 + 0.1, [], []  # running: (end, start, number)
    while now <= until:
        may_start = not (sequential and running)
        if may_start and core.fetch_due(now):
            running.append((now + next(read_times), now, core.on_fetch_started(now)))
            continue
        next_start = core.next_fetch_start(now) if may_start else float("inf")
        now = min([next_start] + [end for end, _, _ in running])
        for fetch in sorted(running):
            end, start, number = fetch
            if fetch not in running or end > now:
                continue
            running.remove(fetch)
            core.on_fetch(dht.read(start), end, number)
            done.append((start, end))
            # the fetches begun before it are obsolete: the tracker cancels them
            running = [f for f in running if core.fetch_running(f[2])]
    return done


def seen_at(core_factory, read_times, stored_at, **kwargs) -> float:
    """When the core first holds the peer's epoch 1, stored at ``stored_at``."""
    dht = SlowDHT([(T0 - 1, _record(0, TARGET, T0 - 1)), (stored_at, _record(1, 0, stored_at))])
    core = core_factory()
    first = core.on_fetch_started(T0)  # a first read (fast) shows the peer at the target
    core.on_fetch(dht.read(T0), T0 + 0.1, first)
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + PERIOD)
    for start, end in run_fetches(core, dht, read_times, stored_at + 10, **kwargs):
        if start >= stored_at:
            return end
    raise AssertionError("never seen")


def make_core() -> ProgressCore:
    config = ProgressConfig(target_batch_size=TARGET, min_refresh_period=PERIOD)
    return ProgressCore(config, peer_id=b"me", client_mode=False, now=T0)


def test_a_record_stored_during_a_slow_read_is_seen_a_period_and_a_fast_read_later():
    stored_at, fast = T0 + 0.6, 0.2
    reads = [5.0] + [fast] * 100  # the read begun at T0 + 0.5 is stuck on a slow node
    now = seen_at(make_core, iter(reads), stored_at)
    assert now - stored_at <= PERIOD + fast + 1e-9  # the next fetch began beside it
    before = seen_at(make_core, iter(reads), stored_at, sequential=True)
    assert before - stored_at >= 5.0 - 0.1  # one read at a time: behind the slow one


@pytest.mark.parametrize("slow_every", [2, 3, 5])
def test_with_slow_reads_now_and_then_every_change_is_seen_within_a_bound(slow_every):
    """Every ``slow_every``-th read takes 5 s, the others 0.2 s; changes stored at many
    phases are seen within two periods and two fast reads (a fast read, a period, a slow read
    and, a period after it began, a fast one beside it)."""
    for offset in [0.05 * i for i in range(40)]:
        reads = itertools.cycle([5.0] + [0.2] * (slow_every - 1))
        stored_at = T0 + 1.0 + offset
        delay = seen_at(make_core, reads, stored_at) - stored_at
        assert delay <= 2 * PERIOD + 2 * 0.2 + 1e-9, (offset, delay)


def test_at_most_max_fetches_run_at_once_and_an_end_frees_a_slot():
    core = make_core()
    now, numbers = T0, []
    for _ in range(MAX_FETCHES_IN_FLIGHT):
        now = max(now, core.global_progress.next_fetch_time)
        assert core.fetch_due(now)
        numbers.append(core.on_fetch_started(now))
    assert core.fetches_in_flight == MAX_FETCHES_IN_FLIGHT
    assert not core.fetch_due(now + 100) and core.next_fetch_start(now) == float("inf")
    core.on_fetch_failed(now + 1, numbers[0])
    assert core.fetches_in_flight == MAX_FETCHES_IN_FLIGHT - 1
    assert core.fetch_running(numbers[1]) and not core.fetch_running(numbers[0])
    assert core.next_fetch_start(now + 1) < float("inf")


def test_a_fetch_that_ends_makes_the_ones_begun_before_it_obsolete():
    core = make_core()
    slow = core.on_fetch_started(T0)
    fast = core.on_fetch_started(T0 + 3.0)
    later = core.on_fetch_started(T0 + 3.1)
    core.on_fetch({}, T0 + 3.2, fast)
    assert not core.fetch_running(slow)  # stop it: it would bring an older view
    assert core.fetch_running(later)  # begun after: it may bring a newer one
    assert core.fetches_in_flight == 1
    core.on_fetch({}, T0 + 6.0, slow)  # a result that came anyway merges, harmlessly
    assert core.fetches_in_flight == 1


def test_fast_reads_run_one_at_a_time_a_period_apart_and_a_slow_one_gets_company():
    core = make_core()
    number = core.on_fetch_started(T0)
    core.on_fetch({b"peer": (_record(0, TARGET, T0), T0 + 60)}, T0 + 0.4, number)
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 0.4 + PERIOD)
    # gossip never brings the next fetch before the last fetch plus the period
    core.on_gossip(b"peer", _record(0, TARGET, T0 + 0.45), T0 + 60.5, T0 + 0.45)
    assert core.global_progress.next_fetch_time == pytest.approx(T0 + 0.4 + PERIOD)
    core.on_fetch_started(T0 + 0.9)  # slow: still out a period later
    assert core.fetch_due(T0 + 0.9 + PERIOD)


def test_a_failed_fetch_is_retried_after_the_default_period_whatever_gossip_says():
    core = make_core()
    number = core.on_fetch_started(T0)
    core.on_fetch_failed(T0 + 2.0, number)
    retry = T0 + 2.0 + core.config.default_refresh_period
    assert core.global_progress.next_fetch_time == pytest.approx(retry)
    core.on_gossip(b"peer", _record(0, 10, T0 + 2.1), T0 + 62, T0 + 2.1)
    assert core.global_progress.next_fetch_time >= T0 + 2.0 + PERIOD


def test_alone_at_the_target_one_fetch_begun_after_it_confirms():
    core = make_core()
    core.on_fetch({}, T0 + 0.1, core.on_fetch_started(T0))  # nobody else
    before = core.on_fetch_started(T0 + 0.2)  # a fetch begun before we reached the target...
    core.report_local_progress(0, TARGET, T0 + 0.3)
    assert core.global_progress.confirming_alone
    assert core.fetch_due(T0 + 0.3)  # ...does not confirm: another one at once
    after = core.on_fetch_started(T0 + 0.3)
    assert not core.fetch_due(T0 + 0.3)  # only one: the next waits for a result
    core.on_fetch({}, T0 + 0.5, before)
    assert core.global_progress.confirming_alone  # it ended after, but began before
    core.on_fetch({}, T0 + 0.6, after)
    assert not core.global_progress.confirming_alone
    assert core.ready_to_update_epoch(T0 + 0.6)
