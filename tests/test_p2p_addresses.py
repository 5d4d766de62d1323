"""A host listening on all interfaces reports addresses another machine can dial."""

from __future__ import annotations

import pytest
import trio
from polling import wait_until

from swarmtrain.p2p import P2P
from swarmtrain.p2p.addresses import expand_unspecified, interface_ips

PEER = "/p2p/12D3KooWGzsrv71XvVu2qYF9DLEMDAEGQFWuqZUo5cHef2DvovVN"


def test_specific_addresses_are_kept_and_unspecified_ones_become_this_machines_ips():
    assert expand_unspecified([f"/ip4/127.0.0.1/tcp/5{PEER}"]) == [f"/ip4/127.0.0.1/tcp/5{PEER}"]
    expanded = expand_unspecified([f"/ip4/0.0.0.0/tcp/5{PEER}", f"/ip4/127.0.0.1/tcp/5{PEER}"])
    assert expanded == [f"/ip4/{ip}/tcp/5{PEER}" for ip in interface_ips()]  # no duplicates
    assert expanded[-1] == f"/ip4/127.0.0.1/tcp/5{PEER}"
    assert expand_unspecified([f"/ip6/::/tcp/5{PEER}"])[-1] == f"/ip6/::1/tcp/5{PEER}"
    assert expand_unspecified([f"/ip4/0.0.0.0/tcp/5/ws{PEER}"])[-1].endswith(f"/tcp/5/ws{PEER}")


@pytest.mark.trio
async def test_every_visible_address_of_a_wildcard_host_is_dialable():
    async with P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"]) as host:
        addresses = host.get_visible_maddrs()
        assert addresses and not any("/0.0.0.0/" in a for a in addresses), addresses
        for address in addresses:
            async with P2P.create(initial_peers=[address]) as joiner:
                assert joiner.is_connected(host.peer_id), address


@pytest.mark.trio
async def test_peers_that_identify_a_wildcard_host_learn_dialable_addresses():
    # py-libp2p's identify reported the bound 0.0.0.0 address and replaced whatever the dialler
    # knew with it; the DHT then handed it on, and a dial of it failed (then py-libp2p's
    # negative cache refused every dial of that host for 10 s, good addresses included).
    async with P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"]) as host:
        loopback = next(a for a in host.get_visible_maddrs() if "/ip4/127.0.0.1/" in a)
        async with P2P.create(initial_peers=[loopback]) as joiner:

            def known() -> set[str]:
                return {a.split("/p2p/")[0] for a in joiner.known_addrs(host.peer_id)}

            with trio.fail_after(5.0):  # the joiner identified the host it dialled
                await wait_until(lambda: known() != {loopback.split("/p2p/")[0]})
            learned = known()
            assert not any("/0.0.0.0/" in a for a in learned), learned
            assert learned == {a.split("/p2p/")[0] for a in host.get_visible_maddrs()}
            assert not any("/0.0.0.0/" in str(a) for a in host.host.get_addrs())
