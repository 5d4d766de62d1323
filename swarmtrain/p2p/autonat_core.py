"""Pure parts of AutoNAT (``autonat.py``): the reachability vote, the dial-back rate limit and
which claimed addresses a server may dial. No I/O; time comes in as ``now``."""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Hashable, Iterable

import multiaddr

from swarmtrain.proto.autonat_pb2 import AutoNATStatus

AUTONAT_METHOD = "swarmtrain::AutoNAT.dial_back"
# Distinct peers that must agree before the verdict is PUBLIC or PRIVATE.
CONFIRMATIONS = 2
# A vote older than this no longer counts (seconds).
VOTE_TTL = 3600.0
# Client schedule (seconds) and fan-out.
SERVERS_PER_ROUND = 3
RETRY_UNKNOWN_INTERVAL = 15.0
RECHECK_INTERVAL = 900.0
# Server limits.
MAX_DIAL_ADDRS = 4
MAX_CONCURRENT_DIAL_BACKS = 8
PER_PEER_INTERVAL = 10.0
DIAL_BACKS_PER_MINUTE = 60
MAX_REQUEST_SIZE = 4096


class Reachability(str, enum.Enum):
    """Whether other peers can dial this peer directly."""

    UNKNOWN = "unknown"
    PUBLIC = "public"
    PRIVATE = "private"


class DialBackResult(enum.Enum):
    """One server's answer, as the decision core sees it."""

    REACHABLE = "reachable"  # the server reached us on a fresh connection
    UNREACHABLE = "unreachable"  # the server tried our addresses (or had none to try) and failed
    NO_ANSWER = "no_answer"  # refused, unreachable server, timeout, no such method: no vote


def result_of(status: int) -> DialBackResult:
    """Map a server's ``AutoNATStatus`` to a vote."""
    if status == AutoNATStatus.AUTONAT_OK:
        return DialBackResult.REACHABLE
    if status in (AutoNATStatus.AUTONAT_DIAL_ERROR, AutoNATStatus.AUTONAT_NO_MATCHING_ADDR):
        return DialBackResult.UNREACHABLE
    return DialBackResult.NO_ANSWER


# ------------------------------------------------------------------ decision core


class ReachabilityCore:
    """Votes in, verdict out (no I/O, no clock: ``now`` is any monotonic time in seconds).

    Each server has one vote, its latest answer. The verdict becomes PUBLIC (PRIVATE) when at
    least ``confirmations`` live votes say reachable (unreachable) and they outnumber the
    others; otherwise it stays what it was, so one dissenting peer cannot flip it.
    """

    def __init__(self, confirmations: int = CONFIRMATIONS, vote_ttl: float = VOTE_TTL):
        if confirmations < 1:
            raise ValueError("confirmations must be at least 1")
        self.confirmations = confirmations
        self.vote_ttl = vote_ttl
        self.reachability = Reachability.UNKNOWN
        self._votes: dict[Hashable, tuple[bool, float]] = {}
        self._asked_at: dict[Hashable, float] = {}
        self.no_answers = 0

    def record(self, server: Hashable, result: DialBackResult, now: float) -> Reachability:
        """Count ``server``'s answer; return the (maybe new) verdict."""
        self._asked_at[server] = now
        if result is DialBackResult.NO_ANSWER:
            self.no_answers += 1
        else:
            self._votes[server] = (result is DialBackResult.REACHABLE, now)
        return self.update(now)

    def update(self, now: float) -> Reachability:
        """Drop expired votes and recompute the verdict."""
        for server in [s for s, (_, at) in self._votes.items() if now - at > self.vote_ttl]:
            del self._votes[server]
        yes, no = self.votes()
        if yes >= self.confirmations and yes > no:
            self.reachability = Reachability.PUBLIC
        elif no >= self.confirmations and no > yes:
            self.reachability = Reachability.PRIVATE
        return self.reachability

    def votes(self) -> tuple[int, int]:
        """(reachable, unreachable) live votes."""
        yes = sum(ok for ok, _ in self._votes.values())
        return yes, len(self._votes) - yes

    def choose_servers(self, candidates: Iterable[Hashable], limit: int) -> list[Hashable]:
        """Whom to ask next: never-asked peers first, then those asked longest ago."""
        unique = list(dict.fromkeys(candidates))
        unique.sort(key=lambda s: self._asked_at.get(s, float("-inf")))
        return unique[:limit]

    def next_check_delay(self) -> float:
        if self.reachability is Reachability.UNKNOWN:
            return RETRY_UNKNOWN_INTERVAL
        return RECHECK_INTERVAL


class DialBackLimiter:
    """Server-side admission: one dial-back per peer per ``per_peer_interval`` and at most
    ``per_minute`` in any 60 s. ``admit`` returns why a request is refused, or ``None``."""

    def __init__(
        self, per_peer_interval: float = PER_PEER_INTERVAL, per_minute: int = DIAL_BACKS_PER_MINUTE
    ):
        self.per_peer_interval = per_peer_interval
        self.per_minute = per_minute
        self._last: dict[Hashable, float] = {}
        self._recent: list[float] = []

    def admit(self, peer: Hashable, now: float) -> str | None:
        self._recent = [t for t in self._recent if now - t < 60.0]
        horizon = max(self.per_peer_interval, 60.0)
        if len(self._last) > 4 * self.per_minute:  # bound memory: forget old peers
            self._last = {p: t for p, t in self._last.items() if now - t < horizon}
        last = self._last.get(peer)
        if last is not None and now - last < self.per_peer_interval:
            return f"at most one dial-back per {self.per_peer_interval:g} s per peer"
        if len(self._recent) >= self.per_minute:
            return f"at most {self.per_minute} dial-backs per minute"
        self._last[peer] = now
        self._recent.append(now)
        return None


def dial_back_candidates(
    addrs: Iterable[bytes | str | multiaddr.Multiaddr], observed_ips: Iterable[str]
) -> list[multiaddr.Multiaddr]:
    """The announced addresses a server may dial: on an observed IP of the requester (an
    unspecified 0.0.0.0 / :: address is taken to mean that IP), TCP-based, not relayed, without
    ``/p2p/<id>``, deduplicated, at most ``MAX_DIAL_ADDRS``. Undecodable entries are skipped."""
    observed = {_normalize_ip(ip) for ip in observed_ips}
    result: list[multiaddr.Multiaddr] = []
    for raw in addrs:
        try:
            maddr = raw if isinstance(raw, multiaddr.Multiaddr) else multiaddr.Multiaddr(raw)
            text = str(maddr)
            if "/p2p-circuit" in text or "/tcp/" not in text:
                continue
            if "/p2p/" in text:
                text = text[: text.index("/p2p/")]
            family = (
                "ip4" if text.startswith("/ip4/") else "ip6" if text.startswith("/ip6/") else None
            )
            if family is None:
                continue
            ip = _normalize_ip(multiaddr.Multiaddr(text).value_for_protocol(family))
        except Exception:
            continue
        targets = [ip] if ip in observed else []
        if ipaddress.ip_address(ip).is_unspecified:
            targets = [
                o
                for o in observed
                if ipaddress.ip_address(o).version == (4 if family == "ip4" else 6)
            ]
        for target in targets:
            rest = text.split("/", 3)[3]  # after /ipX/<ip>/
            candidate = multiaddr.Multiaddr(f"/{family}/{target}/{rest}")
            if candidate not in result:
                result.append(candidate)
    return result[:MAX_DIAL_ADDRS]


def _normalize_ip(ip: str) -> str:
    parsed = ipaddress.ip_address(ip)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped
    return str(parsed)
