"""Private runs (swarmtrain.p2p.private_network): real hosts on loopback, with and without a
swarm key, a stock py-libp2p host, a DHT and a DecentralizedAverager round."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import multiaddr
import pytest
import torch
import trio
from cryptography.exceptions import InvalidTag
from google.protobuf.wrappers_pb2 import StringValue
from libp2p import new_host
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.network.exceptions import SwarmException
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import Transport as StockNoiseTransport

from swarmtrain.averaging import DecentralizedAverager
from swarmtrain.averaging.matchmaking import rpc_join_group_name
from swarmtrain.cli.main import main
from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.p2p import (
    P2P,
    P2PConfig,
    PeerUnreachableError,
    SwarmKeyError,
    SwarmKeyMismatchError,
    generate_swarm_key,
    load_swarm_key,
    save_swarm_key,
)
from swarmtrain.p2p.identity import generate_identity
from swarmtrain.p2p.lane_records import TICKET_ID_SIZE
from swarmtrain.p2p.private_network import KEY_MISMATCH_HINT, _causes
from swarmtrain.proto import dht_pb2

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
KEY = generate_swarm_key()
OTHER_KEY = generate_swarm_key()


async def reverse(request, context):
    return StringValue(value=request.value[::-1])


# ------------------------------------------------------------------------ keys and files


def test_key_files_round_trip_and_are_private(tmp_path):
    key = generate_swarm_key()
    assert len(key) == 32 and key != generate_swarm_key()
    path = tmp_path / "swarm.key"
    save_swarm_key(key, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_swarm_key(path) == key
    assert P2PConfig(swarm_key=str(path)).swarm_key == key  # a path is loaded at config time
    with pytest.raises(SwarmKeyError, match="refusing to overwrite"):
        save_swarm_key(generate_swarm_key(), path)
    os.chmod(path, 0o644)
    with pytest.raises(SwarmKeyError, match="chmod 600"):
        load_swarm_key(path)


def test_ipfs_style_and_raw_key_files(tmp_path):
    key = generate_swarm_key()
    ipfs = tmp_path / "ipfs.key"
    ipfs.write_text(f"/key/swarm/psk/1.0.0/\n/base16/\n{key.hex()}\n")
    raw = tmp_path / "raw.key"
    raw.write_bytes(b"\xff" + key)  # not ASCII: read as raw bytes
    for path in (ipfs, raw):
        os.chmod(path, 0o600)
    assert load_swarm_key(ipfs) == key
    assert load_swarm_key(raw) == b"\xff" + key


def test_bad_keys_are_refused(tmp_path):
    with pytest.raises(SwarmKeyError, match="at least 32 random bytes"):
        P2PConfig(swarm_key=b"hunter2")
    with pytest.raises(TypeError, match="must be bytes"):
        P2PConfig(swarm_key=12345)
    with pytest.raises(SwarmKeyError, match="cannot read"):
        P2PConfig(swarm_key=str(tmp_path / "missing.key"))
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    os.chmod(short, 0o600)
    with pytest.raises(SwarmKeyError, match="at least 32"):
        load_swarm_key(short)
    assert KEY.hex() not in repr(P2PConfig(swarm_key=KEY))


# ------------------------------------------------------------------------------ hosts


@pytest.mark.trio
async def test_same_key_connects_others_get_a_typed_error():
    async with (
        P2P.create(swarm_key=KEY, **HOST) as a,
        P2P.create(a.get_visible_maddrs(), swarm_key=KEY, **HOST) as b,
    ):
        a.add_protobuf_handler("test::Demo.reverse", reverse, StringValue)
        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.reverse", StringValue(value="abc"), StringValue
        )
        assert reply.value == "cba"
        # an outsider with the bootstrap address: no key, or another key
        for outsider_key in (None, OTHER_KEY):
            with pytest.raises(SwarmKeyMismatchError, match="different swarm key"):
                async with P2P.create(a.get_visible_maddrs(), swarm_key=outsider_key, **HOST):
                    pass
            async with P2P.create(swarm_key=outsider_key, **HOST) as outsider:
                outsider.add_addrs(a.peer_id, a.get_visible_maddrs())
                with pytest.raises(SwarmKeyMismatchError) as caught:
                    await outsider.call_protobuf_handler(
                        a.peer_id, "test::Demo.reverse", StringValue(value="x"), StringValue
                    )
                assert KEY_MISMATCH_HINT in str(caught.value)
                assert isinstance(caught.value, PeerUnreachableError)  # old handlers still work
                assert not outsider.is_connected(a.peer_id)
                # and the other direction: a keyed peer dialling the outsider
                b.add_addrs(outsider.peer_id, outsider.get_visible_maddrs())
                with pytest.raises(SwarmKeyMismatchError):
                    await b.ensure_connected(outsider.peer_id)
            assert set(a.get_connected_peers()) == {b.peer_id}
        # the insiders still talk
        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.reverse", StringValue(value="xyz"), StringValue
        )
        assert reply.value == "zyx"


@pytest.mark.trio
async def test_a_dead_address_is_not_reported_as_a_key_mismatch():
    async with P2P.create(**HOST) as a:
        gone = a.get_visible_maddrs()
    with pytest.raises(PeerUnreachableError) as caught:
        async with P2P.create(gone, swarm_key=KEY, **HOST):
            pass
    assert not isinstance(caught.value, SwarmKeyMismatchError)


def stock_host():
    """A py-libp2p host built as py-libp2p's own docs do (no swarmtrain code)."""
    key_pair = generate_identity()
    noise = StockNoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={"/noise": noise},
        muxer_preference="YAMUX",
        listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")],
    )


