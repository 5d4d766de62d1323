"""How many peers a gradient round expects (``_epoch_sync.expected_round_size``), and what that
does to a round in the matchmaking core's simulated swarm (no sockets).

The first round has no group size to go by, and the trackers' counts still grow at start-up.
The epoch-0 miss behind NATs: the leader, expecting nobody, assembled its group of two at its
expiration, 0.1 s before the third peer's request arrived. Expecting the count seen would let a
leader assemble early on a count that is still low. One more than the peers seen does neither.
"""

from __future__ import annotations

import pytest
from test_averaging_matchmaking_core import _unseen_peer_swarm, pid

from swarmtrain.optim._epoch_sync import expected_round_size


def test_after_a_round_succeeded_the_count_or_the_last_group():
    assert expected_round_size(3, 3) == 3
    assert expected_round_size(2, 3) == 3  # an auxiliary peer publishes no progress
    assert expected_round_size(4, 3, 0, [0, 0, 0]) == 4


def test_the_first_round_expects_one_more_than_the_peers_seen_in_its_epoch():
    assert expected_round_size(3, 0) == 4
    assert expected_round_size(3, 0, 0, [0, 0]) == 4
    # a peer in another epoch is not in this round
    assert expected_round_size(3, 0, 0, [0, 1]) == 3
    # nobody else in this epoch, or nobody at all: no expectation
    assert expected_round_size(3, 0, 0, [1, 1]) is None
    assert expected_round_size(1, 0) is None
    assert expected_round_size(1, 0, 0, []) is None


def _first_round(tracker_counts: int | None) -> set[bytes]:
    """Three peers; the leader's declaration reaches the others late (the NAT run's epoch 0);
    each peer's tracker sees ``tracker_counts`` peers (None: no expectation, the rule before)."""
    expected = None if tracker_counts is None else expected_round_size(tracker_counts, 0)
    swarm = _unseen_peer_swarm(expected=expected, latency=0.5, read_delay=1.0)
    swarm.run()
    groups = swarm.check_consistent()
    return {peer for group in groups if group.size == 3 for peer in group.peer_ids}


def test_without_an_expectation_the_first_round_leaves_the_late_peer_out():
    assert _first_round(None) == set()


@pytest.mark.parametrize("seen", [2, 3], ids=["count-still-growing", "all-seen"])
def test_the_first_round_waits_for_the_late_peer(seen):
    assert _first_round(seen) == {pid(0), pid(1), pid(2)}


def test_expecting_exactly_a_low_count_would_leave_the_late_peer_out():
    """Why not the count itself: with two of three seen, a leader would assemble at once."""
    swarm = _unseen_peer_swarm(expected=2, latency=0.5, read_delay=1.0)
    swarm.run()
    assert all(group.size < 3 for group in swarm.check_consistent())
