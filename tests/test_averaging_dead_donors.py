"""Donors that died without withdrawing their state offers (SIGKILL, a lost host) cost a newcomer
a short delay each, not a dial timeout each.

Real peers over loopback. A dead donor is a DHT node that stored its own state offer and left;
its port then drops every SYN (a listener that never accepts, its backlog full), as a host gone
from the network does: a dial to it hangs until the dial timeout (5 s).
"""

from __future__ import annotations

import re
import socket

import pytest
import torch
import trio
from dead_hosts import silent_port
from test_averaging_averager import Swarm, random_tensors

from swarmtrain.averaging.state_sharing import STATE_SHARING_KEY_PATTERN, state_sharing_key
from swarmtrain.dht import DHT, PeerRecordValidator, get_dht_time

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


@pytest.mark.trio
async def test_dead_donors_ahead_of_a_live_one_cost_a_short_delay_each():
    live_state = random_tensors(60)
    dead: list[tuple[object, list[str]]] = []
    traps: list[socket.socket] = []
    try:
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery)
            live = await swarm.add(live_state)
            live.state_sharing_priority = 1.0
            for _ in range(2):  # two donors that offer their state first, then die silently
                async with DHT.create(swarm.bootstrap, **HOST) as ghost:
                    # its offer is signed as a donor's is (readers drop unsigned offers)
                    ghost.add_validators([PeerRecordValidator([STATE_SHARING_KEY_PATTERN])])
                    stored = await ghost.store(
                        state_sharing_key(swarm.prefix),
                        9.0,
                        get_dht_time() + 60,
                        subkey=ghost.peer_id.to_bytes(),
                    )
                    assert stored
                    addrs = [re.sub(r"/p2p/.*$", "", str(a)) for a in ghost.get_visible_maddrs()]
                    dead.append((ghost.peer_id, addrs))
            for _, addrs in dead:
                for addr in addrs:
                    traps += silent_port(int(re.search(r"/tcp/(\d+)", addr).group(1)))
            newcomer = await swarm.add(random_tensors(61), allow_state_sharing=False)
            for peer_id, addrs in dead:  # as learned from the DHT while they lived
                newcomer.dht.p2p.add_addrs(peer_id, addrs)
            donors = await newcomer._state_sharing.find_donors()
            assert set(donors[:2]) == {peer_id for peer_id, _ in dead}  # asked first

            started = trio.current_time()
            with trio.fail_after(30):
                loaded = await newcomer.load_state_from_peers(timeout=20)
            took = trio.current_time() - started
            assert loaded is not None
            for got, expected in zip(loaded[1], live_state, strict=True):
                assert torch.equal(got, expected)
            # one dead donor after the other: 2 x dial_timeout (5 s) = 10 s before the fix
            assert took < 4.0, took
            swarm.stop_all()
    finally:
        for sock in traps:
            sock.close()
