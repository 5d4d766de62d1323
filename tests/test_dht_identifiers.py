import pytest

from swarmtrain.dht import DHTID, serialize


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
