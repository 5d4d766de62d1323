"""Hosts in network namespaces: a public segment (the "internet"), home networks behind NAT
boxes, and the knobs that make links behave like WAN links.

Layout (every box is a network namespace named ``<lab tag>-<name>``)::

    public host --veth--+                         +--veth-- home host (10.231.250.2)
    public host --veth--+-- br0 (the "net" ns) --veth-- NAT box ("<home>-nat")
                        |   10.231.<run>.0/24        wan: 10.231.<run>.(100+k)
                        +--veth-- NAT box ...        lan: 10.231.250.1 on bridge "lanbr"

Every home uses the same LAN subnet, as home routers do (a peer that dials another home's
private address reaches its own network, not the other peer). A NAT box forwards LAN -> WAN
with iptables MASQUERADE and drops unsolicited packets from the WAN (a home router's
firewall): ``nat="cone"`` keeps source ports (endpoint-independent mapping: DCUtR's predicted
address WAN-IP:listen-port is right), ``nat="symmetric"`` adds ``--random-fully`` (every
new connection, hole-punch dials included, gets a random WAN port: the prediction is wrong).

Traffic goes only to addresses inside the lab: no namespace has a route out of it.

Resource handling: ``Lab`` is a context manager; leaving it (also after an error) stops the
processes it started, kills anything still running inside its namespaces and deletes them
(deleting a namespace deletes its links). A lab left behind by a killed test run is deleted
by the next ``Lab`` (namespaces carry the creating process's pid).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .process import PeerProcess
from .system import run

LAB_PREFIX = "nl"
PUBLIC_NET = "10.231.{run}.0/24"
HOME_LAN = "10.231.250"  # every home: 10.231.250.0/24, the NAT box at .1
LAB_SUBNET = "10.231.0.0/16"  # everything the lab owns (delay proxies intercept this)
NAT_KINDS = ("cone", "symmetric")
DELAY_PROXY_PORT = 47000  # inside each delayed host's namespace
DELAY_LINE_TUN = "dl0"  # the TUN device in a delayed host's access router
DELAY_LINE_TABLE = "100"  # the router's routing table that sends forwarded packets into it
DELAY_LINE_MTU = 1500
QUIT_GRACE = 5.0  # seconds the lab's processes get to exit on their own when it closes
_labs = itertools.count()


@dataclass
class Host:
    """A machine: its namespace, its one interface and address, and the far end of its link."""

    lab: Lab
    name: str
    ns: str
    ip: str
    ifname: str
    uplink_ns: str  # namespace of the other end of the link (a bridge or a NAT box)
    uplink_if: str
    home: Home | None = None
    delay_line: PeerProcess | None = None  # ``Lab.add_delayed_host``: its forwarder

    def exec(self, *command: str, timeout: float = 10.0, check: bool = True) -> str:
        return self.lab.exec(self.ns, *command, timeout=timeout, check=check)

    def interface_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes on this host's interface so far (kernel counters)."""
        base = f"/sys/class/net/{self.ifname}/statistics"
        out = self.exec("cat", f"{base}/rx_bytes", f"{base}/tx_bytes").split()
        return int(out[0]), int(out[1])


@dataclass
class Home:
    """A home network: a NAT box (namespace ``router_ns``) and the hosts behind it."""

    lab: Lab
    name: str
    nat: str
    router_ns: str
    wan_ip: str
    wan_if: str
    hosts: list[Host] = field(default_factory=list)

    def add_host(self, name: str) -> Host:
        """A host on this home's LAN (10.231.250.2, .3, ...), default route via the NAT box."""
        index = len(self.hosts)
        ip = f"{HOME_LAN}.{index + 2}"
        ns = self.lab._new_ns(name)
        inside, outside = self.lab._ifnames()
        self.lab._veth(ns, inside, self.router_ns, outside)
        self.lab.exec(self.router_ns, "ip", "link", "set", outside, "master", "lanbr")
        self.lab.exec(self.router_ns, "ip", "link", "set", outside, "up")
        self.lab._address(ns, inside, f"{ip}/24")
        self.lab.exec(ns, "ip", "route", "add", "default", "via", f"{HOME_LAN}.1")
        host = Host(self.lab, name, ns, ip, inside, self.router_ns, outside, home=self)
        self.hosts.append(host)
        self.lab.hosts[name] = host
        return host


