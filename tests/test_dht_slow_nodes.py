"""Real DHT nodes on loopback: one that answers too late for a while is kept (issue #18), one
that answers wrongly is banned and dropped at once.

At load >= 18 every DHT RPC between three in-process nodes timed out; each timeout used to
drop the peer from the routing table, so the nodes isolated themselves and reads saw only the
reader's own records. A node that misses deadlines now stays in the routing tables (stale,
backed off) and is read again as soon as it answers; misbehaviour still costs the peer its
place at once.
"""

from __future__ import annotations

import pytest
import trio
from polling import read_until_found
from test_dht_node import FAST, in_routing_table, swarm

from swarmtrain.dht import DHTID, DHTNode, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.proto import dht_pb2

#: polling interval of the read loops below (each read is a real lookup)
POLL = 0.1


class TamperedAnswers:
    """Serves one node's DHT RPCs through ``change(method, response)`` (the real handlers
    still answer): a node made slow (``late``), or a node that starts to lie."""

    def __init__(self, node: DHTNode, delay: float = 0.0, change=None):
        self.delay, self.change = delay, change
        self.late = False
        self.late_requests: dict[object, int] = {}  # per caller
        protocol = node.protocol
        for method, handler, request_type in (
            ("rpc_ping", protocol.rpc_ping, dht_pb2.DHTPingRequest),
            ("rpc_store", protocol.rpc_store, dht_pb2.DHTStoreRequest),
            ("rpc_find", protocol.rpc_find, dht_pb2.DHTFindRequest),
        ):
            node.p2p.add_protobuf_handler(
                protocol.method_name(method),
                self._serve(method, handler),
                request_type,
                max_message_size=protocol.limits.max_message_size,
                replace=True,
            )

    def _serve(self, method: str, handler):
        async def serve(request, context):
            if self.late:
                caller = context.remote_id
                self.late_requests[caller] = self.late_requests.get(caller, 0) + 1
                await trio.sleep(self.delay)  # the slowness under test: past wait_timeout
            response = await handler(request, context)
            return self.change(method, response) if self.change is not None else response

        return serve


def store_only_on(node: DHTNode, key: str, value) -> None:
    """A record that only ``node`` holds (its only replica; read it only when that must
    succeed: a read caches it on the reader and another node)."""
    item = StoreItem(serialize(key), None, serialize(value), get_dht_time() + 120)
    assert node.protocol.store_locally([item]) == [True]


@pytest.mark.trio
async def test_a_node_answering_late_for_a_while_is_kept_and_read_again():
    async with swarm(3) as s:
        reader, honest, slow = s.nodes
        store_only_on(slow, "on_slow", "slow's")
        store_only_on(honest, "on_honest", "honest's")
        assert in_routing_table(reader, slow) and in_routing_table(honest, slow)
        answers = TamperedAnswers(slow, delay=2 * FAST["wait_timeout"])
        answers.late = True
        with trio.fail_after(90):
            # both others time out on it, several times: nobody is left who answered it
            while min(answers.late_requests.get(n.p2p.peer_id, 0) for n in (reader, honest)) < 2:
                for node in (reader, honest):
                    assert await node.get("on_slow", latest=True) is None
                # the others keep working meanwhile, and nobody forgets the slow node
                assert (await reader.get("on_honest", latest=True)).value == "honest's"
                assert in_routing_table(reader, slow) and in_routing_table(honest, slow)
                await trio.sleep(POLL)
        assert reader.routing_table.is_stale(slow.node_id)
        assert reader.protocol.blacklist.is_banned(slow.p2p.peer_id, get_dht_time()) is False
        answers.late = False
        # it answers again: the reader reads it without any rejoin (it was never alone)
        with trio.fail_after(30):
            found = await read_until_found(lambda: reader.get("on_slow", latest=True), POLL)
        assert found.value == "slow's"
        assert not reader.routing_table.is_stale(slow.node_id)
        assert all(node.statistics().num_rejoins == 0 for node in s.nodes)


def lie_about_node_id(liar: DHTNode, claimed: DHTID):
    def change(method, response):
        response.peer.node_id = claimed.to_bytes()
        return response

    return change