@pytest.mark.trio
async def test_a_stock_libp2p_host_cannot_connect_to_a_keyed_host():
    stock = stock_host()
    async with (
        P2P.create(swarm_key=KEY, **HOST) as keyed,
        stock.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]),
    ):
        addrs = [multiaddr.Multiaddr(a) for a in keyed.get_visible_maddrs()]
        with pytest.raises(SwarmException) as caught, trio.fail_after(10):
            await stock.connect(PeerInfo(keyed.peer_id, addrs))
        # it failed authenticating our handshake message (not e.g. a refused connection)
        assert any(isinstance(e, InvalidTag) for e in _causes(caught.value))
        assert stock.get_connected_peers() == []
        assert keyed.get_connected_peers() == []
        # the keyed host dialling the stock one gets the clear error
        keyed.add_addrs(stock.get_id(), [str(a) for a in stock.get_addrs()])
        with pytest.raises(SwarmKeyMismatchError):
            await keyed.ensure_connected(stock.get_id())
        # without keys both would connect (the stock host is a working libp2p peer)
        async with P2P.create(**HOST) as public:
            public.add_addrs(stock.get_id(), [str(a) for a in stock.get_addrs()])
            await public.ensure_connected(stock.get_id())


@pytest.mark.trio
async def test_outsiders_cannot_get_a_lane_ticket():
    async with (
        P2P.create(swarm_key=KEY) as a,
        P2P.create(a.get_visible_maddrs(), swarm_key=KEY) as b,
        P2P.create() as outsider,
    ):
        assert a.lanes is not None and a.lanes.port
        a.add_protobuf_handler("test::Demo.reverse", reverse, StringValue)
        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Demo.reverse", StringValue(value="lane"), StringValue, bulk=True
        )
        assert reply.value == "enal"
        outsider.add_addrs(a.peer_id, a.get_visible_maddrs())
        with pytest.raises(SwarmKeyMismatchError):
            await outsider.call_protobuf_handler(
                a.peer_id, "test::Demo.reverse", StringValue(value="x"), StringValue, bulk=True
            )
        assert len(a.lanes.tickets) == 0  # b's ticket was used; the outsider never got one
        # the lane port itself, with a made-up ticket id: closed without an answer
        accepted = a.lanes.lanes_accepted
        sock = trio.socket.socket()
        with trio.fail_after(10):
            await sock.connect(("127.0.0.1", a.lanes.port))
            await sock.send(os.urandom(TICKET_ID_SIZE))
            assert await sock.recv(1) == b""
        sock.close()
        assert a.lanes.lanes_accepted == accepted


