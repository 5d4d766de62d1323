"""Audit 4 against real peers: an outsider cannot wipe or hijack matchmaking and state-sharing
declarations, which are per-peer records signed with each peer's identity key (issue 17.3).

The attacker is a plain DHT node in the same swarm. It tries the audit's stores through its own
node (with and without our validators, so its node signs what it can) and raw store RPCs sent
to every honest node; the honest averagers still find each other and a newcomer still loads
from the honest donor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import trio

from swarmtrain.averaging import DecentralizedAverager, MatchmakingError
from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking import encode_declaration
from swarmtrain.averaging.matchmaking_types import GROUP_KEY_PATTERN, Declaration
from swarmtrain.averaging.state_sharing import STATE_SHARING_KEY_PATTERN, state_sharing_key
from swarmtrain.dht import DHT, DHTID, PeerRecordValidator, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {"min_matchmaking_time": 1.0, "request_timeout": 0.5}
FAR = 10**9  # the audit's expiration: "forever"


def tensors(seed: int) -> list[torch.Tensor]:
    return [torch.randn(8, generator=torch.Generator().manual_seed(seed))]


async def raw_store(attacker: DHT, victims: list[DHT], item: StoreItem) -> list:
    """``item`` sent as is (no validator of the attacker's node involved) to every victim."""
    return [await attacker.node.protocol.call_store(v.peer_id, [item]) for v in victims]


async def average_once(averagers) -> list:
    results: list = [None] * len(averagers)

    async def step(i):
        try:
            results[i] = await averagers[i].step(timeout=10)
        except MatchmakingError as e:
            results[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(step, i)
    return results


@pytest.mark.trio
async def test_outsider_cannot_wipe_or_hijack_matchmaking_declarations():
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(DHT.create([], **HOST))
        initial = first.get_visible_maddrs()[:1]
        second = await stack.enter_async_context(DHT.create(initial, **HOST))
        evil = await stack.enter_async_context(DHT.create(initial, **HOST))
        honest = [
            await stack.enter_async_context(
                DecentralizedAverager.create(tensors(i), dht, prefix="mm", **FAST)
            )
            for i, dht in enumerate((first, second))
        ]
        peers = {a.peer_id for a in honest}
        assert all(isinstance(r, dict) and set(r) == peers for r in await average_once(honest))

        # the audit's wipe: a plain value over the declarations, "forever"
        now = get_dht_time()
        await evil.store("mm.0b", "x", now + FAR)  # evil's own node knows nothing: keeps it
        wipe = StoreItem(serialize("mm.0b"), None, serialize("x"), now + FAR)
        assert await raw_store(evil, [first, second], wipe) == [[False], [False]]

        # hijack: "h0 is not looking for a group", under h0's subkey, unsigned then signed by evil
        target = first.peer_id.to_bytes()
        fake = Declaration(target, now + FAR, False, b"", AveragingMode.NODE, None)
        hijack = StoreItem(
            serialize("mm.0b"), serialize(target), serialize(encode_declaration(fake)), now + FAR
        )
        assert await raw_store(evil, [first, second], hijack) == [[False], [False]]
        evil.add_validators([PeerRecordValidator([GROUP_KEY_PATTERN])])
        assert not await evil.store("mm.0b", encode_declaration(fake), now + FAR, subkey=target)

        # evil's own (signed) declaration is its to make; the honest pair still averages
        results = await average_once(honest)
        assert all(isinstance(r, dict) and set(r) == peers for r in results), results


@pytest.mark.trio
async def test_outsider_cannot_hide_the_donor_or_replay_its_record():
    key = state_sharing_key("st")
    donor_state = tensors(7)
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(DHT.create([], **HOST))
        initial = first.get_visible_maddrs()[:1]
        second = await stack.enter_async_context(DHT.create(initial, **HOST))
        evil = await stack.enter_async_context(DHT.create(initial, **HOST))
        donor = await stack.enter_async_context(
            DecentralizedAverager.create([t.clone() for t in donor_state], first, prefix="st")
        )
        newcomer = await stack.enter_async_context(
            DecentralizedAverager.create(tensors(8), second, prefix="st", allow_state_sharing=False)
        )
        donor_id = donor.peer_id.to_bytes()
        # the donor declared before ``create`` returned; its signed record as the nodes hold it
        # (evil's node, with no state-sharing averager, too: signatures are checked under any key)
        key_id = DHTID.from_serialized_key(serialize(key))
        for node in (first, second, evil):
            held = node.node.protocol.lookup_locally(key_id, get_dht_time())
            assert held is not None and serialize(donor_id) in held.value, node
        original = held.value.get(serialize(donor_id), get_dht_time())

        # the audit's hijack: "the donor stopped sharing", and "pick me first"
        now = get_dht_time()
        blank = StoreItem(serialize(key), serialize(donor_id), serialize(None), now + FAR)
        assert await raw_store(evil, [first, second], blank) == [[False], [False]]
        # the donor's own signed record, replayed with a later expiration or under evil's subkey
        later = StoreItem(serialize(key), serialize(donor_id), original.value, now + FAR)
        moved = StoreItem(
            serialize(key),
            serialize(evil.peer_id.to_bytes()),
            original.value,
            original.expiration_time,
        )
        assert await raw_store(evil, [first, second], later) == [[False], [False]]
        assert await raw_store(evil, [first, second], moved) == [[False], [False]]
        evil.add_validators([PeerRecordValidator([STATE_SHARING_KEY_PATTERN])])
        assert not await evil.store(key, None, now + FAR, subkey=donor_id)
        assert await evil.store(key, 1e308, now + 60, subkey=evil.peer_id.to_bytes())

        for reader in (first, second, evil):
            found = await reader.get(key, latest=True)
            values = {subkey: item.value for subkey, item in found.value.items()}
            assert values == {donor_id: 0.0, evil.peer_id.to_bytes(): 1e308}, values

        # evil goes first ("pick me first") but serves nothing: the newcomer moves on to the donor
        loaded = await newcomer.load_state_from_peers(timeout=10)
        assert loaded is not None
        torch.testing.assert_close(loaded[1][0], donor_state[0])
