"""Dictionary subkeys from peers must be usable as dict keys (found by tests/test_fuzz_dht.py:
a list subkey made ``SchemaValidator.validate`` and every ``get`` of its key raise TypeError)."""

from __future__ import annotations

import math

import msgpack
import pydantic
import pytest
from test_dht_node import swarm

from swarmtrain.dht import DHTID, DHTRecord, SchemaValidator, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.dht.serialization import UnsupportedValueTypeError, check_serialized_subkey
from swarmtrain.dht.storage import DictionaryDHTValue


class Schema(pydantic.BaseModel):
    peers: dict[bytes, int]


def test_schema_validator_rejects_container_subkeys():
    validator = SchemaValidator(Schema)
    record = DHTRecord(serialize("peers"), b"\x90", serialize(1), 1e10)  # subkey: []
    assert validator.validate(record) is False
    assert validator.validate(DHTRecord(serialize("peers"), serialize(b"p"), serialize(1), 1e10))


@pytest.mark.parametrize("subkey", [[], [1], {"a": 1}])
def test_container_subkeys_are_malformed(subkey):
    with pytest.raises(UnsupportedValueTypeError):
        check_serialized_subkey(serialize(subkey))
    for fine in (None, 1, -2.5, "a", b"b", True):
        check_serialized_subkey(serialize(fine))


@pytest.mark.trio
async def test_get_skips_bad_subkeys_in_a_peers_answer_and_store_refuses_them():
    async with swarm(2) as s:
        victim, attacker = s.nodes
        key = serialize("shared")
        now = get_dht_time()
        expiration = now + 60
        key_id = DHTID.generate("shared")
        # the attacker's own storage holds what a malicious peer would answer with
        for subkey in (serialize([1]), b"\xc1", serialize({"x": 1}), serialize("good")):
            assert attacker.protocol.storage.store(
                key_id, serialize("value"), expiration, now, subkey=subkey
            )
        found = await victim.get("shared", latest=True)
        assert found is not None
        assert set(found.value) == {"good"}
        # a store request with a container subkey is refused as malformed (nothing stored)
        item = StoreItem(key, serialize([2]), serialize("value"), expiration)
        assert await attacker.protocol.call_store(victim.p2p.peer_id, [item]) is None
        assert len(victim.protocol.storage) <= 1  # at most the cached "good" subkey
        assert not await victim.store("other", "v", expiration, subkey=[3])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_packed_dictionary_with_a_non_finite_expiration_is_malformed(bad):
    """Found by tests/test_fuzz_dht.py: a peer's packed dictionary could carry a NaN expiration;
    stored in a cache it never expired and stopped the purge of the whole dictionary."""
    for packed in ([1e10, [[b"k", b"v", bad]]], [bad, [[b"k", b"v", 1e10]]]):
        with pytest.raises(ValueError, match="not finite"):
            DictionaryDHTValue.unpackb(msgpack.packb(packed), now=0.0)
    good = DictionaryDHTValue.unpackb(msgpack.packb([1e10, [[b"k", b"v", 1e10]]]), now=0.0)
    assert [(k, item.value) for k, item in good.items(0.0)] == [(b"k", b"v")]
