"""The netlab harness itself (root only): NAT boxes, the delay proxy, rate limits, loss and
cleanup, checked with stdlib probes (``netlab/probe.py``) in the lab's namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import netlab
import pytest
from netlab.system import run

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netlab", "probe.py")
PORT = 9000


@pytest.fixture(scope="module")
def lab():
    reason = netlab.iptables_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netlab.Lab() as lab:
        server = lab.add_public_host("server")
        for name in ("lat", "rate", "loss", "direct"):
            lab.add_public_host(name)
        lab.add_home("cone", nat="cone").add_host("conehost")
        lab.add_home("sym", nat="symmetric").add_host("symhost")
        lab.spawn(server, PROBE, "serve", str(PORT)).recv(10)
        lab.spawn(lab.hosts["conehost"], PROBE, "serve", str(PORT)).recv(10)
        yield lab


def probe(host, *args: str, timeout: float = 60) -> dict:
    out = host.exec(sys.executable, PROBE, *args, timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def test_nat_boxes_map_ports_as_their_kind_says_and_drop_unsolicited_packets(lab):
    server_ip = lab.hosts["server"].ip
    cone, sym = lab.homes["cone"], lab.homes["sym"]
    seen = probe(lab.hosts["conehost"], "connect", server_ip, str(PORT), "--bind", "40001")
    assert seen["peer"] == f"{cone.wan_ip}:40001"  # port kept: a cone NAT
    ports = set()
    for source in ("40001", "40002"):
        seen = probe(lab.hosts["symhost"], "connect", server_ip, str(PORT), "--bind", source)
        ip, port = seen["peer"].split(":")
        assert ip == sym.wan_ip
        ports.add(port)
    assert ports != {"40001", "40002"}  # --random-fully: new ports
    # nobody outside reaches the server behind the cone NAT: the NAT box drops the SYN
    outside = probe(lab.hosts["server"], "connect", cone.wan_ip, str(PORT), "--timeout", "1")
    assert outside == {"connect_error": "TimeoutError"}
    # the home network's private address is not routed on the public segment
    private = probe(
        lab.hosts["server"], "connect", netlab.HOME_LAN + ".2", str(PORT), "--timeout", "1"
    )
    assert "connect_error" in private


def test_public_hosts_reach_each_other_directly(lab):
    seen = probe(lab.hosts["direct"], "connect", lab.hosts["server"].ip, str(PORT))
    assert seen["peer"].split(":")[0] == lab.hosts["direct"].ip


def test_delay_proxy_delays_both_ways_and_keeps_the_byte_order(lab):
    host = lab.hosts["lat"]
    lab.add_latency(host, delay=0.05, jitter=0.02)
    seen = probe(host, "connect", lab.hosts["server"].ip, str(PORT), "--send", str(4 << 20))
    assert seen["peer"].split(":")[0] == host.ip  # transparent to the IP
    assert seen["rtt"] >= 0.1  # 50 ms each way
    assert seen["echo_ok"]  # 4 MiB in 64 KiB chunks with jitter came back in order


def test_rate_limit_caps_throughput(lab):
    host = lab.hosts["rate"]
    lab.limit_rate(host, mbit=20)
    size = 2_500_000  # 1.0 s each way at 20 Mbit/s (both directions run at once)
    seen = probe(host, "connect", lab.hosts["server"].ip, str(PORT), "--send", str(size))
    assert seen["echo_ok"]
    assert seen["seconds"] >= 0.9


def test_random_loss_drops_about_the_configured_share(lab):
    host, sender = lab.hosts["loss"], lab.hosts["direct"]
    sink = lab.spawn(host, PROBE, "udp-sink", "9001")
    sink.recv(10)
    lab.set_loss(host, 0.2)
    try:
        probe(sender, "udp-send", host.ip, "9001", "2000")
    finally:
        lab.set_loss(host, 0)
    count = sink.ask({"op": "count"}, 10)["count"]
    assert 0.74 * 2000 <= count <= 0.86 * 2000  # 20% dropped, +-6 standard deviations


def test_lab_leaves_nothing_behind_and_removes_labs_of_dead_runs():
    if netlab.unavailable_reason() is not None:
        pytest.skip(netlab.unavailable_reason())
    with netlab.Lab() as lab:
        host = lab.add_public_host("x")
        sleeper = lab.spawn(host, PROBE, "serve", "9002")
        sleeper.recv(10)
        names = list(lab.namespaces)
    assert not set(names) & set(run("ip", "netns", "list").split())
    assert sleeper._proc.poll() is not None
    # a namespace of a lab whose process died (a killed test run)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netlab.topology.LAB_PREFIX}{dead.pid}a-stale"
    run("ip", "netns", "add", stale)
    assert stale in netlab.remove_stale_labs()
    assert stale not in run("ip", "netns", "list")