class Lab:
    """A set of namespaces joined by veths and bridges (see the module docstring)."""

    def __init__(self) -> None:
        number = next(_labs)
        self.tag = f"{LAB_PREFIX}{os.getpid()}{'abcdefghijklmnopqrstuvwxyz'[number % 26]}"
        self.run_octet = (os.getpid() * 7 + number) % 199 + 1  # 10.231.<1..199>.0/24
        self.public_prefix = f"10.231.{self.run_octet}"
        self.namespaces: list[str] = []
        self.hosts: dict[str, Host] = {}
        self.homes: dict[str, Home] = {}
        self.processes: list[PeerProcess] = []
        self._if_counter = itertools.count()
        self._public_count = 0
        self.net_ns = ""

    # ------------------------------------------------------------- lifetime

    def __enter__(self) -> Lab:
        remove_stale_labs()
        try:
            self.net_ns = self._new_ns("net")
            self.exec(self.net_ns, "ip", "link", "add", "br0", "type", "bridge")
            self.exec(self.net_ns, "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop our processes, kill what else runs in our namespaces, delete them."""
        for process in self.processes:
            process.request_quit()
        deadline = time.monotonic() + QUIT_GRACE
        for process in self.processes:
            try:
                process.close(timeout=max(deadline - time.monotonic(), 0.1))
            except Exception:
                pass
        self.processes.clear()
        for ns in reversed(self.namespaces):
            _delete_namespace(ns)
        self.namespaces.clear()

    # ------------------------------------------------------------- building

    def exec(self, ns: str, *command: str, timeout: float = 10.0, check: bool = True) -> str:
        return run("ip", "netns", "exec", ns, *command, timeout=timeout, check=check)

    def _new_ns(self, name: str) -> str:
        if not re.fullmatch(r"[a-z0-9]{1,12}", name):
            raise ValueError(f"lab names are 1-12 lowercase letters or digits, not {name!r}")
        ns = f"{self.tag}-{name}"
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        self.exec(ns, "ip", "link", "set", "lo", "up")
        return ns

    def _ifnames(self) -> tuple[str, str]:
        i = next(self._if_counter)
        return f"eth{i}", f"port{i}"

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        # created in the first namespace, then one end moved: no name ever lives in the root one
        self.exec(ns_a, "ip", "link", "add", if_a, "type", "veth", "peer", "name", if_b)
        self.exec(ns_a, "ip", "link", "set", if_b, "netns", ns_b)

    def _address(self, ns: str, ifname: str, cidr: str) -> None:
        self.exec(ns, "ip", "addr", "add", cidr, "dev", ifname)
        self.exec(ns, "ip", "link", "set", ifname, "up")

    def _attach_public(self, ns: str, ip: str) -> tuple[str, str]:
        inside, outside = self._ifnames()
        self._veth(ns, inside, self.net_ns, outside)
        self.exec(self.net_ns, "ip", "link", "set", outside, "master", "br0")
        self.exec(self.net_ns, "ip", "link", "set", outside, "up")
        self._address(ns, inside, f"{ip}/24")
        return inside, outside

    def add_public_host(self, name: str) -> Host:
        """A host with a public address (10.231.<run>.1, .2, ...) on the internet segment."""
        self._public_count += 1
        ip = f"{self.public_prefix}.{self._public_count}"
        ns = self._new_ns(name)
        inside, outside = self._attach_public(ns, ip)
        # an on-link default route: the host knows which IP it would reach "the internet" from
        # (swarmtrain lists that address first for a wildcard listener); nothing answers there
        self.exec(ns, "ip", "route", "add", "default", "dev", inside)
        host = Host(self, name, ns, ip, inside, self.net_ns, outside)
        self.hosts[name] = host
        return host

    def add_delayed_host(
        self,
        name: str,
        delay: float = 0.0,
        jitter: float = 0.0,
        loss: float = 0.0,
        mtu: int = DELAY_LINE_MTU,
        priority: str = "rr",
    ) -> Host:
        """A public host (10.231.<run>.k, like ``add_public_host``) behind its own access
        router (namespace ``<name>dl``) whose forwarding path runs through a packet-level
        delay line (``delay_line.py``): every packet to or from the host is held ``delay`` s
        (+ up to ``jitter`` s, order kept) and dropped with probability ``loss``, each way.
        A path between two delayed hosts crosses two lines (one-way delay ``2 x delay``);
        change the settings with ``set_delay_line``. ``mtu`` applies to every link of the
        host's path (the bridge port included): larger packets, fewer for the forwarder.
        ``limit_rate`` then shapes the host's veth and the router's veth towards it.
        ``priority``: the forwarder's scheduling (``delay_line.PRIORITIES``: ``rr`` real-time
        round robin, else nice -15; ``nice``; ``none``), so a busy box does not delay packets.

        How: the router answers ARP for the host on the bridge and for everything else on the
        host's side (proxy ARP), and policy routing sends what arrives on either veth into a
        TUN device; the forwarder writes each packet back into it, and packets arriving from
        the TUN device take the main table (host /32 on one side, the public /24 on the other).
        """
        if len(name) > 10:
            raise ValueError(f"a delayed host's name has at most 10 characters, not {name!r}")
        self._public_count += 1
        ip = f"{self.public_prefix}.{self._public_count}"
        ns = self._new_ns(name)
        router = self._new_ns(f"{name}dl")
        host_if, router_host_if = self._ifnames()
        self._veth(ns, host_if, router, router_host_if)
        router_wan_if, bridge_port = self._ifnames()
        self._veth(router, router_wan_if, self.net_ns, bridge_port)
        for side_ns, ifname in (
            (ns, host_if),
            (router, router_host_if),
            (router, router_wan_if),
            (self.net_ns, bridge_port),
        ):
            self.exec(side_ns, "ip", "link", "set", ifname, "mtu", str(mtu))
        self.exec(self.net_ns, "ip", "link", "set", bridge_port, "master", "br0")
        self.exec(self.net_ns, "ip", "link", "set", bridge_port, "up")
        self._address(ns, host_if, f"{ip}/24")
        self.exec(ns, "ip", "route", "add", "default", "dev", host_if)
        # the router: an address of its own (ARP requests need a source), no route of its own
        # through the line; forwarding, no reverse-path filter (packets from the TUN device
        # carry other interfaces' sources), immediate proxy ARP answers
        router_ip = f"{self.public_prefix}.{200 + self._public_count}"
        self.exec(router, "ip", "addr", "add", f"{router_ip}/32", "dev", "lo")
        tun = DELAY_LINE_TUN
        self.exec(router, "ip", "tuntap", "add", "dev", tun, "mode", "tun")
        self.exec(router, "ip", "link", "set", tun, "mtu", str(mtu), "txqueuelen", "10000")
        for ifname in (router_host_if, router_wan_if, tun):
            self.exec(router, "ip", "link", "set", ifname, "up")
        sysctls = ["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"]
        for ifname in (router_host_if, router_wan_if, tun):
            sysctls.append(f"net.ipv4.conf.{ifname}.rp_filter=0")
        for ifname in (router_host_if, router_wan_if):
            sysctls.append(f"net.ipv4.neigh.{ifname}.proxy_delay=0")
        sysctls.append(f"net.ipv4.conf.{router_host_if}.proxy_arp=1")
        self.exec(router, "sysctl", "-q", "-w", *sysctls)
        self.exec(router, "ip", "neigh", "add", "proxy", ip, "dev", router_wan_if)
        self.exec(router, "ip", "route", "add", f"{ip}/32", "dev", router_host_if)
        self.exec(router, "ip", "route", "add", f"{self.public_prefix}.0/24", "dev", router_wan_if)
        script = os.path.join(os.path.dirname(__file__), "delay_line.py")
        line = self.spawn_in(
            router,
            script,
            *("--tun", tun, "--host", ip, "--delay", str(delay), "--jitter", str(jitter)),
            *("--loss", str(loss), "--priority", priority),
        )
        line.recv(timeout=10)
        self.exec(router, "ip", "route", "add", "default", "dev", tun, "table", DELAY_LINE_TABLE)
        for pref, ifname in (("100", router_host_if), ("101", router_wan_if)):
            self.exec(
                *(router, "ip", "rule", "add", "iif", ifname),
                *("lookup", DELAY_LINE_TABLE, "pref", pref),
            )
        host = Host(self, name, ns, ip, host_if, router, router_host_if, delay_line=line)
        self.hosts[name] = host
        return host

    def set_delay_line(self, host: Host, **settings: float) -> None:
        """Change ``host``'s delay line: any of ``delay``, ``jitter``, ``loss`` (packets read
        from now on)."""
        if host.delay_line is None:
            raise ValueError(f"{host.name} has no delay line (use add_delayed_host)")
        host.delay_line.ask({"op": "set", **settings}, timeout=10)

    def delay_line_statistics(self, host: Host) -> dict:
        """``host``'s delay line counters: packets seen, lost, overflowed, forwarded per
        direction (``_in``: towards the host), the largest lateness of a write (s)."""
        if host.delay_line is None:
            raise ValueError(f"{host.name} has no delay line (use add_delayed_host)")
        return host.delay_line.ask({"op": "stats"}, timeout=10)

    def add_home(self, name: str, nat: str = "cone") -> Home:
        """A NAT box on the internet segment (WAN 10.231.<run>.(100+k)) with an empty LAN."""
        if nat not in NAT_KINDS:
            raise ValueError(f"nat must be one of {NAT_KINDS}, not {nat!r}")
        wan_ip = f"{self.public_prefix}.{100 + len(self.homes)}"
        router = self._new_ns(f"{name}nat")
        wan_if, _ = self._attach_public(router, wan_ip)
        self.exec(router, "ip", "route", "add", "default", "dev", wan_if)
        self.exec(router, "ip", "link", "add", "lanbr", "type", "bridge")
        self._address(router, "lanbr", f"{HOME_LAN}.1/24")
        self.exec(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        masquerade = ["-t", "nat", "-A", "POSTROUTING", "-o", wan_if, "-j", "MASQUERADE"]
        if nat == "symmetric":
            masquerade.append("--random-fully")
        for rule in (
            masquerade,
            # a home router's firewall: nothing from the WAN unless it answers our traffic
            ["-P", "FORWARD", "DROP"],
            ["-A", "FORWARD", "-i", "lanbr", "-o", wan_if, "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", wan_if, "-o", "lanbr", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "INPUT", "-i", wan_if, "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "INPUT", "-i", wan_if, "-j", "DROP"],
        ):  # fmt: skip
            self.exec(router, "iptables", *rule)
        home = Home(self, name, nat, router, wan_ip, wan_if)
        self.homes[name] = home
        return home

    # ------------------------------------------------------------- link conditions

    def limit_rate(self, host: Host, mbit: float, burst_kbit: int = 256) -> None:
        """Limit ``host``'s link to ``mbit`` Mbit/s each way (``tc tbf`` on both veth ends)."""
        for ns, ifname in ((host.ns, host.ifname), (host.uplink_ns, host.uplink_if)):
            self.exec(
                *(ns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf"),
                *("rate", f"{mbit}mbit", "burst", f"{burst_kbit}kbit", "latency", "200ms"),
            )

    def set_loss(self, host: Host, probability: float) -> None:
        """Drop each packet that arrives at ``host`` with ``probability`` (iptables statistic in
        its INPUT chain; set it on both ends for loss both ways: a drop in the OUTPUT chain
        would fail the sender's ``send`` with EPERM instead of losing the packet). 0 removes
        the rule."""
        if not 0 <= probability < 1:
            raise ValueError("probability must be in [0, 1)")
        self.exec(host.ns, "iptables", "-F", "INPUT")
        if probability:
            self.exec(
                *(host.ns, "iptables", "-A", "INPUT", "-m", "statistic"),
                *("--mode", "random", "--probability", f"{probability}", "-j", "DROP"),
            )

    def add_latency(self, host: Host, delay: float, jitter: float = 0.0) -> PeerProcess:
        """Delay every TCP connection ``host`` opens to a lab address by ``delay`` s (plus up
        to ``jitter`` s, order kept) each way: a transparent proxy in its namespace
        (``delay_proxy``) that iptables REDIRECTs those connections to. Give each host a
        proxy for a delay on every path: a connection crosses the opener's proxy only.
        The remote side then sees the proxy's source port, so do not use it where source
        ports matter (hole punching)."""
        port = DELAY_PROXY_PORT
        script = os.path.join(os.path.dirname(__file__), "delay_proxy.py")
        proxy = self.spawn(
            host, script, "--port", str(port), "--delay", str(delay), "--jitter", str(jitter)
        )
        ready = proxy.recv(timeout=10)
        self.exec(
            *(host.ns, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp"),
            *("-d", LAB_SUBNET, "-m", "mark", "!", "--mark", ready["mark"]),
            *("-j", "REDIRECT", "--to-ports", str(port)),
        )
        return proxy

    # ------------------------------------------------------------- processes

    def spawn(self, host: Host, script: str, *args: str, env: dict | None = None) -> PeerProcess:
        """``python script *args`` inside ``host``'s namespace (JSON lines over stdio); stopped
        when the lab closes."""
        return self.spawn_in(host.ns, script, *args, env=env)

    def spawn_in(self, ns: str, script: str, *args: str, env: dict | None = None) -> PeerProcess:
        """``spawn`` in one of the lab's namespaces that is not a host (a router)."""
        process = PeerProcess(ns, script, *args, env=env)
        self.processes.append(process)
        return process


def _namespace_pids(ns: str) -> list[int]:
    try:
        out = run("ip", "netns", "pids", ns, check=False)
    except subprocess.TimeoutExpired:
        return []
    return [int(p) for p in out.split()]


def _delete_namespace(ns: str) -> None:
    for pid in _namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def remove_stale_labs() -> list[str]:
    """Delete namespaces of labs whose creating process is gone (a killed test run)."""
    removed = []
    for line in run("ip", "netns", "list", check=False).splitlines():
        match = re.match(rf"({LAB_PREFIX}(\d+)[a-z]-[a-z0-9]+)\b", line)
        if match is None:
            continue
        pid = int(match.group(2))
        try:
            os.kill(pid, 0)
            continue  # its lab is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _delete_namespace(match.group(1))
        removed.append(match.group(1))
    if removed:
        print(f"netlab: removed stale namespaces {removed}", file=sys.stderr)
    return removed
