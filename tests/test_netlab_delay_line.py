"""The packet-level delay line (``Lab.add_delayed_host``, root only): end-to-end TCP sees the
configured RTT, jitter keeps the byte order, and the random loss matches its probability
(bounds from the binomial distribution). Checked with stdlib probes (``netlab/probe.py``)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import netlab
import pytest
from netlab.system import run

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netlab", "probe.py")
PORT = 9000
UDP_PORT = 9001
DELAY = 0.1  # seconds each way on the delayed host's access link
# what a write may come after its due time on a busy box (scheduling of the forwarder and
# the probes: at load 20 a few tens of ms), less than the delay, so a line that held packets
# twice would still fail; the lower bounds are exact: nothing arrives before its delay
SCHEDULING_SLACK = 0.1


@pytest.fixture(scope="module")
def lab():
    reason = netlab.delay_line_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netlab.Lab() as lab:
        server = lab.add_public_host("server")
        lab.add_delayed_host("far", delay=DELAY)
        lab.spawn(server, PROBE, "serve", str(PORT)).recv(10)
        yield lab


def probe(host, *args: str, timeout: float = 60) -> dict:
    out = host.exec(sys.executable, PROBE, *args, timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def binomial_interval(n: int, p: float, tail: float = 1e-6) -> tuple[int, int]:
    """The smallest and largest k with P(X <= k) > tail and P(X >= k) > tail, X ~ B(n, p)."""

    def log_pmf(k: int) -> float:
        choose = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        return choose + k * math.log(p) + (n - k) * math.log1p(-p)

    pmf = [math.exp(log_pmf(k)) for k in range(n + 1)]
    low, below = 0, pmf[0]
    while below <= tail:
        low += 1
        below += pmf[low]
    high, above = n, pmf[n]
    while above <= tail:
        high -= 1
        above += pmf[high]
    return low, high


def test_tcp_sees_the_configured_round_trip_time(lab):
    far, server = lab.hosts["far"], lab.hosts["server"]
    lab.set_delay_line(far, delay=DELAY, jitter=0.0)
    seen = probe(far, "connect", server.ip, str(PORT), "--pings", "20")
    assert seen["peer"].split(":")[0] == far.ip  # routed, not proxied: the host's own address
    rtts = [seen["rtt"], *seen["rtts"]]
    assert min(rtts) >= 2 * DELAY  # each packet held DELAY, one way and back
    assert statistics.median(rtts) <= 2 * DELAY + SCHEDULING_SLACK


def test_jitter_varies_the_delay_and_keeps_the_byte_order(lab):
    far, server = lab.hosts["far"], lab.hosts["server"]
    jitter = 0.03
    lab.set_delay_line(far, delay=DELAY, jitter=jitter)
    try:
        seen = probe(far, "connect", server.ip, str(PORT), "--pings", "20", "--send", str(2 << 20))
    finally:
        lab.set_delay_line(far, jitter=0.0)
    rtts = [seen["rtt"], *seen["rtts"]]
    assert min(rtts) >= 2 * DELAY
    # two uniform draws in [0, jitter] per echo: 21 echoes all within jitter / 3 of each other
    # has a probability below 1e-9
    assert max(rtts) - min(rtts) >= jitter / 3
    assert seen["echo_ok"]  # 2 MiB in ~1448-byte packets, each delayed differently, in order


def test_random_loss_drops_the_configured_share_of_packets(lab):
    far, server = lab.hosts["far"], lab.hosts["server"]
    sink = lab.spawn(server, PROBE, "udp-sink", str(UDP_PORT))
    sink.recv(10)
    sent, loss = 3000, 0.05
    before = lab.delay_line_statistics(far)
    lab.set_delay_line(far, loss=loss)
    try:
        probe(far, "udp-send", server.ip, str(UDP_PORT), str(sent))
    finally:
        lab.set_delay_line(far, loss=0.0)
    low, high = binomial_interval(sent, loss)  # [97, 210] of 3000 at 5%: ~5.5 sd
    deadline = time.monotonic() + 10
    while True:  # the last datagrams are still in the line (DELAY) when udp-send returns
        after = lab.delay_line_statistics(far)
        lost = after["lost_out"] - before["lost_out"]
        count = sink.ask({"op": "count"}, 10)["count"]
        if count + lost >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling for the condition, bounded by the deadline
    missing = sent - count
    assert low <= missing <= high
    # the line dropped every missing datagram, nothing else did; it may also have dropped a
    # few other packets that left the host meanwhile (a previous test's TCP teardown: a CI
    # run lost 154 datagrams and 1 such packet)
    assert missing <= lost <= missing + 5
    assert after["overflow_out"] == before["overflow_out"]


def test_the_forwarder_runs_with_real_time_priority(lab):
    """A busy box must not delay the line's packets: the forwarder asks for SCHED_RR (root
    may), else nice -15, and says which it got."""
    far = lab.hosts["far"]
    assert lab.delay_line_statistics(far)["priority"] == "rr"
    assert os.sched_getscheduler(far.delay_line.pid) == os.SCHED_RR


def test_a_delayed_lab_leaves_nothing_behind():
    if netlab.delay_line_unavailable_reason() is not None:
        pytest.skip(netlab.delay_line_unavailable_reason())
    with netlab.Lab() as lab:
        host = lab.add_delayed_host("x", delay=0.01)
        names = list(lab.namespaces)
        forwarder = host.delay_line
    assert len(names) == 3  # the bridge, the host, its router
    assert not set(names) & set(run("ip", "netns", "list").split())
    assert forwarder._proc.poll() is not None
    assert "dl0" not in run("ip", "-o", "link")  # the TUN device went with its namespace
