"""A host refuses an address another host already listens on (py-libp2p listens with
SO_REUSEPORT, so without the check both would listen and split the incoming connections)."""

from __future__ import annotations

import errno

import pytest

from swarmtrain.dht import DHT
from swarmtrain.p2p import P2P, AddressInUseError, P2PError


def tcp_port(host: P2P | DHT) -> int:
    return int(str(host.get_visible_maddrs()[0]).split("/")[4])


@pytest.mark.trio
@pytest.mark.parametrize("second_ip", ["127.0.0.1", "0.0.0.0"])
async def test_a_second_host_on_a_port_in_use_fails_and_the_first_stays_reachable(second_ip):
    async with P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as first:
        port = tcp_port(first)
        taken = f"/ip4/{second_ip}/tcp/{port}"
        with pytest.raises(AddressInUseError) as raised:
            async with P2P.create(host_maddrs=[taken]):
                pass
        error = raised.value
        assert isinstance(error, OSError) and isinstance(error, P2PError)
        assert error.errno == errno.EADDRINUSE
        assert error.address == taken
        assert taken in str(error) and "already in use" in str(error)
        # every new peer still reaches the first host (with two listeners, some reached the other)
        for _ in range(4):
            async with P2P.create(initial_peers=first.get_visible_maddrs()) as joiner:
                assert joiner.is_connected(first.peer_id)


@pytest.mark.trio
async def test_a_port_is_reusable_once_its_host_closed():
    async with P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as first:
        port = tcp_port(first)
        async with P2P.create(initial_peers=first.get_visible_maddrs()):
            pass  # leaves connections on that port in TIME_WAIT
    async with P2P.create(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"]) as again:
        assert tcp_port(again) == port


@pytest.mark.trio
async def test_port_zero_still_gives_each_host_its_own_port():
    async with (
        P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as a,
        P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as b,
    ):
        assert tcp_port(a) != tcp_port(b)


def test_none_means_no_addresses_as_in_hivemind():
    """``DHT(initial_peers=None, announce_maddrs=None)`` (hivemind's defaults, and what the
    ALBERT recipe passes when no flag is given) starts a host instead of raising TypeError."""
    first = DHT(None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=None)
    try:
        second = DHT(first.get_visible_maddrs(), announce_maddrs=None)
        try:
            assert first.peer_id in {p for p in second.run_coroutine(_connected)}
        finally:
            second.shutdown()
    finally:
        first.shutdown()


async def _connected(dht, _node):
    return dht.p2p.get_connected_peers()


def test_a_dht_on_a_port_in_use_fails_with_the_address():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        taken = f"/ip4/127.0.0.1/tcp/{tcp_port(first)}"
        with pytest.raises(AddressInUseError, match="already in use") as raised:
            DHT(host_maddrs=[taken], start=True)
        assert raised.value.address == taken
    finally:
        first.shutdown()


@pytest.mark.trio
async def test_a_fixed_data_lane_port_in_use_is_named():
    async with P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as first:
        lane_port = first.lanes.port
        with pytest.raises(AddressInUseError, match=f"port {lane_port} .data lanes."):
            async with P2P.create(data_lane_port=lane_port):
                pass
