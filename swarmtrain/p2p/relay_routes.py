"""Pure helpers of ``swarmtrain.p2p.relay``: circuit addresses and reservation schedules."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import multiaddr
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

logger = logging.getLogger("swarmtrain.p2p.relay")

CIRCUIT = "/p2p-circuit"
# Renew a reservation this long before it expires (or at half its lifetime, if shorter).
RESERVATION_RENEW_MARGIN = 120.0


@dataclass(frozen=True)
class CircuitRoute:
    """One way to reach ``target`` through ``relay`` (parsed from a circuit multiaddr)."""

    relay: ID
    relay_addrs: tuple[multiaddr.Multiaddr, ...]  # transport addresses of the relay, maybe none
    target: ID


def parse_circuit_addr(addr: multiaddr.Multiaddr | str, target: ID | None = None) -> CircuitRoute:
    """Split ``<relay addr>/p2p/<relay>/p2p-circuit[/p2p/<target>]``. Raises ``ValueError``."""
    text = str(addr)
    if text.count(CIRCUIT) != 1:
        raise ValueError(f"{text!r} is not a circuit address with exactly one {CIRCUIT}")
    relay_part, target_part = text.split(CIRCUIT)
    if not relay_part or "/p2p/" not in relay_part:
        raise ValueError(f"{text!r} does not name its relay (/p2p/<relay id>/p2p-circuit)")
    relay_info = info_from_p2p_addr(multiaddr.Multiaddr(relay_part))
    if target_part:
        target_info = info_from_p2p_addr(multiaddr.Multiaddr(target_part))
        if target is not None and target_info.peer_id != target:
            raise ValueError(f"{text!r} leads to {target_info.peer_id}, not to {target}")
        target = target_info.peer_id
    if target is None:
        raise ValueError(f"{text!r} does not name its target (/p2p-circuit/p2p/<peer id>)")
    relay_addrs = tuple(a for a in relay_info.addrs if str(a))
    return CircuitRoute(relay_info.peer_id, relay_addrs, target)


def group_routes(target: ID, addrs: Iterable[multiaddr.Multiaddr | str]) -> list[CircuitRoute]:
    """One route per relay (merging its transport addresses), in first-seen order."""
    merged: dict[ID, list[multiaddr.Multiaddr]] = {}
    for addr in addrs:
        try:
            route = parse_circuit_addr(addr, target)
        except ValueError as e:
            logger.debug("ignoring unusable circuit address: %s", e)
            continue
        known = merged.setdefault(route.relay, [])
        known.extend(a for a in route.relay_addrs if a not in known)
    return [CircuitRoute(relay, tuple(addrs), target) for relay, addrs in merged.items()]


def specify_relay_addrs(
    relay_addrs: Iterable[multiaddr.Multiaddr | str], observed_ips: Iterable[str]
) -> list[str]:
    """A relay's addresses with each wildcard one (``/ip4/0.0.0.0/...``, ``/ip6/::/...``: what a
    relay listening on all interfaces reports in its reservation) replaced by one per IP we
    reach the relay at; dialling a wildcard address reaches the dialler's own machine. Loopback
    addresses (a wildcard relay lists this machine's IPs, loopback last) are kept only when we
    reach the relay over loopback ourselves: elsewhere they lead to the dialler's machine too."""
    ips = sorted(observed_ips)
    local = any(ipaddress.ip_address(ip).is_loopback for ip in ips if _is_ip(ip))
    result: list[str] = []
    for addr in relay_addrs:
        parts = str(addr).split("/")
        candidates = [str(addr)]
        if len(parts) > 2 and (parts[1], parts[2]) in (("ip4", "0.0.0.0"), ("ip6", "::")):
            family = parts[1]
            rest = "/".join(parts[3:])
            candidates = [
                f"/{family}/{ip}/{rest}" for ip in ips if (":" in ip) == (family == "ip6")
            ]
        elif len(parts) > 2 and parts[1] in ("ip4", "ip6") and _is_ip(parts[2]):
            if ipaddress.ip_address(parts[2]).is_loopback and not local:
                candidates = []
        result.extend(c for c in candidates if c not in result)
    return result


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def circuit_addrs_via(relay: ID, relay_addrs: Iterable[multiaddr.Multiaddr | str], us: ID):
    """Our circuit addresses through ``relay``: ``<addr>/p2p/<relay>/p2p-circuit/p2p/<us>``."""
    result: list[str] = []
    for addr in relay_addrs:
        text = str(addr)
        if not text or CIRCUIT in text:
            continue
        if "/p2p/" not in text:
            text += f"/p2p/{relay}"
        elif not text.endswith(f"/p2p/{relay}"):
            continue  # an address of some other peer
        circuit = f"{text}{CIRCUIT}/p2p/{us}"
        if circuit not in result:
            result.append(circuit)
    return result


def renewal_time(expires: float, granted_at: float) -> float:
    """When to renew a reservation granted at ``granted_at`` that lapses at ``expires``."""
    lifetime = max(expires - granted_at, 0.0)
    return expires - min(RESERVATION_RENEW_MARGIN, lifetime / 2)


def reservations_due(renew_at: Mapping[ID, float], now: float) -> list[ID]:
    return [relay for relay, when in renew_at.items() if when <= now]