# -------------------------------------------------------------------- DHT and averaging


@pytest.mark.trio
async def test_outsiders_cannot_store_or_join_while_insiders_average():
    shapes = [(8, 8), (5,)]
    tensors = [[torch.randn(*s) for s in shapes] for _ in range(2)]
    want = [(tensors[0][i] + tensors[1][i]) / 2 for i in range(len(shapes))]
    averaging = {"prefix": "private", "min_matchmaking_time": 1.0, "request_timeout": 0.5}
    async with (
        DHT.create(swarm_key=KEY, **HOST) as dht_a,
        DHT.create(dht_a.get_visible_maddrs(), swarm_key=KEY, **HOST) as dht_b,
        DecentralizedAverager.create(
            [t.clone() for t in tensors[0]], dht_a, target_group_size=2, **averaging
        ) as avg_a,
        DecentralizedAverager.create(
            [t.clone() for t in tensors[1]], dht_b, target_group_size=2, **averaging
        ) as avg_b,
    ):
        assert await dht_a.store("insider", "ok", get_dht_time() + 30)
        assert (await dht_b.get("insider", latest=True)).value == "ok"
        for outsider_key in (None, OTHER_KEY):
            with pytest.raises(SwarmKeyMismatchError):
                async with DHT.create(dht_a.get_visible_maddrs(), swarm_key=outsider_key, **HOST):
                    pass
            async with DHT.create(swarm_key=outsider_key, **HOST) as outsider:
                outsider.p2p.add_addrs(dht_a.peer_id, dht_a.get_visible_maddrs())
                store = dht_pb2.DHTStoreRequest(keys=[b"k"], values=[b"v"], expiration_time=[1e9])
                with pytest.raises(SwarmKeyMismatchError):
                    await outsider.p2p.call_protobuf_handler(
                        dht_a.peer_id,
                        dht_a.node.protocol.method_name("rpc_store"),
                        store,
                        dht_pb2.DHTStoreResponse,
                    )
                assert await outsider.node.protocol.call_ping(dht_a.peer_id) is None
                with pytest.raises(SwarmKeyMismatchError):
                    await outsider.p2p.call_protobuf_handler(
                        dht_a.peer_id, rpc_join_group_name("private"), StringValue(), StringValue
                    )
        assert set(dht_a.p2p.get_connected_peers()) == {dht_b.peer_id}

        results = [None, None]

        async def step(i, averager):
            results[i] = await averager.step(timeout=15)

        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step, 0, avg_a)
            nursery.start_soon(step, 1, avg_b)
        assert time.monotonic() - start < 15
        assert all(r is not None and len(r) == 2 for r in results)
        for averager in (avg_a, avg_b):
            with averager.get_tensors() as got:
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w)


# ------------------------------------------------------------------------------ CLI


def test_keygen_and_a_private_node(tmp_path, capsys):
    key_path = tmp_path / "swarm.key"
    assert main(["keygen", str(key_path)]) == 0
    assert "wrote a swarm key" in capsys.readouterr().out
    assert main(["keygen", str(key_path)]) == 1  # never overwrites a key
    assert "refusing to overwrite" in capsys.readouterr().err
    key = load_swarm_key(key_path)
    command = [sys.executable, "-m", "swarmtrain.cli.main", "node"]
    command += ["--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--swarm_key_path", str(key_path)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("/p2p/" in line for line in lines):
            lines.append(proc.stdout.readline())
        addrs = re.findall(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", "".join(lines))
        assert addrs, lines

        async def dial():
            async with P2P.create(addrs, swarm_key=key, **HOST) as insider:
                assert insider.get_connected_peers()
            with pytest.raises(SwarmKeyMismatchError):
                async with P2P.create(addrs, **HOST):
                    pass

        trio.run(dial)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
