"""A stalled peer whose only partner went on follows it and loads its state (real peers).

Two ``Optimizer`` peers train over real DHTs and average: each is the other's only round
partner. One of them stops stepping (its box stalled) while the other goes on alone two
epochs. Before, the stalled peer's own vote held its epoch against the partner's ("two of
two"), so its catch-up never triggered and it trained on alone, away from the swarm's model.
Now its tracker follows the partner once it has been behind for the stall bound, and its
next step loads the partner's state. The rules themselves: tests/test_optim_progress_behind.py.
"""

from __future__ import annotations

import torch
from polling import wait_for
from test_optim_optimizer import FAST, Peer, dhts, in_threads, params_of  # noqa: F401


def test_a_stalled_peer_follows_its_only_partner_and_loads_its_state(dhts):  # noqa: F811
    # FAST's min_stall_time (5 s): the stall bound is that or 3x the peer's last epoch; a short
    # averaging_timeout: the partner's rounds wait that long for the stalled peer
    assert FAST["tracker_opts"]["min_stall_time"] == 5.0
    opts = {"delay_state_averaging": False, "averaging_timeout": 5.0}
    peers = [Peer(dht, i, **opts) for i, dht in enumerate(dhts(2))]
    going, stalled = peers
    try:
        in_threads(*(lambda p=p: p.train_until(2) for p in peers))
        for _ in range(3):  # partners come from a round that averaged (a failed one: alone)
            if all(p.opt.tracker.statistics().live_partners for p in peers):
                break
            target = max(p.opt.local_epoch for p in peers) + 1
            in_threads(*(lambda p=p, t=target: p.train_until(t) for p in peers))
        assert all(p.opt.tracker.statistics().live_partners == 1 for p in peers)
        behind = stalled.opt.local_epoch
        going.train_until(behind + 2)  # its rounds find nobody: it steps alone
        ahead = going.opt.local_epoch
        wait_for(
            lambda: stalled.opt.tracker.global_epoch >= ahead,
            timeout=60,
            what="the stalled peer following its partner",
        )
        assert stalled.opt.tracker.statistics().followed_stalled >= 1
        assert stalled.opt.local_epoch == behind
        stalled.train_until(ahead)  # its first step catches up: it loads the partner's state
        assert stalled.opt.local_epoch == ahead
        assert all(map(torch.equal, params_of(stalled.model), params_of(going.model)))
    finally:
        for peer in peers:
            peer.opt.shutdown()
