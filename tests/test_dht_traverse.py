import random
from collections.abc import Collection

import anyio
import pytest

from swarmtrain.dht import DHTID, RoutingTable, simple_traverse_dht, traverse_dht

NUM_NODES, BUCKET_SIZE = 300, 8


def make_graph(seed: int) -> dict[DHTID, RoutingTable[int]]:
    """A random DHT: every node's routing table saw every other node in a random order."""
    rng = random.Random(seed)
    ids = [DHTID(rng.getrandbits(160)) for _ in range(NUM_NODES)]
    graph = {}
    for node_id in ids:
        table: RoutingTable[int] = RoutingTable(node_id, bucket_size=BUCKET_SIZE)
        for other in rng.sample(ids, len(ids)):
            table.add_or_update_node(other, int(other), now=0)
        graph[node_id] = table
    return graph


GRAPH = make_graph(0)
NODES = list(GRAPH)


def brute_force(query: DHTID, k: int, nodes: Collection[DHTID] = NODES) -> list[DHTID]:
    return sorted(nodes, key=lambda node: node ^ query)[:k]


def neighbors_of(peer: DHTID, query: DHTID, k: int = 10) -> list[DHTID]:
    """What a peer answers: the k nodes nearest to query in its routing table (as in hivemind)."""
    return [node for node, _ in GRAPH[peer].get_nearest_neighbors(query, k)]


class Network:
    """get_neighbors over GRAPH, recording calls; ``dead`` peers do not answer."""

    def __init__(self, dead: Collection[DHTID] = (), delays: dict[DHTID, float] | None = None):
        self.dead, self.delays = set(dead), delays or {}
        self.calls: list[tuple[DHTID, list[DHTID]]] = []
        self.started = self.cancelled = 0

    async def get_neighbors(self, peer, queries):
        self.calls.append((peer, list(queries)))
        self.started += 1
        try:
            await anyio.sleep(self.delays.get(peer, 0))
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        if peer in self.dead:
            return None
        return {query: (neighbors_of(peer, query), False) for query in queries}


@pytest.mark.trio
@pytest.mark.parametrize(("num_workers", "queries_per_call"), [(1, 1), (4, 1), (8, 4)])
async def test_finds_true_nearest_neighbors(num_workers, queries_per_call):
    rng = random.Random(num_workers)
    queries = [DHTID(rng.getrandbits(160)) for _ in range(15)] + NODES[:5]
    network = Network()
    nearest, visited = await traverse_dht(
        queries,
        initial_nodes=rng.sample(NODES, 3),
        beam_size=10,
        num_workers=num_workers,
        queries_per_call=queries_per_call,
        get_neighbors=network.get_neighbors,
    )
    for query in queries:
        assert nearest[query] == brute_force(query, 10)
        assert set(nearest[query]) <= visited[query]
        assert visited[query] <= set(NODES)
    assert len({peer for peer, _ in network.calls}) < NUM_NODES  # it did not just visit all
    assert all(len(batch) <= queries_per_call for _, batch in network.calls)
    called = [(peer, query) for peer, batch in network.calls for query in batch]
    assert len(called) == len(set(called))  # never asks a peer about the same query twice


@pytest.mark.trio
async def test_simple_traverse_matches_brute_force():
    rng = random.Random(7)
    for _ in range(10):
        query = DHTID(rng.getrandbits(160))

        async def get_neighbors(peer, query=query):
            return neighbors_of(peer, query), False

        nearest, visited = await simple_traverse_dht(query, rng.sample(NODES, 2), 10, get_neighbors)
        assert nearest == brute_force(query, 10)
        assert set(nearest) <= visited


