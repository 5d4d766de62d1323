"""How long a DHT get of a large signed dictionary holds the reader's event loop.

Two holder nodes keep a dictionary of ``--records`` peers' records, each signed by its own
identity (what ``{run_id}_progress`` looks like in a swarm of that many peers); a reader node
in the same trio loop gets it ``--gets`` times (``latest=True``: both holders answer). A
``LoopStallDetector`` (threshold ``--threshold``) times every task step of the loop; printed:
the time per get, the longest step and the steps over the threshold. Holders answer without
validating, so the long steps are the reader's. Compare two trees with ``PYTHONPATH``::

    PYTHONPATH=. python benchmarks/benchmark_dht_large_reads.py --records 2000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time

import trio

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from test_dht_node import swarm

from swarmtrain.dht import DHTID, DHTRecord, PeerRecordValidator, get_dht_time, serialize
from swarmtrain.p2p import PeerSigner
from swarmtrain.p2p.identity import generate_identity
from swarmtrain.utils.loop_stalls import detect_loop_stalls

KEY = "bench_progress"
PATTERN = re.compile(r"bench_progress")


def signed_records(count: int, expiration: float) -> list[DHTRecord]:
    records = []
    for i in range(count):
        signer = PeerRecordValidator([PATTERN], signer=PeerSigner(generate_identity()))
        value = {"epoch": 7, "samples": 1000 + i, "samples_per_second": 12.5, "time": 1e9}
        record = DHTRecord(serialize(KEY), serialize(signer.peer_id), serialize(value), expiration)
        records.append(dataclasses.replace(record, value=signer.sign_value(record)))
    return records


async def main(args) -> None:
    now = get_dht_time()
    records = signed_records(args.records, now + 600)
    validator = PeerRecordValidator([PATTERN])
    async with swarm(3, validators=[validator]) as s:
        *holders, reader = s.nodes
        for holder in holders:
            for record in records:
                assert holder.protocol.storage.store(
                    DHTID.generate(KEY), record.value, record.expiration_time, now, record.subkey
                )
        times = []
        with detect_loop_stalls(args.threshold, log=args.verbose) as detector:
            for _ in range(args.gets):
                started = time.perf_counter()
                found = await reader.get(KEY, latest=True)
                times.append(time.perf_counter() - started)
                assert found is not None and len(found.value) == args.records
        stats = detector.statistics()
        walls = sorted(stall.wall_s for stall in detector.stalls)
        print(
            f"records {args.records}, gets {args.gets}, load {os.getloadavg()[0]:.1f}: "
            f"get median {statistics.median(times) * 1000:.0f} ms; longest loop step "
            f"{stats.step_max_s * 1000:.0f} ms; steps over {args.threshold * 1000:.0f} ms: "
            f"{stats.stalls} (max {max(walls, default=0) * 1000:.0f} ms, cpu of the longest "
            f"{max((s.cpu_s for s in detector.stalls), default=0) * 1000:.0f} ms)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--gets", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--verbose", action="store_true", help="log each long step")
    trio.run(main, parser.parse_args())
