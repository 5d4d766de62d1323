"""What per-peer quotas and the expiration horizon cost an honest DHT node's storage (#17.3).

    python benchmarks/benchmark_dht_storage.py [--ops 100000] [--repeats 5]

The honest workload of one node, pure (no network): ``--ops`` writes from 32 peers, half of them
per-peer subkeys under 500 dictionary keys (declarations, rewritten as peers refresh them),
half regular values under 500 other keys, each followed by one read. Runs it on a storage with
no limits (the old behaviour: nobody charged) and on one with the shipped defaults (every
record charged to its writer, quotas checked, the horizon checked), alternating, and prints
the CPU seconds of each and their ratio (medians of ``--repeats``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from swarmtrain.dht import DHTID, DHTLocalStorage, StorageQuota
from swarmtrain.dht.node import (
    DEFAULT_MAX_EXPIRATION_HORIZON,
    DEFAULT_MAX_SUBKEYS,
    DEFAULT_STORAGE_SIZE,
)


def run(storage: DHTLocalStorage, ops: int, charge_peers: bool) -> float:
    keys = [DHTID.generate(i) for i in range(1000)]
    peers = [b"peer%d" % i for i in range(32)]
    value = b"v" * 100
    now = 1000.0
    started = time.process_time()
    for i in range(ops):
        key, peer = keys[i % 1000], peers[i % 32]
        writer = peer if charge_peers else None
        if i % 1000 < 500:
            storage.store(key, value, now + 60, now, subkey=peer, peer=writer)
        else:
            storage.store(key, value, now + 60, now, peer=writer)
        storage.get(keys[(i * 7) % 1000], now)
        now += 0.001
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base, limited = [], []
    for _ in range(args.repeats):
        base.append(run(DHTLocalStorage(), args.ops, charge_peers=False))
        storage = DHTLocalStorage(
            DEFAULT_STORAGE_SIZE,
            DEFAULT_MAX_SUBKEYS,
            quota=StorageQuota(),
            expiration_horizon=DEFAULT_MAX_EXPIRATION_HORIZON,
        )
        limited.append(run(storage, args.ops, charge_peers=True))
    b, q = statistics.median(base), statistics.median(limited)
    print(f"{args.ops} writes + reads, median of {args.repeats} (CPU s)")
    print(f"no limits (baseline)          {b:.3f} s  ({1e6 * b / args.ops:.1f} us per write+read)")
    print(f"quotas + horizon (defaults)   {q:.3f} s  ({1e6 * q / args.ops:.1f} us per write+read)")
    print(f"ratio                         {q / b:.2f}x")


if __name__ == "__main__":
    main()