@pytest.mark.trio
async def test_unresponsive_nodes_are_skipped():
    rng = random.Random(11)
    dead = set(rng.sample(NODES, NUM_NODES // 5))
    alive = [node for node in NODES if node not in dead]
    queries = [DHTID(rng.getrandbits(160)) for _ in range(10)]
    network = Network(dead=dead)
    nearest, _ = await traverse_dht(
        queries, alive[:3] + sorted(dead)[:3], 8, 4, 2, network.get_neighbors
    )
    for query in queries:
        # dead nodes crowd the peers' answers, so the tail of the beam may miss a live node
        # that no live peer reports; the head must be exact and no dead node may be returned
        assert nearest[query][:5] == brute_force(query, 5, alive)
        assert len(nearest[query]) == 8 and not dead & set(nearest[query])
        assert nearest[query] == sorted(nearest[query], key=lambda node: node ^ query)
    # a dead peer is called at most once, whatever the number of queries
    dead_calls = [peer for peer, _ in network.calls if peer in dead]
    assert len(dead_calls) == len(set(dead_calls))

    async def simple_get_neighbors(peer):
        return None if peer in dead else (neighbors_of(peer, queries[0]), False)

    simple_nearest, _ = await simple_traverse_dht(queries[0], alive[:2], 8, simple_get_neighbors)
    assert simple_nearest[:5] == brute_force(queries[0], 5, alive)
    assert not dead & set(simple_nearest)


@pytest.mark.trio
async def test_should_stop_and_found_callback(autojump_clock):
    query = DHTID.generate("some key")
    holder = brute_force(query, 30)[20]  # a node on the way to the query's neighborhood
    slow = [node for node in NODES if node != holder]
    network = Network(delays={node: 1000.0 for node in slow} | {holder: 1.0})
    found = []

    async def get_neighbors(peer, queries):
        result = await network.get_neighbors(peer, queries)
        return {q: (neighbors, peer == holder) for q, (neighbors, _) in result.items()}

    async def found_callback(query_, nearest, visited):
        await anyio.sleep(5)
        found.append((query_, nearest, visited))

    start = anyio.current_time()
    nearest, visited = await traverse_dht(
        [query], [holder, *slow[:3]], 10, 4, 1, get_neighbors, found_callback=found_callback
    )
    assert anyio.current_time() - start == pytest.approx(6.0)  # callback awaited, slow calls not
    assert nearest[query] == [holder] and holder in visited[query]
    assert found == [(query, [holder], visited[query])]
    assert network.started == 4 and network.cancelled == 3  # in-flight calls were cancelled


@pytest.mark.trio
async def test_callbacks_in_caller_task_group(autojump_clock):
    queries = [DHTID.generate(i) for i in range(5)]
    done = []

    async def found_callback(query, nearest, visited):
        await anyio.sleep(10)
        done.append(query)

    async with anyio.create_task_group() as task_group:
        nearest, _ = await traverse_dht(
            queries, NODES[:2], 5, 2, 2, Network().get_neighbors, None, found_callback, task_group
        )
        assert done == [] and len(nearest) == 5  # returned without waiting for callbacks
    assert sorted(done) == sorted(queries)  # exactly once per query


@pytest.mark.trio
async def test_cancellation_leaves_no_tasks(autojump_clock):
    network = Network(delays={node: float("inf") for node in NODES})
    with anyio.move_on_after(10) as scope:
        await traverse_dht([DHTID.generate("x")], NODES[:6], 5, 3, 1, network.get_neighbors)
    assert scope.cancelled_caught
    assert network.started == 3 and network.cancelled == 3


@pytest.mark.trio
async def test_get_neighbors_exception_propagates():
    started = []

    async def get_neighbors(peer, queries):
        started.append(peer)
        if len(started) == 3:
            raise RuntimeError("bug in get_neighbors")
        await anyio.sleep_forever()

    with pytest.raises(Exception) as info:  # an exception group holding the error
        await traverse_dht([DHTID.generate("x")], NODES[:6], 5, 3, 1, get_neighbors)
    errors = getattr(info.value, "exceptions", [info.value])
    assert [str(error) for error in errors] == ["bug in get_neighbors"]


@pytest.mark.trio
async def test_visited_nodes_edge_cases():
    query = DHTID.generate("q")
    excluded = set(brute_force(query, 3))
    nearest, visited = await traverse_dht(
        [query, query], NODES[:3], 5, 2, 1, Network().get_neighbors, {query: excluded}
    )
    assert nearest[query] == brute_force(query, 5, set(NODES) - excluded)
    assert excluded <= visited[query]

    assert await traverse_dht([], NODES, 5, 2, 1, Network().get_neighbors) == ({}, {})
    nearest, visited = await traverse_dht([query], [], 5, 2, 1, Network().get_neighbors)
    assert nearest == {query: []} and visited == {query: set()}
    for bad in ({"beam_size": 0}, {"num_workers": 0}, {"queries_per_call": 0}):
        kwargs = {"beam_size": 1, "num_workers": 1, "queries_per_call": 1} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            await traverse_dht([query], NODES, get_neighbors=Network().get_neighbors, **kwargs)


@pytest.mark.trio
async def test_answered_nodes_take_a_place_without_a_call():
    query = DHTID.generate("self is nearest")
    myself = brute_force(query, 1)[0]
    network = Network()
    nearest, visited = await traverse_dht(
        [query],
        NODES[:3],
        5,
        2,
        1,
        network.get_neighbors,
        visited_nodes={query: {myself}},
        answered_nodes={query: {myself}},
    )
    assert nearest[query] == brute_force(query, 5)  # myself counted, first
    assert myself in visited[query]
    assert myself not in {peer for peer, _ in network.calls}


@pytest.mark.trio
async def test_farther_candidates_wait_for_calls_in_flight():
    query = DHTID.generate("narrow beam")
    ranked = brute_force(query, len(NODES))
    network = Network()
    # more workers than beam places: the 5 nearest are called, the 3 farther never are
    nearest, _ = await traverse_dht([query], ranked[:8], 5, 8, 1, network.get_neighbors)
    assert nearest[query] == ranked[:5]
    assert sorted(peer for peer, _ in network.calls) == sorted(ranked[:5])

    # a nearer call that fails lets the next candidate in
    network = Network(dead={ranked[1]})
    nearest, _ = await traverse_dht([query], ranked[:8], 5, 8, 1, network.get_neighbors)
    assert nearest[query] == ranked[:1] + ranked[2:6]
    assert {peer for peer, _ in network.calls} == set(ranked[:6])


@pytest.mark.trio
async def test_slow_calls_stop_holding_back_after_patience(autojump_clock):
    query = DHTID.generate("slow peer")
    ranked = brute_force(query, len(NODES))
    for patience, called_sixth in ((1.0, True), (float("inf"), False)):
        network = Network(delays={ranked[0]: 10.0})
        start = anyio.current_time()
        nearest, _ = await traverse_dht(
            [query], ranked[:8], 5, 8, 1, network.get_neighbors, patience=patience
        )
        assert nearest[query] == ranked[:5]  # the slow peer answers in the end
        assert anyio.current_time() - start == pytest.approx(10.0)
        assert (ranked[5] in {peer for peer, _ in network.calls}) == called_sixth
