"""Churn soak (issue 18.4): ``--peers`` training processes; every ``--period`` s one is
SIGKILLed and a fresh one joins and loads the swarm's state. Root only (``tests/netlab``
namespaces on one bridge, no rate limit: loopback-like links).

    sudo nice -n 5 python benchmarks/benchmark_churn.py --mode optimizer --peers 8 --duration 120

Prints each status poll (the swarm's epoch, the peers' eval losses), every fault, each
newcomer's join (state loaded or not, epoch), and a summary: epochs at the start / end of the
churn / agreed last epoch, eval loss (median over live peers) at the first and last poll, status
answers later than the round deadline (hangs), non-finite parameters, each survivor's rounds
averaged / alone, the final synchronous state round and the largest parameter gap after it.
The baseline is the first poll of the same run (before any fault).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netlab
from netlab.churn import ChurnSoak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("optimizer", "diloco"), default="optimizer")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--period", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument(
        "--outer-lr", type=float, help="DiLoCo's outer SGD lr (default: DiLoCo's, 0.7)"
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        help="DiLoCo's outer Nesterov momentum (default: DiLoCo's, 0.9); on this small "
        "classifier 0.7 / 0.9 overfits within 10 outer steps even without churn "
        "(docs/reliability.md): the soak test uses 0.5 / 0.5",
    )
    args = parser.parse_args()
    reason = netlab.unavailable_reason()
    if reason:
        sys.exit(reason)
    print(json.dumps({"load_at_start": os.getloadavg()}), flush=True)
    train = {"matchmaking_time": args.matchmaking_time}
    if args.mode == "diloco":
        train["inner_steps"] = args.inner_steps
        if args.outer_lr is not None:
            train["outer_lr"] = args.outer_lr
        if args.outer_momentum is not None:
            train["outer_momentum"] = args.outer_momentum
    with netlab.Lab() as lab:
        soak = ChurnSoak(
            lab,
            mode=args.mode,
            peers=args.peers,
            period=args.period,
            averaging_timeout=args.averaging_timeout,
            train=train,
            on_event=lambda event: print(json.dumps(event), flush=True),
        )
        report = soak.run(args.duration)
    for name, done in report.done.items():
        print(json.dumps({"survivor": name, **done}))
    print(json.dumps({"summary": report.summary(), "load_at_end": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
