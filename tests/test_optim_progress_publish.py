"""When a progress core hands out this peer's record (``PublishSchedule``): pure, on a jumping
clock."""

import math

from swarmtrain.optim.progress_publish import PublishSchedule

T0 = 1_000.0
STORE, GOSSIP = 30.0, 0.5


def test_nothing_to_gossip_before_a_change_and_the_first_store_is_due_at_once():
    schedule = PublishSchedule(STORE, GOSSIP)
    assert schedule.next_gossip_time(T0) is None
    assert schedule.next_store_time(T0) == -math.inf  # never stored: due
    assert not schedule.has_published


def test_a_change_is_stored_at_once_then_every_store_period():
    schedule = PublishSchedule(STORE, GOSSIP)
    schedule.on_changed()
    assert schedule.next_store_time(T0) == T0
    assert schedule.take_store(T0, active=True) and schedule.has_published
    assert schedule.next_store_time(T0 + 1) == T0 + STORE
    assert schedule.take_store(T0 + STORE, active=True)  # re-stored: it must not expire


def test_gossip_of_one_epoch_is_paced_and_a_new_epoch_goes_out_at_once():
    schedule = PublishSchedule(STORE, GOSSIP)
    schedule.on_changed()
    assert schedule.next_gossip_time(T0) == T0  # never gossiped
    assert schedule.take_gossip(T0, active=True)
    assert schedule.next_gossip_time(T0 + 0.1) is None  # nothing new
    assert not schedule.take_gossip(T0 + 0.1, active=True)  # an empty turn counts as one
    schedule.on_changed()  # more samples: at most every gossip period
    assert schedule.next_gossip_time(T0 + 0.2) == T0 + 0.1 + GOSSIP
    schedule.on_changed(new_epoch=True)  # a new epoch: at once
    assert schedule.next_gossip_time(T0 + 0.3) == T0 + 0.3
    assert schedule.take_gossip(T0 + 0.3, active=True)
    schedule.on_changed()
    assert schedule.next_gossip_time(T0 + 0.4) == T0 + 0.3 + GOSSIP  # paced again


def test_an_inactive_peer_publishes_nothing_and_its_pending_record_is_dropped():
    schedule = PublishSchedule(STORE, GOSSIP)
    schedule.on_changed(new_epoch=True)
    assert not schedule.take_store(T0, active=False)
    assert not schedule.take_gossip(T0, active=False)
    assert not schedule.has_published
    assert schedule.next_gossip_time(T0) is None
    assert schedule.next_store_time(T0) == T0 + STORE