def answer_one_result_too_many(method, response):
    if method == "rpc_find":
        response.results.add()
    elif method == "rpc_store":
        response.store_ok.append(True)
    return response


@pytest.mark.trio
@pytest.mark.parametrize("lie", ["wrong node id", "one result too many"])
async def test_a_node_that_starts_lying_is_banned_and_dropped_at_once(lie):
    async with swarm(3) as s:
        reader, honest, liar = s.nodes
        store_only_on(liar, "on_liar", "liar's")
        store_only_on(honest, "on_honest", "honest's")
        assert in_routing_table(reader, liar)
        change = (
            lie_about_node_id(liar, honest.node_id)
            if lie == "wrong node id"
            else answer_one_result_too_many
        )
        TamperedAnswers(liar, change=change)
        # one read that asks the liar: its answer is thrown away, it is banned and dropped
        assert await reader.get("on_liar", latest=True) is None
        assert not in_routing_table(reader, liar)
        assert reader.protocol.blacklist.is_banned(liar.p2p.peer_id, get_dht_time())
        # honest nodes keep working with each other
        assert (await reader.get("on_honest", latest=True)).value == "honest's"
        assert await reader.store("after", 1, get_dht_time() + 60)
        assert (await honest.get("after", latest=True)).value == 1
        assert in_routing_table(reader, honest) and not reader.routing_table.is_stale(
            honest.node_id
        )


@pytest.mark.trio
async def test_a_node_whose_only_contact_is_slow_keeps_asking_it():
    """Backoffs only steer lookups toward fresh nodes: a node with none left asks its stale
    contacts anyway (a long backoff here, so the second read falls inside it)."""
    async with swarm(2, blacklist_time=30.0) as s:
        alone, slow = s.nodes
        store_only_on(slow, "on_slow", "slow's")
        answers = TamperedAnswers(slow, delay=2 * FAST["wait_timeout"])
        answers.late = True
        with trio.fail_after(60):
            assert await alone.get("on_slow", latest=True) is None
            assert answers.late_requests == {alone.p2p.peer_id: 1}
            assert alone.protocol.blacklist.is_backed_off(slow.p2p.peer_id, get_dht_time())
            assert alone.routing_table.num_fresh_nodes() == 0 and in_routing_table(alone, slow)
            answers.late = False
            found = await alone.get("on_slow", latest=True)  # asked despite the backoff
        assert found is not None and found.value == "slow's"
        assert answers.late_requests == {alone.p2p.peer_id: 1}
        assert not alone.protocol.blacklist.is_backed_off(slow.p2p.peer_id, get_dht_time())
        assert alone.routing_table.num_fresh_nodes() == 1


@pytest.mark.trio
async def test_three_nodes_whose_rpcs_all_time_out_for_a_while_keep_each_other():
    """Issue #18 itself: at load >= 18 every RPC between three nodes timed out for a while;
    each node dropped the others and read only its own records afterwards."""
    async with swarm(3) as s:
        for i, node in enumerate(s.nodes):
            store_only_on(node, f"on_{i}", i)
        answers = [TamperedAnswers(node, delay=2 * FAST["wait_timeout"]) for node in s.nodes]
        for node_answers in answers:
            node_answers.late = True
        with trio.fail_after(90):
            while min(sum(a.late_requests.values()) for a in answers) < 4:
                async with trio.open_nursery() as nursery:
                    for i, node in enumerate(s.nodes):
                        nursery.start_soon(node.get, f"on_{(i + 1) % 3}", True)
                assert all(len(node.routing_table) == 2 for node in s.nodes)
                await trio.sleep(POLL)
        assert all(node.routing_table.num_fresh_nodes() == 0 for node in s.nodes)
        for node_answers in answers:
            node_answers.late = False
        with trio.fail_after(60):
            for node in s.nodes:
                for i in range(3):
                    found = await read_until_found(
                        lambda: node.get(f"on_{i}", latest=True),  # noqa: B023 (awaited here)
                        POLL,
                    )
                    assert found.value == i
