"""Persistent identity: same peer id after a restart, private file mode, clear errors."""

import os
import stat

import pytest
import trio
from google.protobuf.wrappers_pb2 import StringValue

from swarmtrain.p2p import P2P, IdentityError
from swarmtrain.p2p.identity import load_identity, load_or_create_identity, peer_id_of


def test_identity_file_is_private_and_stable(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = load_or_create_identity(path)
    assert peer_id_of(first) == peer_id_of(second)
    assert peer_id_of(load_or_create_identity(None)) != peer_id_of(first)


def test_identity_errors_are_clear(tmp_path):
    path = tmp_path / "peer.key"
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_identity(path)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    os.chmod(garbage, 0o600)
    with pytest.raises(IdentityError, match="not a libp2p private key"):
        load_identity(garbage)


@pytest.mark.trio
async def test_restarted_host_keeps_its_peer_id_and_is_reachable_again(tmp_path):
    path = str(tmp_path / "server.key")

    async def hello(request, context):
        return StringValue(value="hi")

    async with P2P.create(identity_path=path) as server:
        first_id = server.peer_id
    async with P2P.create(identity_path=path) as server:
        assert server.peer_id == first_id
        server.add_protobuf_handler("t::S.hello", hello, StringValue)
        async with P2P.create(initial_peers=server.get_visible_maddrs()) as client:
            reply = await client.call_protobuf_handler(
                first_id, "t::S.hello", StringValue(), StringValue
            )
            assert reply.value == "hi"
    await trio.lowlevel.checkpoint()
