"""Issue 17.3 (audit 9) against real peers: node ids are bound to peer ids, so a Sybil cannot
sit next to a key it wants to censor.

The attackers are raw hosts that speak the DHT protocol by hand (as modified code would): each
announces a node id next to the key, acknowledges every store and drops it, and answers every
find with the other attackers' made-up (node id, peer id) pairs. Before node ids were bound,
five of them took the five places nearest to the key: the writer's update was lost and a reader
got the stale value.
"""

from __future__ import annotations

import pytest
import trio
from test_dht_node import FAST, NO_RELAY, swarm

from swarmtrain.dht import DHT, DHTID, DHTNode, get_dht_time
from swarmtrain.dht.protocol import NodeIdMismatchError
from swarmtrain.p2p import P2P, PeerID, RemoteError
from swarmtrain.proto import dht_pb2

KEY = "run_progress"
PREFIX = "swarmtrain::DHTProtocol."


class Sybil:
    """A raw host that claims ``claimed_id`` and answers the DHT RPCs as an attacker."""

    def __init__(self, p2p: P2P, claimed_id: DHTID):
        self.p2p, self.claimed_id = p2p, claimed_id
        self.others: list[Sybil] = []  # listed in every find answer, with their claimed ids
        self.stores_dropped = 0
        for method, handler, request_type in (
            ("rpc_ping", self.rpc_ping, dht_pb2.DHTPingRequest),
            ("rpc_store", self.rpc_store, dht_pb2.DHTStoreRequest),
            ("rpc_find", self.rpc_find, dht_pb2.DHTFindRequest),
        ):
            p2p.add_protobuf_handler(PREFIX + method, handler, request_type)

    def info(self) -> dht_pb2.DHTNodeInfo:
        return dht_pb2.DHTNodeInfo(
            node_id=self.claimed_id.to_bytes(), maddrs=self.p2p.get_visible_maddrs()
        )

    async def rpc_ping(self, request, context):
        return dht_pb2.DHTPingResponse(peer=self.info(), dht_time=get_dht_time())

    async def rpc_store(self, request, context):
        self.stores_dropped += len(request.keys)
        return dht_pb2.DHTStoreResponse(store_ok=[True] * len(request.keys), peer=self.info())

    async def rpc_find(self, request, context):
        response = dht_pb2.DHTFindResponse(peer=self.info())
        for _ in request.keys:
            result = response.results.add()
            for other in self.others:
                result.nearest_peers.add(
                    node_id=other.claimed_id.to_bytes(),
                    peer_id=other.p2p.peer_id.to_bytes(),
                    maddrs=other.p2p.get_visible_maddrs(),
                )
        return response

    async def announce(self, peer_id: PeerID) -> str | None:
        """Ping an honest node with our claimed id; the error type it answers with, if any."""
        try:
            await self.p2p.call_protobuf_handler(
                peer_id,
                PREFIX + "rpc_ping",
                dht_pb2.DHTPingRequest(peer=self.info()),
                dht_pb2.DHTPingResponse,
                timeout=5.0,
            )
        except RemoteError as e:
            return e.error_type
        return None


async def run_sybil(initial_peers, claimed_id, ready: list, stop: trio.Event, *, task_status):
    async with P2P.create(initial_peers, **NO_RELAY) as p2p:
        sybil = Sybil(p2p, claimed_id(p2p))
        ready.append(sybil)
        task_status.started()
        await stop.wait()  # leave the host's `async with` normally (no leaked sockets)


@pytest.mark.trio
async def test_sybil_ids_next_to_a_key_cannot_censor_it():
    key_id = DHTID.generate(KEY)
    async with swarm(3) as s, trio.open_nursery() as nursery:
        writer, reader = s.nodes[0], s.nodes[1]
        assert await writer.store(KEY, "before", get_dht_time() + 60)
        entry = [maddr for node in s.nodes for maddr in node.p2p.get_visible_maddrs()]
        sybils: list[Sybil] = []
        stop = trio.Event()
        for i in range(5):  # the five places nearest to the key, as in the audit
            await nursery.start(
                run_sybil, entry, lambda _p2p, i=i: DHTID(key_id ^ (i + 1)), sybils, stop
            )
        # one more attacker keeps its honest node id (so it is let in) and lists the five
        await nursery.start(
            run_sybil, entry, lambda p2p: DHTID.from_peer_id(p2p.peer_id), sybils, stop
        )
        lister = sybils[-1]
        for sybil in sybils:
            sybil.others = [other for other in sybils[:5] if other is not sybil]
        try:
            honest = [node.p2p.peer_id for node in s.nodes]
            for sybil in sybils[:5]:
                for peer_id in honest:
                    assert await sybil.announce(peer_id) == NodeIdMismatchError.__name__
            for peer_id in honest:
                assert await lister.announce(peer_id) is None
            assert all(lister.claimed_id in node.routing_table for node in s.nodes)
            # asked directly, a Sybil's answer (with its claimed id) is ignored and it is banned
            target = sybils[0].p2p.peer_id
            assert await writer.protocol.call_ping(target) is None
            assert writer.protocol.blacklist.is_banned(target, get_dht_time())
            assert writer.routing_table.get_node_id(target) is None

            assert await writer.store(KEY, "after", get_dht_time() + 61)
            found = await reader.get(KEY, latest=True)
            assert found is not None and found.value == "after"
            newcomer = await s.add()  # a node that joins now
            found = await newcomer.get(KEY, latest=True)
            assert found is not None and found.value == "after"

            fake = {sybil.p2p.peer_id for sybil in sybils[:5]}
            for node in s.nodes:
                nearest = await node.find_nearest_nodes([key_id], k=5)
                assert not fake & set(nearest[key_id].values())
                assert not any(node.routing_table.get_node_id(p) for p in fake)
                assert all(n.is_node_id_of(p) for n, p in node.routing_table)
            assert sum(sybil.stores_dropped for sybil in sybils[:5]) == 0
            # the reader met the lister in its search, dropped its pairs and stopped asking it
            assert reader.routing_table.get_node_id(lister.p2p.peer_id) is None
            assert reader.protocol.blacklist.is_banned(lister.p2p.peer_id, get_dht_time())
        finally:
            stop.set()


@pytest.mark.trio
async def test_node_id_is_derived_from_the_peer_id():
    async with P2P.create(**NO_RELAY) as p2p:
        own = DHTID.from_peer_id(p2p.peer_id)
        async with DHTNode.create(p2p, **FAST) as node:
            assert node.node_id == own == node.protocol.node_id
        async with DHTNode.create(p2p, node_id=own, **FAST) as node:  # hivemind's keyword
            assert node.node_id == own
        with pytest.raises(ValueError, match="derived from peer ids"):
            async with DHTNode.create(p2p, node_id=DHTID(own ^ 1), **FAST):
                pass
    with pytest.raises(ValueError, match="derived from peer ids"):
        async with DHT.create(node_id=DHTID.generate(), **NO_RELAY):
            pass
