"""``RunPresence``: who is in a DiLoCo run; a donor that died without saying goodbye (SIGKILL,
a lost host) is not counted as present once a dial to it failed.

Real DHTs over loopback. The dead donor stored its presence record and left without its goodbye
record; its port then drops every SYN (a host gone from the network: each dial hangs).
"""

from __future__ import annotations

import re
import time

from test_averaging_dead_donors import silent_port

from swarmtrain.dht import DHT
from swarmtrain.optim.diloco_peers import RunPresence

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
