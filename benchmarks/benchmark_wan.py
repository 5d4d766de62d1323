"""All-reduce over WAN-like links (issue 18.3): round times against the bandwidth-optimal
butterfly time, at 50 / 150 ms one-way delay, 1% loss, 100 / 20 Mbit/s. Root only.

    sudo nice -n 5 python benchmarks/benchmark_wan.py [--floats 4194304] [--peers 4] [--rounds 3]
        [--tcp-butterfly 2] [--part-layout 0|1] [--trace FILE] [--latency packet|proxy]
        [--mtu 1500] [--log LOGGER ...] [--congestion cubic|bbr|reno|default]
        [--stripes K] [--lane-congestion auto|bbr|none] [--forwarder-priority rr|nice|none]
        [--no-lanes]

A ``tests/netlab`` lab per delay: ``--peers`` public hosts on one bridge, each with a ``tc
tbf`` rate limit on its link (both directions) and the delay and loss of ``--latency``:
``packet`` (default): each host sits behind a packet-level delay line
(``Lab.add_delayed_host``: a TUN forwarder in an access router) holding every packet ``delay /
2`` and dropping it with probability ``1 - sqrt(1 - loss)`` each way on each host's link, so a
packet between two hosts is delayed ``delay`` and lost with probability ``loss``, and
end-to-end TCP sees RTT = 2 x delay (``--mtu`` sets every link's MTU on those paths);
``proxy``: a delay proxy per host (every TCP connection a host opens is delayed ``delay`` each
way, TCP ends at the proxy) and ``iptables -m statistic`` loss on packets arriving at it. One
``peer.py`` per host (a ``DHT`` and a ``DecentralizedAverager`` over ``--floats`` float32),
every peer with the same group of ``--peers``. Per configuration, ``--rounds`` rounds; a
round's all-reduce time is the span from the first member entering all-reduce to the last one
finishing (matchmaking excluded; the whole step is printed too). Baseline from the same script:
the butterfly lower bound ``2 (N-1)/N x size / rate + 2 RTT`` (each peer sends and receives
(N-1)/N of its tensor in reduce-scatter and again in all-gather; one RTT per phase). The ratio
is the figure. A second, measured baseline (``--tcp-butterfly``): raw TCP with the round's
traffic pattern on the same paths (every host sends ``2 size / N`` to each other host at once),
i.e. what TCP itself gets out of these links with N-1 flows per direction
(``ratio_to_tcp_butterfly``).
``--congestion`` (default ``cubic``, what most users' hosts run) sets the TCP congestion
control of every host's namespace (``net.ipv4.tcp_congestion_control``; a new namespace
otherwise inherits this box's default, ``bbr`` here); ``default`` leaves it alone.
``--stripes K`` sets every peer's ``lane_stripes`` (the most connections per data lane on a
long path, each lane asks for a count chosen from its path's RTT and loss,
``swarmtrain.p2p.stripe_core``, and dials 2 when both ends use BBR there,
``lane_connections.stripes_to_dial``; default: the library's).
``--no-lanes``: peers without data lanes, so every bulk call takes the libp2p connection
(what peers behind NAT get), to measure that fallback.
``--trace FILE``: every peer records its rounds' part timelines (``AllReduceTrace``) and its
interface counters; a summary per round (the warm-up round 0 included) is printed (link busy
shares, reducer waits, per-flow throughput), the raw events go to FILE. ``--log LOGGER ...``:
those loggers at DEBUG in every peer; each peer's log goes to ``FILE.<delay>.p<i>.log``
(FILE: ``--trace``'s, else ``wan``).

Limitation of the proxy delay model: the proxy terminates TCP on the opener's host, so the
kernel's TCP window does not see the delay (the proxy's 16 MiB buffer holds the bytes in
flight); what sees the full RTT is end-to-end flow control above TCP (yamux windows) and
request/response turns; slow start and loss recovery at the full RTT are not modelled either
(this kernel has no netem/fq/etf qdisc: hence the packet-level line). The raw-TCP
butterfly crosses the same proxies or delay lines. The kernel's TCP limits for a real long
fat pipe are printed for reference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netlab
from _wan_trace import summarize_round
from netlab.nat_swarm import LISTEN_ALL, PEER_SCRIPT


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def butterfly_seconds(peers: int, size_bytes: int, mbit: float, rtt: float) -> float:
    return 2 * (peers - 1) / peers * size_bytes * 8 / (mbit * 1e6) + 2 * rtt


def kernel_tcp_limits(host) -> dict:
    names = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max", "net.core.wmem_max")
    out = host.exec("sysctl", *names)
    limits = dict(line.split(" = ") for line in out.strip().splitlines())
    return {k: v.replace("\t", " ") for k, v in limits.items()}


PROBE_SCRIPT = os.path.join(os.path.dirname(PEER_SCRIPT), "probe.py")
PROBE_PORT = 5000
SINK_PORT = 5001


def tcp_butterfly_seconds(lab, hosts, size_bytes: int) -> float:
    """Raw TCP on the same paths (delay proxies included) with the all-reduce's traffic
    pattern: every host sends ``2 size / N`` bytes to each other host at once (one connection
    each), so each uplink and downlink carries ``2 (N-1)/N x size``, as in a butterfly round;
    seconds until the last host's bytes were all confirmed. Phases are not modelled (a
    lower bound for what TCP moves on these links, not a schedule)."""
    share = 2 * size_bytes // len(hosts)
    senders = []
    for host in hosts:
        others = [h.ip for h in hosts if h is not host]
        senders.append(lab.spawn(host, PROBE_SCRIPT, "spray", str(SINK_PORT), str(share), *others))
    answers = [s.recv(300) for s in senders]
    assert all(not a["errors"] for a in answers), answers
    return max(a["seconds"] for a in answers)


def tcp_echo_seconds(lab, hosts, mib: int) -> float:
    """Raw TCP on the same path (delay proxy included): ``mib`` MiB from host 0 to host 1
    echoed back at once (full duplex, one connection), seconds."""
    probe = lab.spawn(
        hosts[0],
        PROBE_SCRIPT,
        *("connect", hosts[1].ip, str(PROBE_PORT), "--send", str(mib << 20), "--timeout", "120"),
    )
    answer = probe.recv(150)
    assert answer["echo_ok"], answer
    return answer["seconds"]


def bulk_calls(peers, mbit: float, delay: float, args) -> dict:
    """One pair's throughput: ``--bulk-mib`` MiB from peer 0 to peer 1, over a data lane
    (``bulk=True``) and over yamux (``bulk=False``), median of 2 each, against size / rate
    plus one RTT (the reply)."""
    target = peers[1].ask({"op": "info"}, 30)["peer_id"]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(2):
        for bulk in (True, False):
            message = {"op": "bulk_call", "peer": target, "mib": args.bulk_mib, "bulk": bulk}
            answer = peers[0].ask({**message, "timeout": args.timeout}, args.timeout + 30)
            assert answer["correct"], answer
            seconds[bulk].append(answer["seconds"])
    ideal = args.bulk_mib * (1 << 20) * 8 / (mbit * 1e6) + 2 * delay
    lane, yamux = (statistics.median(seconds[b]) for b in (True, False))
    return {
        "pair_ideal_seconds": round(ideal, 2),
        "pair_lane_ratio": round(lane / ideal, 2),
        "pair_yamux_ratio": round(yamux / ideal, 2),
        "pair_seconds": {"lane": seconds[True], "yamux": seconds[False]},
    }


@contextlib.contextmanager
def congestion_allowed(name: str):
    """``netlab.system.congestion_control_allowed`` for ``--congestion`` (``default``: no
    change), reporting the list when it was changed."""
    if name == "default":
        yield
        return
    with netlab.system.congestion_control_allowed(name) as allowed:
        if allowed is not None:
            report(allowed_congestion_control_for_the_run=allowed)
        yield


def link_loss(loss: float) -> float:
    """The loss on each of a path's two delay lines that makes ``loss`` on the path."""
    return 1 - (1 - loss) ** 0.5


