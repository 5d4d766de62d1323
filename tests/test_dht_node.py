"""DHTNode, DHTProtocol and the DHT facade between real py-libp2p hosts on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from contextlib import asynccontextmanager

import pydantic
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from polling import wait_until

from swarmtrain.dht import (
    DHT,
    DHTID,
    CompositeValidator,
    DHTNode,
    DHTNodeConfig,
    Ed25519SignatureValidator,
    SchemaValidator,
    get_dht_time,
    node_maintenance,
    serialize,
)
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.p2p import P2P, MessageTooLargeError, P2PConfig, RemoteError
from swarmtrain.proto import dht_pb2
from swarmtrain.utils.background import BackgroundRuntime

FAST = {"wait_timeout": 2.0, "blacklist_time": 1.0}
# Relays are useless on loopback and make every host start ~0.3 s slower.
NO_RELAY = {
    name: False
    for name in ("use_relay", "relay_service")
    if name in {f.name for f in dataclasses.fields(P2PConfig)}
}


class Swarm:
    """Nodes that each run in their own task, so any of them can be stopped at any time."""

    def __init__(self, nursery: trio.Nursery):
        self.nursery = nursery
        self.nodes: list[DHTNode] = []
        self._events: dict[DHTNode, tuple[trio.Event, trio.Event]] = {}

    async def _run(self, initial_peers, p2p_kwargs, node_kwargs, *, task_status):
        stop, done = trio.Event(), trio.Event()
        try:
            async with P2P.create(initial_peers, **p2p_kwargs) as p2p:
                async with DHTNode.create(p2p, **node_kwargs) as node:
                    task_status.started((node, stop, done))
                    await stop.wait()  # leave normally: cancelling the host can leak sockets
        finally:
            done.set()

    async def add(self, *, client_mode=False, num_initial=2, validators=(), **node_kwargs):
        servers = [n for n in self.nodes if not n.config.client_mode]
        initial = []
        for node in random.sample(servers, min(num_initial, len(servers))):
            initial += node.p2p.get_visible_maddrs()
        node, stop, done = await self.nursery.start(
            self._run,
            initial,
            {"client_mode": client_mode, **NO_RELAY},
            {**FAST, **node_kwargs, "record_validators": list(validators)},
        )
        self.nodes.append(node)
        self._events[node] = (stop, done)
        return node

    async def kill(self, node: DHTNode) -> None:
        stop, done = self._events.pop(node)
        stop.set()
        await done.wait()
        self.nodes.remove(node)

    async def kill_all(self) -> None:
        for stop, _ in self._events.values():
            stop.set()
        for _, done in self._events.values():
            await done.wait()
        self._events.clear()
        self.nodes.clear()


@asynccontextmanager
async def swarm(num_nodes: int = 0, **node_kwargs):
    async with trio.open_nursery() as nursery:
        result = Swarm(nursery)
        for _ in range(num_nodes):
            await result.add(**node_kwargs)
        try:
            yield result
        finally:
            with trio.CancelScope(shield=True):
                await result.kill_all()


class FindCalls:
    """Records the find RPCs a node sends (the real calls still go out over loopback)."""

    def __init__(self, node: DHTNode):
        self.calls: list[tuple[object, list[DHTID]]] = []
        self.max_nearest_peers: list[int | None] = []
        original = node.protocol.call_find

        async def call_find(peer_id, key_ids, max_nearest_peers=None):
            self.calls.append((peer_id, list(key_ids)))
            self.max_nearest_peers.append(max_nearest_peers)
            return await original(peer_id, key_ids, max_nearest_peers)

        node.protocol.call_find = call_find


def plain(found):
    """A found dictionary value as {subkey: value}."""
    return {subkey: item.value for subkey, item in found.value.items()}


def in_routing_table(node: DHTNode, other: DHTNode) -> bool:
    table = node.routing_table
    return other.node_id in table or table.get_node_id(other.p2p.peer_id) is not None


# ------------------------------------------------------------------ trio tests


@pytest.mark.trio
async def test_two_peers_store_get():
    async with swarm(2) as s:
        a, b = s.nodes
        assert in_routing_table(a, b) and in_routing_table(b, a)
        assert await a.store("key", {"answer": 42, "list": [1, b"2"]}, get_dht_time() + 30)
        found = await b.get("key")
        assert found is not None and found.value == {"answer": 42, "list": [1, b"2"]}
        _, expiration = found
        assert expiration > get_dht_time()
        assert await b.get("missing") is None
        # a later write replaces the value; an older one is rejected
        assert await b.store("key", "newer", get_dht_time() + 60)
        assert not await b.store("key", "older", get_dht_time() + 10)
        assert (await a.get("key", latest=True)).value == "newer"


@pytest.mark.trio
async def test_32_peers_store_on_one_read_on_all():
    async with swarm(32, bucket_size=4, num_replicas=3) as s:
        assert all(len(node.routing_table) > 0 for node in s.nodes)
        writers = random.sample(s.nodes, 3)
        for i, writer in enumerate(writers):
            assert await writer.store(f"key{i}", i, get_dht_time() + 60)

        results = []
        for node in s.nodes:
            for i in range(len(writers)):
                found = await node.get(f"key{i}")
                results.append(found is not None and found.value == i)
        assert results == [True] * (32 * len(writers))


@pytest.mark.trio
async def test_records_expire():
    async with swarm(3) as s:
        a, b, c = s.nodes
        expiration = get_dht_time() + 1.0
        assert await a.store("short-lived", "soon gone", expiration)
        assert (await c.get("short-lived")).value == "soon gone"  # c caches it, too
        await trio.sleep(max(0.0, expiration - get_dht_time()) + 0.05)
        assert await b.get("short-lived", latest=True) is None
        assert await c.get("short-lived") is None
        assert not await a.store("already expired", 1, get_dht_time() - 1)


@pytest.mark.trio
async def test_subkeys_merged_from_several_writers():
    async with swarm(6, num_replicas=3) as s:
        writers, reader = s.nodes[:4], s.nodes[5]
        expiration = get_dht_time() + 60
        for i, writer in enumerate(writers):
            assert await writer.store("group", {"rank": i}, expiration + i, subkey=f"peer{i}")
        found = await reader.get("group")
        assert found is not None
        assert {k: v.value for k, v in found.value.items()} == {
            f"peer{i}": {"rank": i} for i in range(4)
        }
        assert found.expiration_time == expiration + 3
        assert found.value["peer2"].expiration_time == expiration + 2
        # a regular value never replaces live subkeys, however late it expires (#17.3)
        assert not await writers[0].store("group", "flat", expiration + 100)
        found = await s.nodes[4].get("group", latest=True)
        assert isinstance(found.value, dict) and len(found.value) == 4


@pytest.mark.trio
async def test_latest_searches_all_replicas():
    async with swarm(8, num_replicas=3) as s:
        writer = s.nodes[0]
        assert await writer.store("model", "v1", get_dht_time() + 30)
        key = serialize("model")
        key_id = DHTID.from_serialized_key(key)
        # the farthest of the num_replicas nodes nearest to the key (the writer may be one)
        replicas = (await writer.find_nearest_nodes([key_id], k=3))[key_id]
        _, farthest_peer = list(replicas.items())[-1]
        newer = StoreItem(key, None, serialize("v2"), get_dht_time() + 60)
        if farthest_peer == writer.p2p.peer_id:
            assert writer.protocol.store_locally([newer]) == [True]
        else:
            assert await writer.protocol.call_store(farthest_peer, [newer]) == [True]

        reader = await s.add(client_mode=True)
        assert (await reader.get("model")).value in ("v1", "v2")
        assert (await reader.get("model", latest=True)).value == "v2"


@pytest.mark.trio
async def test_latest_reads_the_nearest_replicas_and_stops_there():
    # no caches: every answer comes from a replica's storage
    async with swarm(12, num_replicas=3, cache_locally=False, cache_nearest=0) as s:
        expiration = get_dht_time() + 60
        keys = [f"model{i}" for i in range(3)]
        for i, key in enumerate(keys):
            assert await s.nodes[i].store(key, "v1", expiration)
            key_id = DHTID.from_serialized_key(serialize(key))
            replicas = sorted(s.nodes, key=lambda node: node.node_id ^ key_id)[:3]
            assert all(r.protocol.lookup_locally(key_id, get_dht_time()) for r in replicas)
            # a newer value on one replica only, the nearest, the middle or the farthest
            newer = StoreItem(serialize(key), None, serialize("v2"), expiration + 10)
            assert replicas[i].protocol.store_locally([newer]) == [True]
        num_calls = []
        for reader in s.nodes:  # replicas among them: they count themselves without an RPC
            spy = FindCalls(reader)
            for key in keys:
                spy.calls.clear()
                assert (await reader.get(key, latest=True)).value == "v2"
                called = [peer for peer, _ in spy.calls]
                assert len(called) == len(set(called)) and reader.p2p.peer_id not in called
                num_calls.append(len(called))
        # the 3 replicas (fewer when the reader is one), not all 11 other nodes as before
        assert max(num_calls) <= 6 and sum(num_calls) / len(num_calls) < 4


@pytest.mark.trio
async def test_find_lists_as_many_nearest_peers_as_the_caller_asks():
    async with swarm(10) as s:
        node = s.nodes[0]
        find = node.protocol.method_name("rpc_find")
        await s.nodes[1].find_nearest_nodes([node.node_id])  # everyone knows node 0
        async with P2P.create(node.p2p.get_visible_maddrs(), **NO_RELAY) as raw:
            keys = [DHTID.generate().to_bytes() for _ in range(3)]

            async def nearest(**kwargs) -> list[list[bytes]]:
                request = dht_pb2.DHTFindRequest(keys=keys, **kwargs)  # a client: no node id
                response = await raw.call_protobuf_handler(
                    node.p2p.peer_id, find, request, dht_pb2.DHTFindResponse
                )
                return [[peer.node_id for peer in r.nearest_peers] for r in response.results]

            everyone = await nearest()  # an older caller: as many as the bucket holds
            assert all(len(peers) == len(node.routing_table) >= 5 for peers in everyone)
            assert await nearest(max_nearest_peers=3) == [peers[:3] for peers in everyone]
            assert await nearest(max_nearest_peers=1000) == everyone

        # a search asks each peer for as many nodes as it keeps: a latest get for num_replicas
        reader = s.nodes[-1]
        spy = FindCalls(reader)
        assert await s.nodes[2].store("key", "value", get_dht_time() + 60)
        assert (await reader.get("key", latest=True)).value == "value"
        assert spy.max_nearest_peers and set(spy.max_nearest_peers) == {reader.config.num_replicas}
        spy.max_nearest_peers.clear()
        await reader.find_nearest_nodes([DHTID.generate()], k=7)
        assert spy.max_nearest_peers and set(spy.max_nearest_peers) == {7}


def test_latest_beam_size_defaults_to_num_replicas():
    assert DHTNodeConfig(num_replicas=4).latest_beam_size == 4
    assert DHTNodeConfig(num_replicas=4, latest_beam_size=20).latest_beam_size == 20
    for bad in (3, 21, 4.0, True):
        with pytest.raises(ValueError, match="latest_beam_size"):
            DHTNodeConfig(num_replicas=4, latest_beam_size=bad)


@pytest.mark.trio
async def test_get_many_asks_each_peer_about_several_keys():
    async with swarm(10, num_replicas=3) as s:
        expiration = get_dht_time() + 60
        keys = [f"key{i}" for i in range(6)]
        for i, key in enumerate(keys):
            for j, writer in enumerate(s.nodes[:3]):  # subkeys from several writers
                assert await writer.store(key, 10 * i + j, expiration + j, subkey=f"w{j}")
        assert await s.nodes[3].store("plain", "value", expiration)
        everything = [*keys, "plain", "missing"]
        reader = await s.add(client_mode=True)
        spy = FindCalls(reader)
        found = await reader.get_many(everything, latest=True)
        assert set(found) == set(everything)
        assert found["missing"] is None and found["plain"].value == "value"
        for i, key in enumerate(keys):
            assert plain(found[key]) == {f"w{j}": 10 * i + j for j in range(3)}
            assert found[key].expiration_time == expiration + 2
        assert max(len(key_ids) for _, key_ids in spy.calls) > 1
        batched = len(spy.calls)

        spy.calls.clear()
        for key in everything:
            one = await reader.get(key, latest=True)
            if key in keys:
                assert plain(one) == plain(found[key])
            else:
                assert one == found[key]
        assert batched < len(spy.calls)
        assert await reader.get_many([]) == {}


@pytest.mark.trio
async def test_client_mode_node_stores_and_gets_but_is_not_routed_to():
    async with swarm(4) as s:
        client = await s.add(client_mode=True, num_initial=3)
        assert client.config.client_mode and len(client.routing_table) > 0
        assert await client.store("from client", [1, 2, 3], get_dht_time() + 30)
        assert (await s.nodes[0].get("from client")).value == [1, 2, 3]
        assert await s.nodes[1].store("for client", "hello", get_dht_time() + 30)
        assert (await client.get("for client")).value == "hello"
        assert len(client.protocol.storage) == 0  # a client never holds replicas
        for node in s.nodes:
            if node is not client:
                assert not in_routing_table(node, client)
        assert client.p2p.statistics()["handlers"] == []


@pytest.mark.trio
async def test_nodes_without_validators_keep_and_check_signed_records():
    """Replicas whose owners added no validator still store, verify and return signed records
    (they used to reject them as malformed values)."""
    signer = Ed25519SignatureValidator()
    async with swarm() as s:
        for _ in range(4):
            await s.add()
        owner = await s.add(validators=[signer])
        key = b"progress"
        subkey = signer.local_public_key
        assert await owner.store(key, {"epoch": 3}, get_dht_time() + 30, subkey=subkey)
        replicas = [
            node
            for node in s.nodes[:4]
            if node.protocol.lookup_locally(DHTID.generate(key), get_dht_time()) is not None
        ]
        assert replicas  # the plain nodes hold it
        for node in s.nodes[:4]:
            found = await node.get(key, latest=True)
            assert found is not None and found.value[subkey].value == {"epoch": 3}
        forged = await s.nodes[0].store(key, {"epoch": 9}, get_dht_time() + 60, subkey=subkey)
        assert not forged  # unsigned: every node checks the owner's signature
        assert (await s.nodes[1].get(key, latest=True)).value[subkey].value == {"epoch": 3}


def test_an_added_signature_validator_signs_instead_of_the_nodes_verifier():
    given = Ed25519SignatureValidator(Ed25519PrivateKey.generate())
    composite = CompositeValidator([Ed25519SignatureValidator.verifier(), given])
    (kept,) = composite.validators
    assert kept.local_public_key == given.local_public_key
    first = Ed25519SignatureValidator(Ed25519PrivateKey.generate())
    second = Ed25519SignatureValidator(Ed25519PrivateKey.generate())
    (kept,) = CompositeValidator([first, second]).validators  # two of the user's: first wins
    assert kept.local_public_key == first.local_public_key


@pytest.mark.trio
async def test_third_party_cannot_overwrite_a_signed_record():
    validators = {}

    async with swarm() as s:
        for _ in range(5):
            validator = Ed25519SignatureValidator(Ed25519PrivateKey.generate())
            node = await s.add(validators=[validator])
            validators[node] = validator
        owner, reader, attacker = s.nodes[0], s.nodes[1], s.nodes[2]
        key = b"owned by " + validators[owner].local_public_key
        assert await owner.store(key, "original", get_dht_time() + 30)
        assert not await attacker.store(key, "forged", get_dht_time() + 300)
        # replaying the owner's signature on another value or expiration fails as well
        stored = owner.protocol.lookup_locally(DHTID.generate(key), get_dht_time())
        signed = stored.value if stored is not None else None
        if signed is None:  # owner is not a replica: take the signed bytes from a replica
            for node in s.nodes:
                found = node.protocol.lookup_locally(DHTID.generate(key), get_dht_time())
                if found is not None:
                    signed = found.value
        assert signed is not None and b"[signature:" in signed
        forged = [
            StoreItem(serialize(key), None, signed, get_dht_time() + 300),
            StoreItem(
                serialize(key), None, serialize("forged") + signed[-100:], get_dht_time() + 300
            ),
        ]
        for node in s.nodes:
            if node is not attacker:
                assert await attacker.protocol.call_store(node.p2p.peer_id, forged) == [
                    False,
                    False,
                ]
        assert (await reader.get(key, latest=True)).value == "original"
        # subkeys carrying the owner marker are protected the same way
        subkey = b"rank0" + validators[attacker].local_public_key
        assert await attacker.store("peers", "mine", get_dht_time() + 30, subkey=subkey)
        assert not await owner.store("peers", "not mine", get_dht_time() + 60, subkey=subkey)
        found = await reader.get("peers", latest=True)
        assert found.value[subkey].value == "mine"


class Schema(pydantic.BaseModel):
    counter: int
    scores: dict[str, float]


@pytest.mark.trio
async def test_schema_rejects_bad_types():
    async with swarm() as s:
        for _ in range(3):
            await s.add(validators=[SchemaValidator(Schema, allow_extra_keys=False)])
        a, b, c = s.nodes
        assert await a.store("counter", 5, get_dht_time() + 30)
        assert not await a.store("counter", "five", get_dht_time() + 60)
        assert not await a.store("counter", 5.0, get_dht_time() + 60)
        assert not await a.store("unknown", 1, get_dht_time() + 30)
        assert await b.store("scores", 0.5, get_dht_time() + 30, subkey="alice")
        assert not await b.store("scores", "high", get_dht_time() + 30, subkey="bob")
        assert (await c.get("counter", latest=True)).value == 5
        assert set((await c.get("scores", latest=True)).value) == {"alice"}
        # a peer without the schema cannot push a bad record into nodes that have it
        bad = StoreItem(serialize("counter"), None, serialize("five"), get_dht_time() + 90)
        outsider = await s.add()
        assert await outsider.protocol.call_store(a.p2p.peer_id, [bad]) == [False]
        assert (await c.get("counter", latest=True)).value == 5


@pytest.mark.trio
async def test_killed_nodes_do_not_lose_replicated_records():
    async with swarm(10, num_replicas=5) as s:
        keys = [f"key{i}" for i in range(5)]
        for i, key in enumerate(keys):
            assert await s.nodes[i].store(key, i, get_dht_time() + 60)
        reader = s.nodes[-1]
        key_id = DHTID.generate(keys[0])
        nearest = (await reader.find_nearest_nodes([key_id], k=5, exclude_self=True))[key_id]
        victims = [node for node in s.nodes if node.node_id in list(nearest)[:3]]
        async with trio.open_nursery() as nursery:
            for victim in victims:
                nursery.start_soon(s.kill, victim)
        for node in s.nodes:
            for i, key in enumerate(keys):
                found = await node.get(key, latest=True)
                assert found is not None and found.value == i
        # the reader met the dead replicas: a dead node looks like a slow one, so each stays
        # in its routing table, stale (ranked after live nodes, backed off), until a
        # replacement turns up or it answers again
        for victim in victims:
            assert in_routing_table(reader, victim) and reader.routing_table.is_stale(
                victim.node_id
            )


@pytest.mark.trio
async def test_malformed_rpc_payloads_are_rejected_cleanly():
    async with swarm(1) as s:
        node = s.nodes[0]
        store = node.protocol.method_name("rpc_store")
        find = node.protocol.method_name("rpc_find")
        ping = node.protocol.method_name("rpc_ping")
        async with P2P.create(node.p2p.get_visible_maddrs()) as raw:
            raw_id = DHTID.from_peer_id(raw.peer_id).to_bytes()
            me = dht_pb2.DHTNodeInfo(node_id=raw_id, maddrs=raw.get_visible_maddrs())
            expiration = get_dht_time() + 30

            def store_request(value=b"\x01", key=serialize("k"), subkey=b"", **kwargs):
                return dht_pb2.DHTStoreRequest(
                    keys=[key],
                    subkeys=[subkey],
                    values=[value],
                    expiration_time=[kwargs.get("expiration_time", expiration)],
                    peer=kwargs.get("peer", me),
                )

            bad_requests = {
                "not msgpack": store_request(value=b"\xc1"),
                "truncated msgpack": store_request(value=serialize("abc")[:-1]),
                "too large": store_request(
                    value=serialize(b"x" * (2 * 1024 * 1024), max_size=None)
                ),
                "bad key": store_request(key=b"\xc1"),
                "bad subkey": store_request(subkey=b"\x92\x01"),
                "infinite": store_request(expiration_time=float("inf")),
                "lengths": dht_pb2.DHTStoreRequest(keys=[serialize("k")], peer=me),
                "bad node id": store_request(peer=dht_pb2.DHTNodeInfo(node_id=b"short")),
                "foreign maddr": store_request(
                    peer=dht_pb2.DHTNodeInfo(
                        node_id=raw_id, maddrs=[f"/ip4/1.2.3.4/tcp/1/p2p/{node.p2p.peer_id}"]
                    )
                ),
            }
            for reason, request in bad_requests.items():
                with pytest.raises(RemoteError) as info:
                    await raw.call_protobuf_handler(
                        node.p2p.peer_id, store, request, dht_pb2.DHTStoreResponse
                    )
                assert info.value.error_type == "MalformedRequestError", reason
            # a node id the caller did not derive from its peer id (a Sybil's chosen place)
            chosen = dht_pb2.DHTNodeInfo(node_id=DHTID.generate().to_bytes())
            for method, request, response_type in (
                (store, store_request(peer=chosen), dht_pb2.DHTStoreResponse),
                (find, dht_pb2.DHTFindRequest(keys=[raw_id], peer=chosen), dht_pb2.DHTFindResponse),
                (ping, dht_pb2.DHTPingRequest(peer=chosen), dht_pb2.DHTPingResponse),
            ):
                with pytest.raises(RemoteError, match="not the node id of") as info:
                    await raw.call_protobuf_handler(
                        node.p2p.peer_id, method, request, response_type
                    )
                assert info.value.error_type == "NodeIdMismatchError"
            with pytest.raises(RemoteError, match="20 bytes"):
                await raw.call_protobuf_handler(
                    node.p2p.peer_id,
                    find,
                    dht_pb2.DHTFindRequest(keys=[b"short"], peer=me),
                    dht_pb2.DHTFindResponse,
                )
            with pytest.raises(MessageTooLargeError):
                await raw.call_protobuf_handler(
                    node.p2p.peer_id,
                    store,
                    store_request(value=b"x" * (9 * 1024 * 1024)),
                    dht_pb2.DHTStoreResponse,
                )
            # nothing was stored and the caller was not added to the routing table
            assert len(node.protocol.storage) == 0 and len(node.routing_table) == 0
            # a well-formed request from the same peer still works
            good = store_request(value=serialize("fine"))
            response = await raw.call_protobuf_handler(
                node.p2p.peer_id, store, good, dht_pb2.DHTStoreResponse
            )
            assert list(response.store_ok) == [True]
            assert (await node.get("k")).value == "fine"
            assert DHTID.from_bytes(raw_id) in node.routing_table


@pytest.mark.trio
async def test_bucket_refresh_runs_in_the_background():
    async with swarm(2, refresh_timeout=0.1) as s:
        await trio.sleep(0.3)
        assert all(node.statistics().num_bucket_refreshes >= 1 for node in s.nodes)


@pytest.mark.trio
async def test_a_node_whose_initial_peer_did_not_answer_joins_it_later(monkeypatch):
    """A bootstrap that failed (the initial peer reachable but its DHT not answering: not
    started yet, or too slow under load) is retried in the background while the routing
    table is empty, instead of leaving the node a DHT of its own for good."""
    monkeypatch.setattr(node_maintenance, "REJOIN_FIRST_DELAY", 0.2)
    async with P2P.create(use_autonat=False) as first_p2p:  # no DHT on it yet
        initial = [str(a) for a in first_p2p.get_visible_maddrs()]
        async with DHT.create(initial, use_autonat=False, wait_timeout=2.0) as late:
            assert late.node.statistics().routing_table.num_nodes == 0  # nobody answered
            # (bootstrapped from another node: it does not ping the late one by itself)
            async with (
                DHT.create(use_autonat=False) as hub,
                DHTNode.create(first_p2p, [str(a) for a in hub.get_visible_maddrs()]) as first,
            ):
                with trio.fail_after(30):
                    await wait_until(lambda: in_routing_table(late.node, first))
                assert late.node.statistics().num_rejoins >= 1
                assert await first.store("joined", "yes", get_dht_time() + 30)
                assert (await late.get("joined", latest=True)).value == "yes"


@pytest.mark.trio
async def test_trio_dht_create():
    async with DHT.create(wait_timeout=2.0) as first:
        async with DHT.create(first.get_visible_maddrs(), client_mode=True) as second:
            assert await second.store("trio", "path", get_dht_time() + 30)
            assert (await first.get("trio")).value == "path"

            async def node_id(dht, node):
                return dht.peer_id, node.node_id

            assert await first.run_coroutine(node_id) == (first.peer_id, first.node.node_id)


# ------------------------------------------------------------- blocking facade


def background_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]


def test_blocking_dht_facade():
    threads_before = set(background_threads())
    first = DHT(wait_timeout=2.0)
    with DHT(initial_peers=first.get_visible_maddrs(), wait_timeout=2.0) as second:
        assert second.store("blocking", [1, 2], get_dht_time() + 30)
        assert first.get("blocking").value == [1, 2]
        future = first.store("future", "yes", get_dht_time() + 30, return_future=True)
        assert future.result(timeout=30) is True
        assert second.get("future", return_future=True).result(timeout=30).value == "yes"
        assert second.store("d", 1, get_dht_time() + 30, subkey="a")
        assert set(first.get("d", latest=True).value) == {"a"}
        many = first.get_many(["d", "blocking", "none"], latest=True)
        assert set(many["d"].value) == {"a"} and many["blocking"].value == [1, 2]
        assert many["none"] is None

        async def count_nodes(dht, node):
            await trio.lowlevel.checkpoint()
            return len(node.routing_table)

        assert first.run_coroutine(count_nodes) == 1

        async def from_asyncio():
            assert await second.aio.store("aio", "ok", get_dht_time() + 30)
            assert (await first.aio.get_many(["aio"]))["aio"].value == "ok"
            return (await first.aio.get("aio")).value

        assert asyncio.run(from_asyncio()) == "ok"
    first.shutdown()
    first.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        first.get("blocking")
    assert BackgroundRuntime.active_references() == 0
    deadline = time.monotonic() + 5
    while set(background_threads()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(background_threads()) - threads_before == set()
