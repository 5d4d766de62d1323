"""How many TCP flows fill a long lossy link (issue 18 item 3): goodput of K parallel raw
TCP connections between two hosts behind packet-level delay lines, against the link's rate
and the Mathis estimate of one flow. Root only.

    sudo python benchmarks/benchmark_flows.py [--delay 0.15] [--mbit 20] [--loss 0.01]
        [--congestion cubic] [--flows 1 4 16 48] [--mib 4]

Two hosts (``Lab.add_delayed_host``), each with a ``tc tbf`` limit of ``--mbit`` on its link
and a delay line holding each packet ``delay / 2`` and dropping it with ``1 - sqrt(1 - loss)``
(so a path has one-way delay ``delay``, RTT ``2 delay``, loss ``loss`` per direction, as in
``benchmark_wan.py``); the namespaces' congestion control is ``--congestion``. Per flow count
K, ``--mib`` MiB split over K connections from one host to the other (``probe.py spray``);
goodput in Mbit/s and as a share of the rate. Baseline from the same script: Mathis et al.'s
steady-state rate of one Reno-like flow, ``MSS / RTT x 1.22 / sqrt(p)`` (cubic gets more at
a long RTT, BBR ignores random loss), and the flows it would take to fill the link.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netlab
from benchmark_wan import congestion_allowed, link_loss

PROBE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "netlab", "probe.py"
)
SINK_PORT = 5001
MSS = 1448  # bytes of payload per segment at MTU 1500 with timestamps


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def mathis_mbit(rtt: float, loss: float) -> float:
    """One flow's steady-state rate (Mathis, Semke, Mahdavi, Ott 1997), Mbit/s."""
    return MSS * 8 / rtt * 1.22 / math.sqrt(loss) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delay", type=float, default=0.15, help="one-way, seconds")
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--congestion", default="cubic")
    parser.add_argument("--flows", type=int, nargs="+", default=[1, 4, 16, 48])
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    reason = netlab.delay_line_unavailable_reason()
    if reason is None and not netlab.system.tc_available():
        reason = "the rate limits need tc (iproute2)"
    if reason:
        sys.exit(reason)
    rtt = 2 * args.delay
    one = mathis_mbit(rtt, args.loss) if args.loss else math.inf
    report(
        load_at_start=os.getloadavg(),
        mathis_mbit_per_flow=round(one, 3),
        flows_to_fill_the_link=math.ceil(args.mbit / one) if args.loss else 1,
    )
    with congestion_allowed(args.congestion), netlab.Lab() as lab:
        hosts = [
            lab.add_delayed_host(f"f{i}", delay=args.delay / 2, loss=link_loss(args.loss))
            for i in range(2)
        ]
        for host in hosts:
            lab.limit_rate(host, args.mbit)
            host.exec("sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={args.congestion}")
        lab.spawn(hosts[1], PROBE, "sink", str(SINK_PORT)).recv(30)
        for flows in args.flows:
            share = (args.mib << 20) // flows
            spray = lab.spawn(
                hosts[0], PROBE, "spray", str(SINK_PORT), str(share), *[hosts[1].ip] * flows
            )
            answer = spray.recv(args.timeout)
            assert not answer["errors"], answer
            mbit = share * flows * 8 / answer["seconds"] / 1e6
            late = max(lab.delay_line_statistics(h)["max_late"] for h in hosts)
            report(
                flows=flows,
                seconds=round(answer["seconds"], 2),
                mbit=round(mbit, 2),
                share_of_link=round(mbit / args.mbit, 3),
                mbit_per_flow=round(mbit / flows, 3),
                congestion=args.congestion,
                max_late=late,
                load=os.getloadavg()[0],
            )
    report(load_at_end=os.getloadavg())


if __name__ == "__main__":
    main()