def delay_line_counters(lab, hosts) -> dict:
    """Totals over the hosts' delay lines (packet mode): packets seen, lost, overflowed, and
    the largest lateness of a write past its due time (the forwarder's own delay)."""
    if not hosts[0].delay_line:
        return {}
    stats = [lab.delay_line_statistics(h) for h in hosts]
    total = {
        key: sum(s[f"{key}_{way}"] for s in stats for way in ("in", "out"))
        for key in ("seen", "lost", "overflow")
    }
    total["max_late"] = max(s["max_late"] for s in stats)
    total["priority"] = sorted({s.get("priority", "none") for s in stats})
    return {"delay_line_so_far": total}


def run_lab(delay: float, configs: list[tuple[float, float]], args) -> None:
    with netlab.Lab() as lab:
        if args.latency == "packet":
            hosts = [
                lab.add_delayed_host(
                    f"p{i}", delay=delay / 2, mtu=args.mtu, priority=args.forwarder_priority
                )
                for i in range(args.peers)
            ]
        else:
            hosts = [lab.add_public_host(f"p{i}") for i in range(args.peers)]
            if delay:
                for host in hosts:
                    lab.add_latency(host, delay)  # before any connection opens
        if args.congestion != "default":
            for host in hosts:
                host.exec(
                    "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={args.congestion}"
                )
        if delay == args.delays[0]:
            report(kernel_tcp_limits_in_a_namespace=kernel_tcp_limits(hosts[0]))
        congestion = hosts[0].exec("sysctl", "-n", "net.ipv4.tcp_congestion_control").strip()
        started = time.monotonic()
        log = {"log": args.log} if args.log else {}
        lanes = {} if args.stripes is None else {"lane_stripes": args.stripes}
        if args.lane_congestion:  # "none": the namespace's default on every lane
            lanes["lane_congestion"] = (
                None if args.lane_congestion == "none" else args.lane_congestion
            )
        if args.no_lanes:  # every bulk call over the one libp2p connection (yamux)
            lanes["use_data_lanes"] = False
        first = lab.spawn(
            hosts[0],
            PEER_SCRIPT,
            json.dumps({"dht": {"host_maddrs": LISTEN_ALL, **lanes}, **log}),
        )
        info = first.recv(120)
        boot = next(a for a in info["maddrs"] if f"/ip4/{hosts[0].ip}/" in a)
        peers = [first]
        for host in hosts[1:]:
            options = {
                "dht": {"host_maddrs": LISTEN_ALL, "initial_peers": [boot], **lanes},
                **log,
            }
            peers.append(lab.spawn(host, PEER_SCRIPT, json.dumps(options)))
        for peer in peers[1:]:
            peer.recv(120)
        if args.bulk_mib:
            lab.spawn(hosts[1], PROBE_SCRIPT, "serve", str(PROBE_PORT)).recv(30)
        if args.tcp_butterfly:
            for host in hosts:
                lab.spawn(host, PROBE_SCRIPT, "sink", str(SINK_PORT)).recv(30)
        report(delay=delay, startup_seconds=round(time.monotonic() - started, 1))
        try:
            for index, (mbit, loss, codec) in enumerate(configs):
                for host in hosts:
                    lab.limit_rate(host, mbit)
                    if args.latency == "packet":
                        lab.set_delay_line(host, loss=link_loss(loss))
                    else:
                        lab.set_loss(host, loss)
                message = {
                    "op": "average",
                    "prefix": f"wan{index}",
                    "rounds": 1,
                    "floats": args.floats,
                    "group_size": args.peers,
                    "timeout": args.timeout,
                    "matchmaking_time": 3.0,
                    "request_timeout": max(1.0, 8 * delay),
                    "averager": {"next_chunk_timeout": 30.0, "float16": codec == "float16"},
                    "trace": bool(args.trace),
                    "part_layout": args.part_layout,
                }
                spans, steps, layouts, partial = [], [], [], []
                for number in range(args.rounds + 1):  # round 0 opens the connections and lanes
                    for i, peer in enumerate(peers):
                        peer.send({**message, "value": float(i)})
                    results = [peer.recv(args.timeout + 30)["rounds"][0] for peer in peers]
                    if args.trace:  # the warm-up round too (it opens connections and lanes)
                        summary = summarize_round(results, mbit)
                        report(
                            trace_of_round=number, delay_ms=int(delay * 1000), mbit=mbit, **summary
                        )
                        with open(args.trace, "a") as out:
                            key = {"delay": delay, "mbit": mbit, "loss": loss, "round": number}
                            raw = [{k: r.get(k) for k in ("trace", "link")} for r in results]
                            out.write(json.dumps({**key, "peers": raw}) + "\n")
                    assert all(r["group"] == args.peers for r in results), results
                    expected = (args.peers - 1) / 2
                    if any(abs(r["value"] - expected) >= 1e-4 for r in results):
                        partial.append(number)  # a part was not averaged by everyone
                    began = min(r["allreduce_began"] for r in results)
                    spans.append(max(r["ended"] for r in results) - began)
                    layouts.append(min(r.get("part_layout", -1) for r in results))
                    steps.append(max(r["seconds"] for r in results))
                size = args.floats * (2 if codec == "float16" else 4)
                bound = butterfly_seconds(args.peers, size, mbit, 2 * delay)
                median = statistics.median(spans[1:])
                tcp = {}
                if args.tcp_butterfly:
                    raw = [
                        tcp_butterfly_seconds(lab, hosts, size) for _ in range(args.tcp_butterfly)
                    ]
                    tcp = {
                        "tcp_butterfly_seconds": [round(s, 2) for s in raw],
                        "ratio_to_tcp_butterfly": round(median / statistics.median(raw), 2),
                    }
                lanes_used = [peer.ask({"op": "paths"}, 30) for peer in peers]
                lane_counters = {
                    key: sum(c.get(key, 0) for c in lanes_used)
                    for key in ("lanes_opened", "striped_lanes_opened", "lane_fallbacks")
                }
                pair = bulk_calls(peers, mbit, delay, args) if args.bulk_mib else {}
                if args.bulk_mib:
                    # the link's real goodput (L2 headers, ACKs, tbf): the measured butterfly
                    echo = tcp_echo_seconds(lab, hosts, args.bulk_mib)
                    goodput = args.bulk_mib * (1 << 20) * 8 / 1e6 / (echo - 2 * delay)
                    measured = butterfly_seconds(args.peers, size, goodput, 2 * delay)
                    pair.update(
                        tcp_goodput_mbit=round(goodput, 1),
                        butterfly_measured_seconds=round(measured, 2),
                        ratio_to_measured=round(median / measured, 2),
                    )
                report(
                    delay_ms=int(delay * 1000),
                    rtt_ms=int(2 * delay * 1000),
                    mbit=mbit,
                    loss=loss,
                    latency=args.latency,
                    congestion=congestion,
                    stripes=args.stripes,
                    lanes=not args.no_lanes,
                    mtu=args.mtu if args.latency == "packet" else None,
                    codec=codec,
                    floats=args.floats,
                    peers=args.peers,
                    butterfly_seconds=round(bound, 2),
                    allreduce_seconds_median=round(median, 2),
                    ratio=round(median / bound, 2),
                    allreduce_seconds=[round(s, 2) for s in spans],
                    step_seconds=[round(s, 2) for s in steps],
                    part_layout_offered_after=layouts,
                    partial_rounds=partial,
                    load=os.getloadavg()[0],
                    lanes_so_far=lane_counters,
                    **tcp,
                    **pair,
                    **delay_line_counters(lab, hosts),
                )
        finally:
            if args.log:
                for i, peer in enumerate(peers):
                    with open(f"{args.trace or 'wan'}.{delay}.p{i}.log", "w") as out:
                        out.write(peer.stderr(limit=None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--floats", type=int, default=4 << 20)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.15])
    parser.add_argument("--mbits", type=float, nargs="+", default=[100.0, 20.0])
    parser.add_argument("--losses", type=float, nargs="+", default=[0.0, 0.01])
    parser.add_argument(
        "--codecs",
        nargs="+",
        choices=("none", "float16"),
        default=["none"],
        help="float16: DiLoCo's round (its pseudo-gradient codec)",
    )
    parser.add_argument(
        "--latency",
        choices=("packet", "proxy"),
        default="packet",
        help="packet: a packet-level delay line per host (TCP sees the RTT and the loss); "
        "proxy: the TCP delay proxy and iptables loss (TCP ends at the proxy)",
    )
    parser.add_argument(
        "--mtu", type=int, default=1500, help="MTU of every link on the paths (packet mode)"
    )
    parser.add_argument("--bulk-mib", type=int, default=8, help="pair throughput (0: skip)")
    parser.add_argument(
        "--part-layout",
        type=int,
        help="pin the part layout every peer offers (swarmtrain.averaging.partition.PART_LAYOUTS: "
        "0 cuts a slice into ~8 parts, 1 into parts of up to 2 MiB; default: the averager's "
        "choice, finer parts after a round its links held back)",
    )
    parser.add_argument(
        "--tcp-butterfly",
        type=int,
        default=2,
        metavar="RUNS",
        help="measured baseline: raw TCP with the round's traffic pattern, RUNS times (0: skip)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="record every measured round's part timeline and link counters: a summary per "
        "round is printed, the raw events are appended to FILE (JSON lines)",
    )
    parser.add_argument(
        "--log",
        nargs="+",
        metavar="LOGGER",
        help="these loggers at DEBUG in every peer (e.g. swarmtrain.p2p.lane), one file per "
        "peer and lab next to --trace's FILE",
    )
    parser.add_argument(
        "--congestion",
        default="cubic",
        help="TCP congestion control in every host's namespace (cubic, bbr, reno; "
        "default: leave the namespace's, inherited from this box)",
    )
    parser.add_argument(
        "--stripes",
        type=int,
        help="every peer's lane_stripes (the most TCP connections per data lane on a long "
        "path; with BBR at both ends a lane dials 2 of them: --lane-congestion none for K)",
    )
    parser.add_argument(
        "--lane-congestion",
        help="every peer's P2PConfig.lane_congestion (the lane sockets' TCP congestion "
        "control, e.g. bbr in cubic namespaces; none: the namespace's; default: the "
        "library's, auto: bbr on long paths where allowed)",
    )
    parser.add_argument(
        "--forwarder-priority",
        choices=("rr", "nice", "none"),
        default="rr",
        help="the delay lines' scheduling (packet mode): rr (SCHED_RR, else nice -15), nice "
        "(-15), none (a busy box then delays packets: max_late)",
    )
    parser.add_argument(
        "--no-lanes",
        action="store_true",
        help="no data lanes (use_data_lanes=False): bulk calls go over libp2p, as behind NAT",
    )
    args = parser.parse_args()
    if args.latency == "packet":
        reason = netlab.delay_line_unavailable_reason()
        if reason is None and not netlab.system.tc_available():
            reason = "the rate limits need tc (iproute2)"
    else:
        reason = netlab.iptables_unavailable_reason()
    if reason:
        sys.exit(reason)
    report(load_at_start=os.getloadavg())
    with congestion_allowed(args.congestion):
        for delay in args.delays:
            losses = [0.0] if delay == 0 else args.losses
            configs = [(m, loss, c) for m in args.mbits for loss in losses for c in args.codecs]
            run_lab(delay, configs, args)
    report(load_at_end=os.getloadavg())


if __name__ == "__main__":
    main()
