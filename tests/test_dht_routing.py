import random

import pytest

from swarmtrain.dht import DHTID, EvictionPolicy, KBucket, NodeFailures, PingRequest, RoutingTable


def random_ids(rng: random.Random, n: int) -> list[DHTID]:
    return [DHTID(rng.getrandbits(160)) for _ in range(n)]


def check_invariants(table: RoutingTable) -> None:
    assert table.buckets[0].lower == DHTID.MIN and table.buckets[-1].upper == DHTID.MAX
    for left, right in zip(table.buckets, table.buckets[1:], strict=False):
        assert left.upper == right.lower
    for bucket in table.buckets:
        assert len(bucket.nodes) <= bucket.size and len(bucket.replacement_nodes) <= bucket.size
        assert bucket.upper - bucket.lower == 2 ** (160 - bucket.depth)
        for node_id in [*bucket.nodes, *bucket.replacement_nodes]:
            assert bucket.has_in_range(node_id)
            assert table.get_bucket_index(node_id) == table.buckets.index(bucket)


def test_splits_follow_kademlia_rules():
    rng = random.Random(0)
    own_id = DHTID(rng.getrandbits(160))
    table: RoutingTable[str] = RoutingTable(own_id, bucket_size=4, depth_modulo=1)
    for i, node_id in enumerate(random_ids(rng, 2000)):
        table.add_or_update_node(node_id, f"peer{i}", now=0)
    check_invariants(table)
    # depth_modulo=1: only buckets holding our own id split, so every other bucket is the
    # sibling of one on the path to our id and there is one bucket per level
    depths = sorted(bucket.depth for bucket in table.buckets)
    own_bucket = table.buckets[table.get_bucket_index(own_id)]
    assert depths == [*range(1, own_bucket.depth + 1), own_bucket.depth]
    for bucket in table.buckets:
        if bucket is not own_bucket:
            assert DHTID.common_prefix_length(bucket.lower, own_id) == bucket.depth - 1


def test_depth_modulo_allows_extra_splits():
    rng = random.Random(1)
    ids = random_ids(rng, 3000)
    plain: RoutingTable[int] = RoutingTable(ids[0], bucket_size=4, depth_modulo=1)
    relaxed: RoutingTable[int] = RoutingTable(ids[0], bucket_size=4, depth_modulo=5)
    for i, node_id in enumerate(ids[1:]):
        plain.add_or_update_node(node_id, i, now=0)
        relaxed.add_or_update_node(node_id, i, now=0)
    check_invariants(relaxed)
    assert len(relaxed.buckets) > len(plain.buckets)
    assert len(relaxed) > len(plain)
    # a subtree that left the path to our id at depth d keeps splitting up to the next
    # multiple of depth_modulo, then stops
    max_extra_depth = 0
    for bucket in relaxed.buckets:
        if not bucket.has_in_range(ids[0]):
            divergence_depth = DHTID.common_prefix_length(bucket.lower, ids[0]) + 1
            assert bucket.depth <= -(-divergence_depth // 5) * 5
            max_extra_depth = max(max_extra_depth, bucket.depth - divergence_depth)
    assert max_extra_depth > 0


def test_nearest_neighbors_match_brute_force():
    rng = random.Random(2)
    ids = random_ids(rng, 500)
    table: RoutingTable[int] = RoutingTable(ids[0], bucket_size=1000)
    for i, node_id in enumerate(ids[1:], start=1):
        table.add_or_update_node(node_id, i, now=0)
    assert len(table) == 499
    for query in random_ids(rng, 20) + ids[1:5]:
        expected = sorted(ids[1:], key=lambda n: n ^ query)[:7]
        assert [n for n, _ in table.get_nearest_neighbors(query, k=7)] == expected
        found = table.get_nearest_neighbors(query, k=7, exclude=expected[0])
        assert [n for n, _ in found] == expected[1:] + sorted(ids[1:], key=lambda n: n ^ query)[7:8]
        assert all(table.get_peer_id(n) == peer for n, peer in found)
    assert table.get_nearest_neighbors(ids[1], k=0) == []
    with pytest.raises(ValueError):
        table.get_nearest_neighbors(ids[1], k=-1)


def test_nearest_neighbors_on_split_table():
    rng = random.Random(3)
    ids = random_ids(rng, 400)
    table: RoutingTable[int] = RoutingTable(ids[0], bucket_size=8)
    for i, node_id in enumerate(ids[1:]):
        table.add_or_update_node(node_id, i, now=0)
    known = [node_id for node_id, _ in table]
    for query in random_ids(rng, 10):
        expected = sorted(known, key=lambda n: n ^ query)[:5]
        assert [n for n, _ in table.get_nearest_neighbors(query, 5)] == expected


def full_bucket_table() -> tuple[RoutingTable[str], list[DHTID]]:
    # own id at the bottom; nodes in the top half never share our bucket after the first split
    table: RoutingTable[str] = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=1)
    top = [DHTID((1 << 159) + i) for i in range(1, 6)]
    return table, top


