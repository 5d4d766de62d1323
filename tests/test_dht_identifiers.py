import hashlib

import pytest

from swarmtrain.dht import DHTID, serialize
from swarmtrain.dht.identifiers import MAX_PEER_ID_BYTES


def test_generate_is_hash_of_serialized_key():
    assert DHTID.generate("key") == DHTID.generate("key")
    assert DHTID.generate("key") != DHTID.generate(b"key")  # type is part of the key
    assert DHTID.generate(("a", 1)) == DHTID.from_serialized_key(serialize(["a", 1]))
    assert DHTID.generate() != DHTID.generate()  # random


def test_bytes_roundtrip_and_range():
    for value in (DHTID.MIN, 1, DHTID.MAX - 1, int(DHTID.generate())):
        node_id = DHTID(value)
        raw = node_id.to_bytes()
        assert len(raw) == DHTID.HASH_NBYTES
        assert DHTID.from_bytes(raw) == node_id
        assert isinstance(DHTID.from_bytes(raw), DHTID)
    with pytest.raises(ValueError, match="DHTID must be in"):
        DHTID(DHTID.MAX)
    with pytest.raises(ValueError, match="DHTID must be in"):
        DHTID(-1)
    with pytest.raises(TypeError):
        DHTID(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="20 bytes"):
        DHTID.from_bytes(b"\x00" * 19)


def test_distances_and_prefixes():
    a, b = DHTID(0b1011 << 150), DHTID(0b1001 << 150)
    assert a.xor_distance(b) == 0b0010 << 150
    assert a.xor_distances([a, b]) == [0, 0b0010 << 150]
    assert a.bucket_index(a) == -1
    assert a.bucket_index(b) == 151
    assert DHTID.common_prefix_length(a, b) == 160 - 152
    assert DHTID.common_prefix_length(a) == 160
    assert DHTID.common_prefix_length(DHTID(0), DHTID(DHTID.MAX - 1)) == 0
    assert repr(DHTID(255)).startswith("DHTID(0x000")


def test_node_id_is_the_personalised_hash_of_the_peer_id():
    from swarmtrain.p2p.identity import generate_identity, peer_id_of

    peer_id = peer_id_of(generate_identity())
    raw = peer_id.to_bytes()
    digest = hashlib.blake2b(raw, digest_size=20, person=b"swarmtrain/node").digest()
    assert DHTID.from_peer_id(peer_id) == DHTID.from_peer_id(raw) == DHTID.from_bytes(digest)
    assert isinstance(DHTID.from_peer_id(raw), DHTID)
    # not the id of a key with the same bytes (personalised), nor sha256 as libp2p-kad's
    assert DHTID.from_peer_id(raw) != DHTID.from_serialized_key(raw)
    assert DHTID.from_peer_id(raw) != DHTID.from_peer_id(raw[:-1] + bytes([raw[-1] ^ 1]))


def test_is_node_id_of_binds_one_id_to_one_peer():
    raw = bytes(range(38))
    own = DHTID.from_peer_id(raw)
    assert own.is_node_id_of(raw)
    assert not DHTID(own ^ 1).is_node_id_of(raw)  # the place next to it is not for sale
    assert not own.is_node_id_of(raw + b"\x00")
    for malformed in (b"", b"x" * (MAX_PEER_ID_BYTES + 1), b"x" * 8 * 1024 * 1024):
        assert not own.is_node_id_of(malformed)  # never hashed nor cached
        with pytest.raises(ValueError, match="peer id must be"):
            DHTID.from_peer_id(malformed)
    assert DHTID.from_peer_id(b"x" * MAX_PEER_ID_BYTES).is_node_id_of(b"x" * MAX_PEER_ID_BYTES)
