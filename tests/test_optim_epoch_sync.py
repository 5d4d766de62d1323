"""EpochSync: when an Optimizer peer is behind the swarm (pure rule, no network)."""

from __future__ import annotations

import pytest

from swarmtrain.optim._epoch_sync import CatchUpBackoff, EpochSync


def test_a_peer_in_step_or_ahead_never_catches_up():
    sync = EpochSync()
    for epoch in range(5):
        assert not sync.must_catch_up(epoch, epoch)
        assert not sync.must_catch_up(epoch, epoch)
    assert not sync.must_catch_up(7, 5)  # ahead (e.g. it stepped alone): the swarm follows


def test_the_swarm_moving_on_during_this_epoch_is_the_normal_race():
    # we entered epoch 3 with the swarm; it reached the target: we end 3 with its round
    sync = EpochSync()
    assert not sync.must_catch_up(3, 3)
    assert not sync.must_catch_up(3, 4)
    assert not sync.must_catch_up(3, 4)
    assert not sync.must_catch_up(4, 4)  # ended 3 with the swarm: in step


@pytest.mark.parametrize("behind", [2, 3, 10])
def test_two_or_more_epochs_behind_always_catches_up(behind):
    sync = EpochSync()
    assert not sync.must_catch_up(5, 5)
    assert sync.must_catch_up(5, 5 + behind)  # even within an epoch entered in step
    assert EpochSync().must_catch_up(0, behind)  # a newcomer


def test_entering_an_epoch_the_swarm_has_left_catches_up():
    # The review's peer: its round for epoch 11 failed ("the swarm moved past epoch 11"), so it
    # stepped alone into 12 just as the swarm entered 13, and so on for every later epoch.
    sync = EpochSync()
    assert not sync.must_catch_up(11, 11)
    assert not sync.must_catch_up(11, 12)  # the race: the swarm just reached the target
    assert sync.must_catch_up(12, 13)  # entered 12 after the swarm left it: behind
    assert sync.must_catch_up(12, 13)  # until it catches up
    assert not sync.must_catch_up(13, 13)  # caught up (loaded the state, or took the epoch)
    assert not sync.must_catch_up(13, 14)  # then the normal race again


def test_a_newcomer_one_epoch_behind_catches_up():
    assert EpochSync().must_catch_up(0, 1)


def test_the_first_look_decides_for_the_whole_epoch():
    sync = EpochSync()
    assert not sync.must_catch_up(4, 4)
    assert not sync.must_catch_up(4, 5)
    # the epoch went back (load_state_dict of an older checkpoint): a new first look
    assert sync.must_catch_up(3, 5)
    assert sync.must_catch_up(4, 5)  # entered 4 again, after the swarm left it


def test_the_catch_up_back_off_doubles_up_to_its_cap_and_resets():
    backoff = CatchUpBackoff(first=1.0, cap=5.0)
    assert backoff.due(0.0)
    assert [backoff.failed(t) for t in (0.0, 1.0, 3.0, 7.0, 12.0)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert not backoff.due(16.9) and backoff.due(17.0)
    backoff.reset()
    assert backoff.due(0.0) and backoff.failed(20.0) == 1.0
    with pytest.raises(ValueError):
        CatchUpBackoff(first=2.0, cap=1.0)
