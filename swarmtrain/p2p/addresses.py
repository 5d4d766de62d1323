"""Addresses another machine can dial, for a host listening on ``0.0.0.0`` or ``::``.

py-libp2p reports the address it bound, so a host listening on all interfaces reported
``/ip4/0.0.0.0/tcp/<port>/p2p/<id>``: dialling that reaches the dialler's own machine, never
this one. Here such an address becomes one per IP of this machine, the IP of the default route
first (the one ``swarmtrain node`` prints to join with), loopback last. The default route's IP
comes from a connected UDP socket (no packet is sent); the others from the host name's
addresses.

Our hosts give py-libp2p ``DialableAddrs`` as their ``addrs_factory``, so the addresses the
host itself advertises (identify's listen addresses and signed peer record, DCUtR) are these
too: a host listening on ``0.0.0.0`` told every peer that identified it ``/ip4/0.0.0.0/...``
only, which replaced the addresses that peer knew (py-libp2p's identify is authoritative), and
the DHT handed it on: a dial of it failed at once, and py-libp2p's negative dial cache then
refused every dial of that peer for 10 s, good addresses included.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterable

import multiaddr

# documentation addresses (RFC 5737 / 3849): connect() on UDP only picks a route to them
_ROUTE_PROBES = {socket.AF_INET: "192.0.2.123", socket.AF_INET6: "2001:db8::123"}
_UNSPECIFIED = {"ip4": ("0.0.0.0", socket.AF_INET), "ip6": ("::", socket.AF_INET6)}


def default_route_ip(family: socket.AddressFamily = socket.AF_INET) -> str | None:
    """The IP this machine sends from toward the internet (None: no such route)."""
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((_ROUTE_PROBES[family], 9))
            ip = probe.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(ip).is_unspecified else ip


def interface_ips(family: socket.AddressFamily = socket.AF_INET) -> list[str]:
    """This machine's IPs of ``family``: the default route's first, loopback last."""
    found: list[str] = []
    route_ip = default_route_ip(family)
    if route_ip is not None:
        found.append(route_ip)
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        ip = str(info[4][0]).split("%")[0]
        if ip not in found and not ipaddress.ip_address(ip).is_loopback:
            found.append(ip)
    found.append("127.0.0.1" if family == socket.AF_INET else "::1")
    return found


def expand_unspecified(maddrs: Iterable[str]) -> list[str]:
    """``maddrs`` with each ``/ip4/0.0.0.0/...`` or ``/ip6/::/...`` address replaced by one per
    IP of this machine (see :func:`interface_ips`); other addresses unchanged, no duplicates."""
    expanded: list[str] = []
    for maddr in maddrs:
        parts = maddr.split("/")
        unspecified = _UNSPECIFIED.get(parts[1]) if len(parts) > 2 else None
        if unspecified is None or parts[2] != unspecified[0]:
            candidates = [maddr]
        else:
            rest = "/".join(parts[3:])
            candidates = [f"/{parts[1]}/{ip}/{rest}" for ip in interface_ips(unspecified[1])]
        expanded.extend(c for c in candidates if c not in expanded)
    return expanded


#: how long ``DialableAddrs`` reuses an expansion (interfaces rarely change)
EXPANSION_CACHE_SECONDS = 10.0


class DialableAddrs:
    """py-libp2p's ``addrs_factory`` for our hosts: the host's candidate addresses with each
    wildcard one expanded (:func:`expand_unspecified`), the expansion reused for
    ``EXPANSION_CACHE_SECONDS``."""

    def __init__(self) -> None:
        self._cached: tuple[float, tuple[str, ...], list[multiaddr.Multiaddr]] | None = None

    def __call__(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        key = tuple(str(a) for a in candidates)
        now = time.monotonic()
        cached = self._cached
        if cached is not None and cached[1] == key and now - cached[0] < EXPANSION_CACHE_SECONDS:
            return list(cached[2])
        addrs = [multiaddr.Multiaddr(a) for a in expand_unspecified(key)]
        self._cached = (now, key, addrs)
        return list(addrs)