def test_full_bucket_requests_ping_and_keeps_replacements():
    table, top = full_bucket_table()
    assert table.add_or_update_node(top[0], "a", now=1) is None
    assert table.add_or_update_node(top[1], "b", now=2) is None
    ping = table.add_or_update_node(top[2], "c", now=3)
    assert ping == PingRequest(top[0], "a")  # least recently seen
    assert top[2] not in table and table.get_peer_id(top[2]) == "c"
    # a second newcomer asks about the next stale node, not the one already being pinged
    assert table.add_or_update_node(top[3], "d", now=4) == PingRequest(top[1], "b")
    # nothing left to ping
    assert table.add_or_update_node(top[4], "e", now=5) is None
    stats = table.statistics()
    assert (stats.num_nodes, stats.num_replacement_nodes, stats.num_pending_pings) == (2, 2, 2)
    assert table.get_node_id("e") == top[4]  # the oldest replacement "c" was dropped
    assert table.get_peer_id(top[2]) is None and table.get_node_id("c") is None

    # "a" answered the ping: it stays and becomes most recently seen
    assert table.add_or_update_node(top[0], "a", now=6) is None
    assert list(table.buckets[-1].nodes) == [top[1], top[0]]
    # "b" did not answer: the most recently seen replacement takes its place
    assert table.remove(top[1])
    assert list(table.buckets[-1].nodes) == [top[0], top[4]]
    assert table.get_node_id("b") is None
    assert not table.remove(top[1])
    with pytest.raises(KeyError):
        del table[top[1]]


def test_split_promotes_replacements_and_respects_midpoint():
    bucket: KBucket[int] = KBucket(0, 16, size=2)
    bucket.add_or_update_node(DHTID(7), 7, now=1)
    bucket.add_or_update_node(DHTID(8), 8, now=2)
    assert bucket.add_or_update_node(DHTID(9), 9, now=3) == (False, None)
    left, right = bucket.split()
    assert (left.lower, left.upper, right.lower, right.upper) == (0, 8, 8, 16)
    assert list(left.nodes) == [7] and list(right.nodes) == [8, 9]
    assert left.depth == right.depth == 1 and left.last_updated == 3
    with pytest.raises(ValueError, match="outside"):
        left.add_or_update_node(DHTID(8), 8, now=4)
    with pytest.raises(ValueError, match="cannot be split"):
        KBucket(3, 4, size=1).split()


def test_peer_id_mapping_and_reidentified_peer():
    table: RoutingTable[str] = RoutingTable(DHTID(0))
    table.add_or_update_node(DHTID(5), "peer", now=0)
    assert table.get_node_id("peer") == 5 and table.get_peer_id(DHTID(5)) == "peer"
    table.add_or_update_node(DHTID(6), "peer", now=1)  # restarted with a new id
    assert DHTID(5) not in table and DHTID(6) in table
    assert table.get_node_id("peer") == 6 and table.get_peer_id(DHTID(5)) is None
    table.add_or_update_node(DHTID(6), "moved", now=2)  # same id, new peer id
    assert table.get_node_id("peer") is None and table.get_node_id("moved") == 6
    assert table.add_or_update_node(DHTID(0), "me", now=3) is None and DHTID(0) not in table
    assert "not an id" not in table and DHTID.MAX not in table


