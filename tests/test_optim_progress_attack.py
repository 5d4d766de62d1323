"""Lying progress records (security audit 3) against real Optimizer peers over real DHTs.

Two attackers join the run with their own DHT nodes and keys and publish correctly signed
progress records under the run's progress key: one claims epoch 10**9, the other 10**12 samples
in the swarm's current epoch (re-reported as the swarm moves on). Before the fix, the first sent
every honest peer into state downloads at every step (training stopped for good).
"""

from __future__ import annotations

import logging
import threading

from polling import wait_for
from test_optim_optimizer import HOST, TARGET, Peer, dhts, in_threads  # noqa: F401

from swarmtrain.dht import DHT
from swarmtrain.optim import ProgressTracker
from swarmtrain.optim.progress_types import short_peer_id


def test_forged_progress_neither_stops_nor_desyncs_honest_peers(dhts, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="swarmtrain")
    honest = [Peer(dht, i, delay_state_averaging=False) for i, dht in enumerate(dhts(2))]
    liar_dhts: list[DHT] = []
    liars: list[ProgressTracker] = []
    stop = threading.Event()
    try:
        in_threads(*(lambda p=p: p.train_until(2) for p in honest))
        for _ in range(2):  # appended one by one: a failed start still closes the others
            liar_dhts.append(DHT(honest[0].opt.dht.get_visible_maddrs(), **HOST))
        for dht in liar_dhts:
            liars.append(ProgressTracker(dht, "regression", TARGET))
        far_ahead, many_samples = liars
        far_ahead.report_local_progress(10**9, 1)

        def keep_claiming_samples() -> None:
            while not stop.is_set():
                epoch = max(p.opt.local_epoch for p in honest)
                many_samples.report_local_progress(epoch, 10**12)
                stop.wait(0.2)

        claimer = threading.Thread(target=keep_claiming_samples, daemon=True)
        claimer.start()
        wait_for(  # the liars' records reach the honest peers
            lambda: all(len(p.opt.tracker.peers()) >= len(honest) + 1 for p in honest),
            timeout=20,
            what="every honest peer seeing a liar's record",
        )
        seen = {p.opt.global_epoch for p in honest}
        in_threads(*(lambda p=p: p.train_until(6) for p in honest))
        stop.set()
        claimer.join(timeout=5)

        assert all(p.opt.local_epoch == 6 for p in honest)
        assert max(seen) < 10**9 and all(p.opt.global_epoch <= 7 for p in honest)
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "behind the swarm" in m], messages
        for liar_dht in liar_dhts:  # each attacker is named (by the peer id in its record)
            named = short_peer_id(liar_dht.peer_id.to_bytes())
            assert any(named in m and "faulty or malicious" in m for m in messages), messages
        assert all(p.opt.is_synchronized_with_peers() for p in honest)
    finally:
        stop.set()
        for liar in liars:
            liar.shutdown()
        for peer in honest:
            peer.opt.shutdown()
        for liar_dht in liar_dhts:
            liar_dht.shutdown()
