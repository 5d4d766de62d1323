"""Audit 4 against real DHT nodes: a plain dict stored as one regular value under a schema's
dictionary field must not wipe the owners' signed subkeys or plant a value under an owner's
marker (issue 17.3, the SchemaValidator part)."""

from __future__ import annotations

import pydantic
import pytest
import trio

from swarmtrain.dht import (
    DHT,
    BytesWithPublicKey,
    Ed25519SignatureValidator,
    SchemaValidator,
    generate_private_key,
    get_dht_time,
    serialize,
)
from swarmtrain.dht.protocol import StoreItem

HOST_KWARGS = dict(use_relay=False, relay_service=False, use_autonat=False)


class Declarations(pydantic.BaseModel):
    declarations: dict[BytesWithPublicKey, pydantic.confloat(ge=0)]  # type: ignore[valid-type]


@pytest.mark.trio
async def test_plain_dict_cannot_replace_signed_subkeys():
    keys = [Ed25519SignatureValidator(generate_private_key()) for _ in range(3)]
    async with DHT.create(
        record_validators=[SchemaValidator(Declarations), keys[0]], **HOST_KWARGS
    ) as first:
        initial = first.get_visible_maddrs()[:1]
        async with (
            DHT.create(
                initial, record_validators=[SchemaValidator(Declarations), keys[1]], **HOST_KWARGS
            ) as owner,
            DHT.create(
                initial, record_validators=[SchemaValidator(Declarations), keys[2]], **HOST_KWARGS
            ) as attacker,
        ):
            owner_marker = keys[1].local_public_key
            # honest subkey stores: each peer under its own marker
            assert await owner.store("declarations", 1.0, get_dht_time() + 60, subkey=owner_marker)
            assert await attacker.store(
                "declarations", 2.0, get_dht_time() + 60, subkey=keys[2].local_public_key
            )
            assert not await attacker.store(
                "declarations", 5.0, get_dht_time() + 60, subkey=owner_marker
            )

            # the attack: one regular value holding the whole dictionary, expiring later
            plain = {owner_marker: 1e308, keys[2].local_public_key: 1e308}
            assert not await attacker.store("declarations", plain, get_dht_time() + 600)
            # ... also sent raw, past the attacker's own validators, to every node
            expiration = get_dht_time() + 600
            item = StoreItem(serialize("declarations"), None, serialize(plain), expiration)
            for node in (first, owner):
                answer = await attacker.node.protocol.call_store(node.peer_id, [item])
                assert answer == [False]

            for reader in (first, owner, attacker):
                found = await reader.get("declarations", latest=True)
                assert found is not None and isinstance(found.value, dict), found
                values = {subkey: item.value for subkey, item in found.value.items()}
                assert values == {owner_marker: 1.0, keys[2].local_public_key: 2.0}

            # the owner can still update its own subkey
            assert await owner.store("declarations", 3.0, get_dht_time() + 60, subkey=owner_marker)
            with trio.fail_after(10):
                found = await first.get("declarations", latest=True)
            assert found.value[owner_marker].value == 3.0