def test_refresh_ids_cover_stale_buckets():
    rng = random.Random(4)
    table: RoutingTable[int] = RoutingTable(DHTID(rng.getrandbits(160)), bucket_size=2)
    for i, node_id in enumerate(random_ids(rng, 50)):
        table.add_or_update_node(node_id, i, now=float(i))
    assert table.get_stale_buckets(now=100.0, max_age=1000.0) == []
    stale = table.get_stale_buckets(now=100.0, max_age=75.0)
    assert stale and all(bucket.last_updated < 25.0 for bucket in stale)
    refresh_ids = table.get_refresh_ids(now=100.0, max_age=75.0, rng=random.Random(0))
    assert len(refresh_ids) == len(stale)
    assert all(b.has_in_range(i) for b, i in zip(stale, refresh_ids, strict=True))


def test_invalid_parameters():
    for bad in ({"max_failures": 0}, {"max_failures": True}, {"min_failing_time": -1.0}):
        with pytest.raises(ValueError):
            EvictionPolicy(**bad)
    with pytest.raises(ValueError):
        RoutingTable(DHTID(0), bucket_size=0)
    with pytest.raises(ValueError):
        RoutingTable(DHTID(0), depth_modulo=0)
    with pytest.raises(ValueError):
        RoutingTable(DHTID(0)).get_bucket_index(DHTID.MAX)


def sybil_places(rng: random.Random, attacker_ids: list[DHTID], key_id: DHTID, k: int = 5) -> int:
    """How many of the ``k`` places nearest to ``key_id`` the attacker holds in a 64-node swarm
    seen from one honest node's routing table (big enough to know everyone)."""
    honest = [DHTID.from_peer_id(rng.randbytes(38)) for _ in range(64)]
    table: RoutingTable[str] = RoutingTable(honest[0], bucket_size=2048, depth_modulo=5)
    for i, node_id in enumerate(honest[1:]):
        table.add_or_update_node(node_id, f"honest{i}", now=0)
    for i, node_id in enumerate(attacker_ids):
        table.add_or_update_node(node_id, f"sybil{i}", now=0)
    nearest = table.get_nearest_neighbors(key_id, k)
    return sum(peer.startswith("sybil") for _, peer in nearest)


def test_bound_node_ids_make_sybils_grind_for_their_place():
    """Five chosen ids take all five places nearest to a key; five identities with ids
    derived from their peer ids land at random; grinding about k x N identities (a few seconds
    of key generation in a swarm of N = 64) still buys the places: the residual risk that
    docs/security.md describes."""
    rng = random.Random(17)
    keys = [DHTID.generate(f"key{i}") for i in range(20)]
    chosen = [sybil_places(rng, [DHTID(key ^ (i + 1)) for i in range(5)], key) for key in keys]
    assert chosen == [5] * len(keys)

    def derived(count: int) -> list[DHTID]:
        return [DHTID.from_peer_id(rng.randbytes(38)) for _ in range(count)]

    bound = [sybil_places(rng, derived(5), key) for key in keys]
    assert sum(bound) / len(keys) < 1  # expected 5 x 5/69 = 0.36
    ground = [sybil_places(rng, derived(20 * 64), key) for key in keys]
    assert sum(ground) / len(keys) > 4  # expected 5 x 1280/1344 = 4.76


# ------------------------------------------------ nodes that stop answering (issue #18)

POLICY = EvictionPolicy(max_failures=3, min_failing_time=10.0)


def failing_table(bucket_size: int) -> RoutingTable[str]:
    return RoutingTable(DHTID(0), bucket_size=bucket_size, depth_modulo=1, eviction=POLICY)


def fail(table: RoutingTable, node_id: DHTID, *times: float) -> list[bool]:
    return [table.register_failure(node_id, now=t) for t in times]


