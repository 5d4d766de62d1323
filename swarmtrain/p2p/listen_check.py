"""Refuse to listen on a TCP address another socket already listens on.

py-libp2p 0.8.1 listens with ``SO_REUSEPORT`` (hole punching dials from the listen port), so a
second host on a port that is taken binds it too, and the kernel then splits new connections
between the two: peers that meant to reach the first host land on the second. Before the host
starts, each fixed TCP port is bound once without ``SO_REUSEPORT`` (with ``SO_REUSEADDR``, so a
port that only has connections in ``TIME_WAIT`` from a previous run stays usable); a listening
socket on that address, or on a wildcard address covering it, makes that bind fail.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

import multiaddr

from swarmtrain.p2p.errors import AddressInUseError


def fixed_tcp_endpoints(maddrs: Iterable[multiaddr.Multiaddr]) -> list[tuple[str, int, str]]:
    """``(ip, port, maddr)`` of each ``/ip4|ip6/<ip>/tcp/<port>`` address whose port is not 0."""
    endpoints = []
    for maddr in maddrs:
        protocols = [p.name for p in maddr.protocols()]
        if "tcp" not in protocols or not {"ip4", "ip6"} & set(protocols):
            continue
        port = int(maddr.value_for_protocol("tcp"))
        if port == 0:
            continue
        ip = maddr.value_for_protocol("ip6" if "ip6" in protocols else "ip4")
        endpoints.append((ip, port, str(maddr)))
    return endpoints


def check_addresses_free(maddrs: Iterable[multiaddr.Multiaddr]) -> None:
    """Raise ``AddressInUseError`` if something already listens on one of ``maddrs``."""
    for ip, port, maddr in fixed_tcp_endpoints(maddrs):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((ip, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise AddressInUseError(maddr) from None
                raise
