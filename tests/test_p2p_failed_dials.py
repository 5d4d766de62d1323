"""A failed dial is remembered for ``FAILED_DIAL_MEMORY`` seconds, not py-libp2p's 60 s: one dial
lost to packet loss on a long link kept two peers of an all-reduce apart for a whole round
(netlab's packet-level delay line, 150 ms one way, 1% loss)."""

from __future__ import annotations

import socket

import pytest
import trio

import swarmtrain.p2p.host as host_module
from swarmtrain.p2p import P2P
from swarmtrain.p2p.errors import PeerUnreachableError
from swarmtrain.p2p.identity import load_or_create_identity, peer_id_of


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.trio
async def test_a_peer_that_failed_a_dial_is_reachable_again_soon(tmp_path, monkeypatch):
    monkeypatch.setattr(host_module, "FAILED_DIAL_MEMORY", 1.0)
    identity = str(tmp_path / "late.key")
    late_id = peer_id_of(load_or_create_identity(identity))
    address = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{late_id}"
    async with P2P.create(use_autonat=False) as dialler:
        with pytest.raises(PeerUnreachableError):  # nobody listens there yet
            await dialler.connect(address)
        async with P2P.create(
            host_maddrs=[address.rsplit("/p2p/", 1)[0]], identity_path=identity, use_autonat=False
        ) as late:
            assert late.peer_id == late_id
            with pytest.raises(PeerUnreachableError):  # remembered as failed, for a while
                await dialler.connect(address)
            started = trio.current_time()
            with trio.fail_after(10):
                while True:
                    try:
                        await dialler.connect(address)
                        break
                    except PeerUnreachableError:
                        await trio.sleep(0.1)
            waited = trio.current_time() - started
            assert late.peer_id in dialler.get_connected_peers()
            assert waited < 5  # the memory (1 s here), not py-libp2p's 60 s
