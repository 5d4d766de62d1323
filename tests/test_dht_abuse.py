"""Issue 17.2 against real peers: a DHT node in its own process keeps answering pings while a
peer sends it the audit's decode bombs and the costliest values the decoder accepts.

The victim is ``benchmarks/benchmark_dht_abuse.py --role victim``; the attacker and the prober
are DHT clients in this process. Before the bounded decoder one bomb request froze the victim
for ~21 s; the bound below (2 s per ping) does not depend on the machine's load in any way that
matters here.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import trio

from swarmtrain.dht import DHT, MAX_VALUE_ELEMENTS
from swarmtrain.p2p import PeerID

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark_dht_abuse.py"
PING_BOUND = 2.0  # seconds; the old code took ~20 s for one bomb request


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_dht_abuse", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_dht_abuse"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("benchmark_dht_abuse", None)


async def attack_while_pinging(bench, attacker, prober, victim, requests):
    """Send ``requests`` (lists of items) one after another while pinging every 50 ms; the
    outcomes and the ping latencies (None: no answer within PING_BOUND)."""
    outcomes, latencies = [], []
    async with trio.open_nursery() as nursery:

        async def attack():
            for items in requests:
                outcomes.append(await bench.store_request(attacker, victim, items, timeout=60))
            nursery.cancel_scope.cancel()

        nursery.start_soon(attack)
        while True:
            latencies.append(await bench.ping_once(prober, victim, PING_BOUND))
            await trio.sleep(0.05)
    return outcomes, latencies


@pytest.mark.trio
async def test_victim_answers_pings_through_bombs_and_worst_legal_stores(bench):
    victim_proc = bench.spawn("--role", "victim")
    try:
        info = await trio.to_thread.run_sync(bench.read_json_line, victim_proc)
        victim = PeerID.from_base58(info["peer_id"])
        initial = info["maddrs"][:1]
        async with (
            DHT.create(initial, client_mode=True, **bench.HOST_KWARGS) as attacker,
            DHT.create(initial, client_mode=True, **bench.HOST_KWARGS) as prober,
        ):
            assert await bench.ping_once(prober, victim, 10) is not None

            # audit 2: 7 values of 1 MiB, each one array of ~1M empty arrays
            outcomes, latencies = await attack_while_pinging(
                bench, attacker, prober, victim, [bench.attack_items("bomb", 0, 7)]
            )
            assert len(outcomes) == 1 and outcomes[0].startswith("rejected"), outcomes
            assert "max_elements" in outcomes[0]
            assert None not in latencies, latencies

            # the costliest legal values: stored, and the victim still answers meanwhile
            legal = bench.worst_legal_value()
            assert len(legal) == MAX_VALUE_ELEMENTS + 2  # one object per byte, plus a header
            requests = [bench.attack_items("legal", index, 64) for index in range(3)]
            outcomes, latencies = await attack_while_pinging(
                bench, attacker, prober, victim, requests
            )
            assert outcomes == ["ok 64/64"] * 3
            assert None not in latencies, latencies
        stats = await trio.to_thread.run_sync(bench.finish, victim_proc)
        assert stats["stored_keys"] == 3 * 64
    finally:
        bench.kill(victim_proc)


@pytest.mark.trio
async def test_victim_process_keeps_only_the_attackers_quota_of_a_1mib_flood(bench):
    """Audit 8: 420 plain values of 1 MiB pinned 543 MiB of a victim process. 84 MiB of them
    now leave the victim holding the attacker's quota (32 MiB) and no more resident memory than
    that plus buffers; the attacker gets False for the rest."""
    from swarmtrain.dht.storage_quota import DEFAULT_MAX_BYTES_PER_PEER

    victim_proc = bench.spawn("--role", "victim")
    try:
        info = await trio.to_thread.run_sync(bench.read_json_line, victim_proc)
        victim = PeerID.from_base58(info["peer_id"])
        async with DHT.create(info["maddrs"][:1], client_mode=True, **bench.HOST_KWARGS) as evil:
            outcomes = [
                await bench.store_request(evil, victim, bench.attack_items("flood", i, 7), 60)
                for i in range(12)
            ]
        stats = await trio.to_thread.run_sync(bench.finish, victim_proc)
    finally:
        bench.kill(victim_proc)
    assert all(outcome.startswith("ok ") for outcome in outcomes), outcomes
    stored = sum(int(outcome.split()[1].split("/")[0]) for outcome in outcomes)
    value_size = len(bench.flood_value())
    assert stored == DEFAULT_MAX_BYTES_PER_PEER // value_size == stats["stored_keys"]
    assert stats["stored_bytes"] <= DEFAULT_MAX_BYTES_PER_PEER
    # 84 MiB sent, all of which the old code kept; measured ~52 MiB (the quota plus buffers)
    growth = stats["rss_mib"] - info["rss_mib"]
    assert growth < DEFAULT_MAX_BYTES_PER_PEER / 2**20 + 40, growth
