"""Peers behind real NATs (issue 18.2): which path each pair uses, round times, bytes, and
what bulk calls cost when no data lane can be opened. Root only (network namespaces).

    sudo python benchmarks/benchmark_netlab_nat.py [--floats 1048576] [--rounds 5] [--mbit 0]

A ``tests/netlab`` lab: public peers "relay" and "boot"; "a" and "b" behind cone NATs, "c"
behind a symmetric NAT, "d" behind a cone NAT with AutoNAT off (so it does not know it is
behind a NAT and offers data lanes nobody can reach). Every peer listens on 0.0.0.0 with
swarmtrain's defaults. ``--mbit``: limit every link to that rate (tc tbf; 0 = no limit).

Prints, as JSON lines: startup and AutoNAT times; DHT store/get across NATs; per pair (a-b
cone/cone, a-c cone/symmetric, a-relay NAT/public) the round times of a 2-peer
``DecentralizedAverager`` (median, all), the connection kinds held after each round, the bytes
that crossed the public hosts per round and per payload byte, the hole-punch counters;
then bulk-call costs (8 MiB, median of ``--calls``): ``bulk=True`` against ``bulk=False`` to the
relay (a lane), to b (direct, no lane offered), to c (relayed), and to d (a lane offered but
unreachable: the first call pays the fallback). Baselines come from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netlab
from netlab.nat_swarm import NatSwarm

HOMES = {"a": "cone", "b": "cone", "c": "symmetric", "d": "cone"}


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def average_pair(swarm: NatSwarm, pair: tuple[str, str], prefix: str, args) -> None:
    started = time.monotonic()
    before = swarm.public_bytes()
    messages = {
        name: {
            "op": "average",
            "prefix": prefix,
            "rounds": 1,
            "floats": args.floats,
            "value": float(i),
            "group_size": 2,
            "timeout": 120,
        }
        for i, name in enumerate(pair)
    }
    rounds, paths, crossed = [], [], []
    for _ in range(args.rounds):
        mark = swarm.public_bytes()
        results = swarm.ask_all(messages, 180)
        first = results[pair[0]]["rounds"][0]
        assert all(r["rounds"][0]["group"] == 2 for r in results.values()), results
        rounds.append(max(r["rounds"][0]["seconds"] for r in results.values()))
        kinds = first["paths"].get(swarm.peer_id(pair[1]), [])
        paths.append("+".join(kinds))
        crossed.append(swarm.public_bytes() - mark)
    payload = args.floats * 4
    direct_at_end = "direct" in swarm.paths(pair[0])["paths"].get(pair[1], [])
    counters = {name: swarm.paths(name) for name in pair}
    report(
        pair="-".join(pair),
        nats="/".join(HOMES.get(n, "public") for n in pair),
        round_seconds_median=round(statistics.median(rounds), 3),
        round_seconds=[round(r, 3) for r in rounds],
        paths_after_each_round=paths,
        public_bytes_per_round=crossed,
        public_bytes_per_payload_byte=[round(c / payload, 2) for c in crossed],
        public_bytes_total=swarm.public_bytes() - before,
        direct_at_end=direct_at_end,
        seconds=round(time.monotonic() - started, 1),
        hole_punches={
            n: (c["hole_punches_succeeded"], c["hole_punches_failed"]) for n, c in counters.items()
        },
    )


def bulk_costs(swarm: NatSwarm, args) -> None:
    for target in ("relay", "b", "c", "d"):
        peer = swarm.peer_id(target)
        times: dict[str, list[float]] = {"bulk": [], "plain": []}
        first_bulk = None
        lanes = fallbacks = 0
        for i in range(args.calls):
            for kind in ("bulk", "plain"):
                call = {"op": "bulk_call", "peer": peer, "mib": 8, "bulk": kind == "bulk"}
                result = swarm.ask("a", call, 120)
                assert result["correct"], result
                times[kind].append(result["seconds"])
                if kind == "bulk":
                    first_bulk = result["seconds"] if i == 0 else first_bulk
                    lanes += result["lanes_opened"]
                    fallbacks += result["lane_fallbacks"]
        bulk, plain = statistics.median(times["bulk"]), statistics.median(times["plain"])
        counters = swarm.paths("a")  # fallbacks are counted when a lane's connect times out
        report(
            bulk_call_to=target,
            path="+".join(swarm.paths("a")["paths"].get(target, [])),
            first_bulk_seconds=round(first_bulk, 3),
            bulk_seconds_median=round(bulk, 3),
            plain_seconds_median=round(plain, 3),
            bulk_over_plain=round(bulk / plain, 2),
            lanes_opened_during_calls=lanes,
            lane_fallbacks_during_calls=fallbacks,
            a_lanes_opened_total=counters["lanes_opened"],
            a_lane_fallbacks_total=counters["lane_fallbacks"],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floats", type=int, default=1 << 20, help="float32 values per peer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--mbit", type=float, default=0.0)
    args = parser.parse_args()
    reason = netlab.iptables_unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    report(load=os.getloadavg(), args=vars(args))
    with netlab.Lab() as lab:
        swarm = NatSwarm(lab, HOMES, options={"d": {"use_autonat": False, "use_auto_relay": True}})
        report(startup_seconds=round(swarm.startup_seconds, 1))
        if args.mbit:
            for host in swarm.hosts.values():
                lab.limit_rate(host, args.mbit)
        started = time.monotonic()
        infos = swarm.ask_all({n: {"op": "wait_circuit", "timeout": 90} for n in HOMES}, 120)
        report(
            circuits_after_seconds=round(time.monotonic() - started, 1),
            reachability={n: i["reachability"] for n, i in infos.items()},
        )
        started = time.monotonic()
        assert swarm.ask("a", {"op": "store", "key": "bench", "value": 1})["ok"]
        stored = time.monotonic() - started
        got = {n: swarm.ask(n, {"op": "get", "key": "bench"})["value"] for n in "bcd"}
        report(dht_store_seconds=round(stored, 3), dht_get_across_nats=got)
        average_pair(swarm, ("a", "b"), "ab", args)
        average_pair(swarm, ("a", "c"), "ac", args)
        average_pair(swarm, ("a", "relay"), "ar", args)
        bulk_costs(swarm, args)
    report(load_after=os.getloadavg())


if __name__ == "__main__":
    main()
