"""What the packet-level delay line (``tests/netlab/delay_line.py``) can carry on this box.
Root only.

    sudo nice -n 5 python benchmarks/benchmark_delay_line.py [--mib 64] [--mtus 1500 9000]
        [--delays 0 0.05] [--flows 1 3]

Two hosts, each behind its own delay line (``Lab.add_delayed_host``: a path crosses both
forwarders, as in ``benchmark_wan.py``), no rate limit. Per MTU, one-way delay (split over
the two lines) and flow count: ``--mib`` MiB over raw TCP (``probe.py spray``, ``flows``
connections to the same sink) from one host to the other; goodput in Mbit/s, packets through
the lines and the forwarders' CPU seconds (both processes, from /proc), i.e. the packet rate
one forwarder sustains per CPU second. Baseline from the same run: the same transfer between
two plain hosts on the bridge (no line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netlab

PROBE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "netlab", "probe.py"
)
SINK_PORT = 5001


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transfer(lab, sender, receiver, mib: int, flows: int) -> float:
    """Seconds for ``mib`` MiB from ``sender`` to ``receiver`` over ``flows`` connections."""
    share = (mib << 20) // flows
    spray = lab.spawn(sender, PROBE, "spray", str(SINK_PORT), str(share), *[receiver.ip] * flows)
    answer = spray.recv(600)
    assert not answer["errors"], answer
    return answer["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--mtus", type=int, nargs="+", default=[1500, 9000])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05])
    parser.add_argument("--flows", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    reason = netlab.delay_line_unavailable_reason()
    if reason:
        sys.exit(reason)
    report(load_at_start=os.getloadavg())
    with netlab.Lab() as lab:
        plain = [lab.add_public_host(f"q{i}") for i in range(2)]
        lab.spawn(plain[1], PROBE, "sink", str(SINK_PORT)).recv(30)
        for flows in args.flows:
            seconds = transfer(lab, plain[0], plain[1], args.mib, flows)
            mbit = args.mib * (1 << 20) * 8 / seconds / 1e6
            report(line=False, flows=flows, seconds=round(seconds, 2), mbit=round(mbit, 1))
        for mtu in args.mtus:
            hosts = [lab.add_delayed_host(f"m{mtu}h{i}", mtu=mtu) for i in range(2)]
            lab.spawn(hosts[1], PROBE, "sink", str(SINK_PORT)).recv(30)
            for delay in args.delays:
                for host in hosts:
                    lab.set_delay_line(host, delay=delay / 2)
                for flows in args.flows:
                    pids = [h.delay_line.pid for h in hosts]
                    cpu = [cpu_seconds(p) for p in pids]
                    before = [lab.delay_line_statistics(h) for h in hosts]
                    seconds = transfer(lab, hosts[0], hosts[1], args.mib, flows)
                    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu, strict=True)]
                    after = [lab.delay_line_statistics(h) for h in hosts]
                    packets = sum(
                        a[f"seen_{w}"] - b[f"seen_{w}"]
                        for a, b in zip(after, before, strict=True)
                        for w in ("in", "out")
                    )
                    mbit = args.mib * (1 << 20) * 8 / seconds / 1e6
                    report(
                        line=True,
                        mtu=mtu,
                        delay_ms=int(delay * 1000),
                        flows=flows,
                        seconds=round(seconds, 2),
                        mbit=round(mbit, 1),
                        packets_per_line=packets // 2,
                        forwarder_cpu_seconds=[round(c, 2) for c in cpu],
                        packets_per_cpu_second=int(packets / max(sum(cpu), 1e-9)),
                        overflow=sum(a["overflow_in"] + a["overflow_out"] for a in after),
                        max_late=max(a["max_late"] for a in after),
                        load=os.getloadavg()[0],
                    )
    report(load_at_end=os.getloadavg())


if __name__ == "__main__":
    main()