def test_a_failing_node_is_kept_stale_while_no_replacement_waits():
    """Timeouts alone never empty a table: a node that fails again and again, over any span,
    stays (ranked after fresh nodes) as long as nothing could take its place."""
    table: RoutingTable[str] = RoutingTable(DHTID(0), bucket_size=4, eviction=POLICY)
    near, far = DHTID(1), DHTID(1 << 100)
    table.add_or_update_node(near, "near", now=0)
    table.add_or_update_node(far, "far", now=0)
    assert fail(table, near, *[float(t) for t in range(1, 200, 7)]) == [False] * 29
    assert near in table and table.is_stale(near) and not table.is_stale(far)
    assert table.get_node_id("near") == near and table.get_peer_id(near) == "near"
    assert table.statistics().num_stale_nodes == 1 and table.num_fresh_nodes() == 1
    # lookups: the stale node comes after every fresh node, though it is nearer
    assert [n for n, _ in table.get_nearest_neighbors(DHTID(0), k=2)] == [far, near]
    assert [n for n, _ in table.get_nearest_neighbors(DHTID(0), k=1)] == [far]
    fail(table, far, 200.0)
    assert table.num_fresh_nodes() == 0 and len(table) == 2  # alone, but keeps its contacts
    assert [n for n, _ in table.get_nearest_neighbors(DHTID(0), k=2)] == [near, far]
    assert not table.register_failure(DHTID(7), now=201.0)  # unknown: nothing to do


def test_an_answer_makes_a_failing_node_fresh_and_resets_its_count():
    _, top = full_bucket_table()
    table = failing_table(2)
    for i, node_id in enumerate(top[:3]):
        table.add_or_update_node(node_id, f"n{i}", now=0)  # n2 waits as a replacement
    assert fail(table, top[0], 1.0, 6.0) == [False, False]
    bucket = table.buckets[table.get_bucket_index(top[0])]
    assert bucket.failures[top[0]] == NodeFailures(2, 1.0, 6.0)
    table.add_or_update_node(top[0], "n0", now=7.0)  # it answered (or called us)
    assert not table.is_stale(top[0]) and top[0] not in bucket.failures
    # the count starts again: two more failures do not evict it, even spread over 20 s
    assert fail(table, top[0], 20.0, 40.0) == [False, False]
    assert top[0] in table and bucket.failures[top[0]] == NodeFailures(2, 20.0, 40.0)


def test_a_node_failing_enough_times_over_enough_time_gives_way_to_a_replacement():
    table = failing_table(2)
    top = [DHTID((1 << 159) + i) for i in range(1, 5)]
    for i, node_id in enumerate(top):
        table.add_or_update_node(node_id, f"n{i}", now=float(i))  # n2, n3 are replacements
    assert [n for n, _ in table] == top[:2]
    # a burst of concurrent timeouts (one lookup's calls) is one moment, not three failures
    assert fail(table, top[0], 10.0, 10.0, 10.1, 12.0) == [False] * 4
    assert top[0] in table and table.is_stale(top[0])
    # the 5th failure comes 10 s after the first: n0 leaves, the most recently seen
    # replacement (n3) takes its place fresh
    assert fail(table, top[0], 20.0) == [True]
    assert top[0] not in table and table.get_node_id("n0") is None
    bucket = table.buckets[-1]
    assert list(bucket.nodes) == [top[1], top[3]] and list(bucket.replacement_nodes) == [top[2]]
    assert not table.is_stale(top[3])
    # a replacement that fails is dropped from the waiting list at once (it was never used)
    assert fail(table, top[2], 21.0) == [True]
    assert table.get_node_id("n2") is None and not bucket.replacement_nodes
    # n1 fails on: with nobody waiting it stays, whatever the count
    assert fail(table, top[1], 30.0, 40.0, 50.0, 60.0) == [False] * 4
    assert top[1] in table


