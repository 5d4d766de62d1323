"""``RunPresence``: who is in a DiLoCo run; a donor that died without saying goodbye (SIGKILL,
a lost host) is not counted as present once a dial to it failed; records are owned per peer
(issue 17.3): an outsider cannot mark a peer gone or wipe the run.

Real DHTs over loopback. The dead donor stored its presence record and left without its goodbye
record; its port then drops every SYN (a host gone from the network: each dial hangs).
"""

from __future__ import annotations

import re
import time

from polling import wait_for
from test_averaging_dead_donors import silent_port

from swarmtrain.dht import DHT, PeerRecordValidator, get_dht_time
from swarmtrain.optim.diloco_peers import PRESENCE_KEY_PATTERN, RunPresence, presence_key
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


def test_a_dead_donor_is_not_present_after_one_failed_dial():
    bootstrap = DHT(**HOST)
    maddrs = bootstrap.get_visible_maddrs()
    live_dht, ghost_dht, observer_dht = (DHT(maddrs, **HOST) for _ in range(3))
    live = RunPresence(live_dht, "presence_run", donor=True)
    ghost = RunPresence(ghost_dht, "presence_run", donor=True)
    observer = RunPresence(observer_dht, "presence_run", donor=True, probe_timeout=2.0)
    traps = []
    try:
        live.start()
        ghost.start()
        ghost._stop.set()  # killed: no refresh, and no goodbye record
        ghost._thread.join(10)
        ghost_id = ghost_dht.peer_id
        ghost_addrs = [re.sub(r"/p2p/.*$", "", str(a)) for a in ghost_dht.get_visible_maddrs()]
        ghost_dht.shutdown()
        for addr in ghost_addrs:
            traps += silent_port(int(re.search(r"/tcp/(\d+)", addr).group(1)))

        async def learn(dht, node):  # as the DHT taught it while the ghost lived
            dht.p2p.add_addrs(ghost_id, ghost_addrs)

        observer_dht.run_coroutine(learn)
        observer.start()
        started = time.monotonic()
        present = {p.peer_id for p in observer.others()}
        took = time.monotonic() - started
        assert present == {live_dht.peer_id.to_bytes()}, present  # before: the ghost too
        assert took < 2.0 + 3.0, took  # probe_timeout, and the DHT read
        assert {p.peer_id for p in observer.others()} == present  # remembered: no new dial
    finally:
        for sock in traps:
            sock.close()
        for presence in (observer, live):
            presence.stop()
        for dht in (observer_dht, live_dht, bootstrap):
            dht.shutdown()


def test_an_outsider_cannot_mark_a_peer_gone_or_wipe_the_run():
    first = DHT([], **HOST)
    initial = first.get_visible_maddrs()
    second, evil = DHT(initial, **HOST), DHT(initial, **HOST)
    presences = [RunPresence(dht, "run", donor=True) for dht in (first, second)]
    try:
        for presence in presences:
            presence.start()
        key, target = presence_key("run"), first.peer_id.to_bytes()
        assert [p.peer_id for p in presences[1].others()] == [target]

        # "first left" under first's subkey, and a plain value over everyone, "forever"
        far = get_dht_time() + 10**9
        evil.add_validators([PeerRecordValidator([PRESENCE_KEY_PATTERN])])
        assert not evil.store(key, None, far, subkey=target)
        assert not evil.store(key, "gone", far)

        assert [p.peer_id for p in presences[1].others()] == [target]
        assert [p.peer_id for p in presences[0].others()] == [second.peer_id.to_bytes()]
    finally:
        for presence in presences:
            presence.stop()
        for dht in (evil, second, first):
            dht.shutdown()
    assert BackgroundRuntime.active_references() == 0


def test_a_declared_step_reaches_the_other_peers():
    first = DHT([], **HOST)
    second = DHT(first.get_visible_maddrs(), **HOST)
    presences = [RunPresence(dht, "run", donor=True) for dht in (first, second)]
    try:
        for presence in presences:
            presence.start()
        assert [p.step for p in presences[1].others()] == [None]  # no round started yet
        presences[0].declare_step(42)  # stored in the background
        wait_for(lambda: [p.step for p in presences[1].others()] == [42], 10, "step 42")
    finally:
        for presence in presences:
            presence.stop()
        for dht in (second, first):
            dht.shutdown()
    assert BackgroundRuntime.active_references() == 0
