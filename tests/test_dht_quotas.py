"""Issue 17.3 (audit 4 and 8) against real peers on loopback: an attacker DHT node stores
far-future records and floods 1 MiB values; honest records survive, honest stores still
succeed, and the victim holds no more of the attacker's bytes than its quota.

The attacker is a real ``DHTNode`` whose own limits are off (``max_expiration_horizon=None``)
and which calls ``rpc_store`` directly, so nothing on its side caps what it sends.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from swarmtrain.dht import DHT, DHTID, StorageQuota, get_dht_time, serialize
from swarmtrain.dht.node import DEFAULT_MAX_EXPIRATION_HORIZON
from swarmtrain.dht.protocol import StoreItem, merge_found_values
from swarmtrain.dht.storage import DictionaryDHTValue, ValueWithExpiration
from swarmtrain.dht.storage_quota import DEFAULT_MAX_BYTES_PER_PEER

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {"wait_timeout": 2.0, "blacklist_time": 1.0, **HOST}
MIB = 1024 * 1024
FAR = 10**9  # the audit's expiration: ~31 years


@asynccontextmanager
async def dhts(*configs: dict):
    """Connected trio DHTs, one per config (the first is the bootstrap); closed in reverse."""
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(DHT.create([], **FAST, **configs[0]))
        result = [first]
        for config in configs[1:]:
            initial = first.get_visible_maddrs()
            result.append(await stack.enter_async_context(DHT.create(initial, **FAST, **config)))
        yield result


def item(key, value, expiration, subkey=None) -> StoreItem:
    return StoreItem(
        serialize(key), serialize(subkey) if subkey is not None else None, value, expiration
    )


async def raw_store(attacker, victim, items) -> list[bool] | None:
    return await attacker.node.protocol.call_store(victim.peer_id, items)


def test_a_dictionary_wins_a_merge_over_a_later_regular_value():
    subkeys = DictionaryDHTValue()
    subkeys.store(b"peer", b"declared", 20.0, now=0.0)
    found = ValueWithExpiration(subkeys, 20.0)
    wipe = ValueWithExpiration(b"x", 600.0)
    assert merge_found_values(found, wipe, now=0.0) is found
    assert merge_found_values(wipe, found, now=0.0) is found
    later = ValueWithExpiration(b"y", 601.0)
    assert merge_found_values(wipe, later, now=0.0) is later


@pytest.mark.trio
async def test_far_future_records_are_refused_stored_capped_and_ignored_when_read():
    async with dhts({}, {}, {"max_expiration_horizon": None}) as (victim, honest, evil):
        now = get_dht_time()
        # refused by the victim (a typed reason on its side, False for the caller)
        junk = [item("junk", serialize("x"), now + FAR), item("d", serialize(1), now + FAR, "s")]
        assert await raw_store(evil, victim, junk) == [False, False]
        assert victim.node.protocol.storage.statistics(get_dht_time()).num_records == 0

        # our own user's far-future store is capped at the horizon, not refused
        assert await honest.store("capped", "v", now + FAR)
        found = await victim.get("capped", latest=True)
        assert found is not None and found.value == "v"
        assert found.expiration_time <= get_dht_time() + DEFAULT_MAX_EXPIRATION_HORIZON

        # a value a peer returns beyond the horizon does not win: the reader ignores it
        assert await honest.store("model", "honest", get_dht_time() + 60)
        evil.node.protocol.store_locally(
            [item("model", serialize("evil"), get_dht_time() + FAR)]
        )  # the attacker's own storage accepts anything
        key_id = DHTID.from_serialized_key(serialize("model"))
        assert evil.node.protocol.storage.get(key_id, get_dht_time()).value == serialize("evil")
        for reader in (victim, honest):
            found = await reader.get("model", latest=True)
            assert found is not None and found.value == "honest"


@pytest.mark.trio
async def test_a_plain_value_cannot_wipe_a_dictionary_of_declarations():
    """Audit 4's wipe: ``evil.store("mm.0b", "x", now + 1e9)`` refused every later honest
    declaration; now neither a far-future nor an in-horizon plain value touches the subkeys."""
    async with dhts({}, {}, {}, {"max_expiration_horizon": None}) as (a, b, c, evil):
        for writer in (a, b, c):
            assert await writer.store(
                "mm.0b", "group", get_dht_time() + 15, subkey=writer.peer_id.to_bytes()
            )
        now = get_dht_time()
        assert not await evil.store("mm.0b", "x", now + FAR)
        assert not await evil.store("mm.0b", "x", now + 300)  # within the horizon
        for peer in (a, b, c):
            assert await raw_store(evil, peer, [item("mm.0b", serialize("x"), now + 300)]) == [
                False
            ]
        for reader in (a, b, c):
            found = await reader.get("mm.0b", latest=True)
            assert found is not None and isinstance(found.value, dict) and len(found.value) == 3
        # planted before the declarations, a plain value gives way to the first subkey
        assert await evil.store("mm.0c", "x", get_dht_time() + 300)
        assert await a.store("mm.0c", "group", get_dht_time() + 15, subkey=a.peer_id.to_bytes())
        assert await b.store("mm.0c", "group", get_dht_time() + 15, subkey=b.peer_id.to_bytes())
        found = await c.get("mm.0c", latest=True)
        assert found is not None and isinstance(found.value, dict) and len(found.value) == 2


@pytest.mark.trio
async def test_a_flood_of_1mib_values_stops_at_the_attackers_quota(caplog):
    """Audit 8: 420 values of 1 MiB pinned 543 MiB of the victim. Now the attacker gets its
    quota (default 32 MiB) and then False; the honest records stay and honest stores succeed."""
    async with dhts({}, {}, {"max_expiration_horizon": None}) as (victim, honest, evil):
        storage = victim.node.protocol.storage
        honest_keys = [f"honest{i}" for i in range(20)]
        for key in honest_keys:
            assert await honest.store(key, {"peer": "honest"}, get_dht_time() + 300)
        value = serialize(b"\x00" * (MIB - 64))
        caplog.set_level(logging.WARNING, logger="swarmtrain.dht.protocol")
        results: list[bool] = []
        expiration = get_dht_time() + 120  # within the horizon: only the quota stops it
        for batch in range(6):  # 42 values of 1 MiB, 7 per request (8 MiB message limit)
            items = [item(f"junk{batch}.{i}", value, expiration) for i in range(7)]
            answer = await raw_store(evil, victim, items)
            assert answer is not None
            results += answer
            usage = storage.usage(evil.peer_id, get_dht_time())
            assert usage.bytes <= DEFAULT_MAX_BYTES_PER_PEER
        stored = sum(results)
        assert stored == DEFAULT_MAX_BYTES_PER_PEER // len(value) and not all(results)
        assert results == [True] * stored + [False] * (len(results) - stored)
        refusals = [r for r in caplog.records if "peer_byte_quota" in r.getMessage()]
        assert len(refusals) == 1  # logged once per peer and reason

        # honest records survived, honest stores still succeed (at the victim too)
        now = get_dht_time()
        for key in honest_keys:
            key_id = DHTID.from_serialized_key(serialize(key))
            assert storage.get(key_id, now) is not None
        assert await honest.store("after the flood", 1, get_dht_time() + 60)
        key_id = DHTID.from_serialized_key(serialize("after the flood"))
        assert storage.get(key_id, get_dht_time()) is not None
        # and the attacker stays at its quota
        assert await raw_store(evil, victim, [item("more", value, expiration)]) == [False]


@pytest.mark.trio
async def test_record_quota_refuses_new_keys_but_not_rewrites():
    quota = StorageQuota(max_records_per_peer=16)
    async with dhts({"storage_quota": quota}, {"max_expiration_horizon": None}) as (victim, evil):
        expiration = get_dht_time() + 60
        many = [item(f"k{i}", serialize(i), expiration) for i in range(40)]
        answer = await raw_store(evil, victim, many)
        assert answer == [True] * 16 + [False] * 24
        # a rewrite of its own record is not a new one; subkeys count as records
        assert await raw_store(evil, victim, [item("k0", serialize(0), expiration + 1)]) == [True]
        assert await raw_store(evil, victim, [item("d", serialize(0), expiration, "s")]) == [False]
        usage = victim.node.protocol.storage.usage(evil.peer_id, get_dht_time())
        assert usage.records == 16
        with trio.fail_after(10):
            assert await victim.store("own record", 1, get_dht_time() + 60)  # no quota on us