def test_a_bucket_of_stale_nodes_takes_newcomers_in_their_place():
    """Nodes that failed enough for eviction but had nobody to give way to are replaced by
    the next newcomers at once (no ping needed); fresh nodes are not."""
    table = failing_table(3)
    top = [DHTID((1 << 159) + i) for i in range(1, 8)]
    for i, node_id in enumerate(top[:3]):
        table.add_or_update_node(node_id, f"old{i}", now=0)
    for node_id in top[:2]:
        fail(table, node_id, 1.0, 6.0, 11.0)  # evictable, but nothing waits
    fail(table, top[2], 1.0, 2.0)  # stale, not evictable yet
    assert len(table) == 3 and table.num_fresh_nodes() == 0
    assert table.add_or_update_node(top[3], "new3", now=12.0) is None
    assert table.add_or_update_node(top[4], "new4", now=13.0) is None
    assert set(table.buckets[-1].nodes) == {top[2], top[3], top[4]}
    assert table.get_node_id("old0") is None and table.get_node_id("old1") is None
    assert table.num_fresh_nodes() == 2
    # now only a stale-but-young node and fresh ones: the next newcomer waits, and the
    # failing node is the one asked to prove it is alive
    assert table.add_or_update_node(top[5], "new5", now=14.0) == PingRequest(top[2], "old2")
    assert top[5] not in table and table.get_node_id("new5") == top[5]
    # the ping timed out: its third failure, 13 s after the first, lets new5 in
    assert fail(table, top[2], 14.0) == [True]
    assert set(table.buckets[-1].nodes) == {top[3], top[4], top[5]}


def test_pings_of_a_full_bucket_ask_about_failing_nodes_first_and_can_end_unsent():
    table = failing_table(2)
    top = [DHTID((1 << 159) + i) for i in range(1, 6)]
    table.add_or_update_node(top[0], "a", now=1)
    table.add_or_update_node(top[1], "b", now=2)
    fail(table, top[1], 3.0)
    assert table.add_or_update_node(top[2], "c", now=4) == PingRequest(top[1], "b")
    table.end_ping(top[1])  # the peer was backed off: no ping went out
    assert table.statistics().num_pending_pings == 0
    assert table.add_or_update_node(top[3], "d", now=5) == PingRequest(top[1], "b")
    assert table.add_or_update_node(top[4], "e", now=6) == PingRequest(top[0], "a")


def test_a_split_keeps_the_failures_of_its_nodes():
    bucket: KBucket[int] = KBucket(0, 16, size=2, eviction=POLICY)
    bucket.add_or_update_node(DHTID(7), 7, now=1)
    bucket.add_or_update_node(DHTID(8), 8, now=2)
    assert not bucket.register_failure(DHTID(8), now=3)
    left, right = bucket.split()
    assert right.failures == {DHTID(8): NodeFailures(1, 3, 3)} and not left.failures
    assert left.eviction is right.eviction is POLICY


def test_random_failures_never_shrink_the_table():
    """Seeded random swarms of arrivals, answers and timeouts on a jumping clock: a failure
    never lowers the number of main-list nodes (an evicted node is always replaced), and the
    table's bookkeeping stays consistent."""
    evictions = 0
    for seed in range(10):
        rng = random.Random(seed)
        table = RoutingTable(DHTID(rng.getrandbits(160)), bucket_size=3, eviction=POLICY)
        ids = random_ids(rng, 60)
        seen: list[DHTID] = []
        now = 0.0
        for _ in range(400):
            now += rng.expovariate(1.0)
            action = rng.random()
            if action < 0.3 or not seen:
                node_id = rng.choice(ids)
                table.add_or_update_node(node_id, f"p{node_id}", now=now)
                seen.append(node_id)
            elif action < 0.4:
                node_id = rng.choice(seen)
                if table.get_peer_id(node_id) is not None:
                    table.add_or_update_node(node_id, f"p{node_id}", now=now)
            else:
                before, node_id = len(table), rng.choice(seen)
                was_main = node_id in table
                evictions += table.register_failure(node_id, now=now) and was_main
                assert len(table) == before
            check_invariants(table)
            for bucket in table.buckets:
                assert set(bucket.failures) <= set(bucket.nodes)
                for node_id in [*bucket.nodes, *bucket.replacement_nodes]:
                    assert table.get_node_id(f"p{node_id}") == node_id
            assert table.num_fresh_nodes() + table.statistics().num_stale_nodes == len(table)
    assert evictions > 0  # the walk did replace failing nodes
