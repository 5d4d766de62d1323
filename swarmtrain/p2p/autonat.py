"""AutoNAT for ``P2P``: can other peers dial us directly? If not, reserve relay slots.

A listening peer asks a few connected peers to dial it back on the addresses it announces; each
answer is a vote. Once ``CONFIRMATIONS`` distinct peers agree (and outnumber the others), the
verdict (``P2P.reachability``) is ``PUBLIC`` or ``PRIVATE``. A ``PRIVATE`` verdict makes the
``RelayManager`` reserve slots on the initial peers, as ``use_auto_relay`` does, so the peer's
``/p2p-circuit`` addresses appear in ``P2P.get_visible_maddrs()``; a later ``PUBLIC`` verdict
lets them go. A ``client_mode`` peer listens on nothing: it is ``PRIVATE`` without asking.

Why not py-libp2p's ``AutoNATService``: in 0.8.1 its server "dials back" with
``host.connect``, which returns at once when a connection to the requester already exists, and
the request always arrives on one, so every peer would be judged public. Its server has no rate
limit and no dial timeout either. This module speaks its own small protocol over our RPC layer
(``proto/autonat.proto``, method ``AUTONAT_METHOD``).

Server (every listening peer with ``use_autonat``): it dials only addresses on the IP the
request came from (an address on 0.0.0.0 or :: is tried on that IP), at most
``MAX_DIAL_ADDRS`` of them, concurrently, within ``dial_timeout``, on a fresh connection that is
closed right after the security handshake has proved the requester's peer id (never added to
the swarm, so no existing connection can answer for it). A request over a relayed connection is
refused, as are requests beyond ``MAX_CONCURRENT_DIAL_BACKS`` at once, more than one per peer per
``PER_PEER_INTERVAL`` and more than ``DIAL_BACKS_PER_MINUTE`` in all.

Client: one round asks up to ``SERVERS_PER_ROUND`` peers we hold a direct connection to,
concurrently, each call bounded; rounds repeat every ``RETRY_UNKNOWN_INTERVAL`` while the
verdict is unknown (new peers may have connected) and every ``RECHECK_INTERVAL`` after.

The decision core (``ReachabilityCore``, ``DialBackLimiter``, ``dial_back_candidates``) does no
I/O and takes ``now`` as an argument. Resource handling: ``AutoNAT.start`` registers the handler
and runs the client loop in the host's nursery (``P2P.nursery``), so it stops when the host
closes. Error handling: the client loop logs failures and never raises into the nursery; the
handler answers every request with a status (see ``AutoNATStatus`` in the proto).
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID

from swarmtrain.p2p.errors import NoSuchMethodError, P2PError
from swarmtrain.proto.autonat_pb2 import AutoNATDialRequest, AutoNATDialResponse, AutoNATStatus

if TYPE_CHECKING:
    from swarmtrain.p2p.host import P2P

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------- the shell


@dataclass(frozen=True)
class AutoNATStatistics:
    reachability: Reachability
    reachable_votes: int
    unreachable_votes: int
    no_answers: int
    rounds: int
    dial_backs_served: int
    dial_backs_refused: int


class AutoNAT:
    """AutoNAT server and client for one ``P2P`` host. Build it with ``start``."""

    def __init__(self, p2p: P2P, *, serve: bool, ask: bool):
        self._p2p = p2p
        self.serve = serve
        self.ask = ask
        self._core = ReachabilityCore()
        self._limiter = DialBackLimiter()
        self._dial_slots = trio.Semaphore(MAX_CONCURRENT_DIAL_BACKS)
        self._timeout = p2p.config.dial_timeout
        self._not_servers: set[ID] = set()
        self._changed = trio.Event()
        self._rounds = 0
        self._served = 0
        self._refused = 0

    @classmethod
    def start(cls, p2p: P2P) -> AutoNAT:
        """Serve dial-backs if ``p2p`` listens (``P2P.create`` calls this before connecting to
        the initial peers, so they can ask us at once, and ``start_checks`` after)."""
        listens = not p2p.config.client_mode
        self = cls(p2p, serve=listens, ask=listens)
        if self.serve:
            p2p.add_protobuf_handler(
                AUTONAT_METHOD,
                self._handle_dial_back,
                AutoNATDialRequest,
                max_message_size=MAX_REQUEST_SIZE,
                timeout=self._timeout + 1.0,
            )
        return self

    def start_checks(self) -> None:
        """Start asking connected peers for dial-backs, in ``p2p.nursery`` (if we listen)."""
        if self.ask:
            self._p2p.nursery.start_soon(self._run)

    @property
    def reachability(self) -> Reachability:
        if not self.ask:
            return Reachability.PRIVATE  # client_mode: nothing to dial
        return self._core.reachability

    async def wait_reachability_known(self) -> Reachability:
        """Wait until the verdict is PUBLIC or PRIVATE (the caller bounds the wait)."""
        while self.reachability is Reachability.UNKNOWN:
            await self._changed.wait()
        return self.reachability

    def statistics(self) -> AutoNATStatistics:
        yes, no = self._core.votes()
        return AutoNATStatistics(
            reachability=self.reachability,
            reachable_votes=yes,
            unreachable_votes=no,
            no_answers=self._core.no_answers,
            rounds=self._rounds,
            dial_backs_served=self._served,
            dial_backs_refused=self._refused,
        )

    # ---------------------------------------------------------------- client

    async def _run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:
                logger.warning("AutoNAT round failed", exc_info=True)
            await trio.sleep(self._core.next_check_delay())

    async def check_once(self) -> Reachability:
        """Ask up to ``SERVERS_PER_ROUND`` directly connected peers to dial us back."""
        candidates = [
            peer
            for peer in self._p2p.get_connected_peers()
            if peer not in self._not_servers and _has_direct_connection(self._p2p, peer)
        ]
        servers = self._core.choose_servers(candidates, SERVERS_PER_ROUND)
        addrs = self._own_addrs()
        if not servers or not addrs:
            return self.reachability
        self._rounds += 1
        results: dict[ID, DialBackResult] = {}

        async def ask(server: ID) -> None:
            results[server] = await self._ask(server, addrs)

        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(ask, server)
        before = self._core.reachability
        now = time.monotonic()
        for server, result in results.items():
            self._core.record(server, result, now)
        after = self._core.reachability
        logger.debug(
            "AutoNAT round: %s in %.3f s -> %s",
            {str(s): r.value for s, r in results.items()},
            now - started,
            after.value,
        )
        if after is not before:
            self._on_verdict(before, after)
        return after

    def _own_addrs(self) -> list[bytes]:
        addrs: list[bytes] = []
        for addr in self._p2p.host.get_addrs():
            text = str(addr)
            if "/p2p-circuit" in text:
                continue
            if "/p2p/" in text:
                text = text[: text.index("/p2p/")]
            addrs.append(multiaddr.Multiaddr(text).to_bytes())
        return addrs

    async def _ask(self, server: ID, addrs: Sequence[bytes]) -> DialBackResult:
        try:
            reply = await self._p2p.call_protobuf_handler(
                server,
                AUTONAT_METHOD,
                AutoNATDialRequest(addrs=list(addrs)),
                AutoNATDialResponse,
                timeout=2 * self._timeout + 1.0,
            )
        except NoSuchMethodError:
            self._not_servers.add(server)
            return DialBackResult.NO_ANSWER
        except P2PError as e:
            logger.debug("AutoNAT: no answer from %s: %s", server, e)
            return DialBackResult.NO_ANSWER
        logger.debug(
            "AutoNAT: %s says %s %s",
            server,
            AutoNATStatus.Name(reply.status)
            if reply.status in AutoNATStatus.values()
            else reply.status,
            reply.text,
        )
        return result_of(reply.status)

    def _on_verdict(self, before: Reachability, after: Reachability) -> None:
        yes, no = self._core.votes()
        logger.info(
            "%s is %s (AutoNAT: %d peers reached it, %d could not)",
            self._p2p.peer_id,
            after.value,
            yes,
            no,
        )
        relay = self._p2p.relay
        if relay is not None:
            relay.set_auto_reservations(after is Reachability.PRIVATE)
        self._changed.set()
        self._changed = trio.Event()

    # ---------------------------------------------------------------- server

    async def _handle_dial_back(self, request: AutoNATDialRequest, context) -> AutoNATDialResponse:
        peer: ID = context.remote_id
        observed = _observed_ips(self._p2p, peer)
        if not observed:
            return self._refuse("dial-back requests over relayed connections are refused")
        candidates = dial_back_candidates(request.addrs, observed)
        if not candidates:  # answered without dialling anything, so not rate-limited
            if not request.addrs:
                return AutoNATDialResponse(
                    status=AutoNATStatus.AUTONAT_BAD_REQUEST, text="no addresses"
                )
            return AutoNATDialResponse(
                status=AutoNATStatus.AUTONAT_NO_MATCHING_ADDR,
                text=f"no announced address is on {', '.join(sorted(observed))}",
            )
        swarm = self._p2p.host.get_network()
        candidates = [a for a in candidates if swarm.transport_manager.transport_for_dialing(a)]
        if not candidates:
            return self._refuse("no announced address uses a transport this peer can dial")
        reason = self._limiter.admit(peer, time.monotonic())
        if reason is not None:
            return self._refuse(reason)
        try:
            self._dial_slots.acquire_nowait()
        except trio.WouldBlock:
            return self._refuse("too many dial-backs in progress")
        try:
            self._served += 1
            reached = await self._dial_any(peer, candidates)
        finally:
            self._dial_slots.release()
        if reached is None:
            return AutoNATDialResponse(
                status=AutoNATStatus.AUTONAT_DIAL_ERROR,
                text=f"none of {len(candidates)} addresses answered",
            )
        return AutoNATDialResponse(status=AutoNATStatus.AUTONAT_OK, addr=reached.to_bytes())

    def _refuse(self, text: str) -> AutoNATDialResponse:
        self._refused += 1
        return AutoNATDialResponse(status=AutoNATStatus.AUTONAT_REFUSED, text=text)

    async def _dial_any(
        self, peer: ID, candidates: Sequence[multiaddr.Multiaddr]
    ) -> multiaddr.Multiaddr | None:
        reached: list[multiaddr.Multiaddr] = []
        with trio.move_on_after(self._timeout):
            async with trio.open_nursery() as nursery:

                async def dial(addr: multiaddr.Multiaddr) -> None:
                    if await _probe_dial(self._p2p, peer, addr):
                        reached.append(addr)
                        nursery.cancel_scope.cancel()

                for addr in candidates:
                    nursery.start_soon(dial, addr)
        return reached[0] if reached else None


def _direct_connections(p2p: P2P, peer: ID) -> list[Any]:
    conns = p2p.host.get_network().connections.get(peer) or []
    if not isinstance(conns, list):
        conns = [conns]
    return [c for c in conns if c.muxed_conn.get_connection_type() != ConnectionType.RELAYED]


def _has_direct_connection(p2p: P2P, peer: ID) -> bool:
    return bool(_direct_connections(p2p, peer))


def _observed_ips(p2p: P2P, peer: ID) -> set[str]:
    """IPs that ``peer``'s direct connections come from (our RPC layer does not tell which
    connection carried a call; a relayed one has no usable remote IP)."""
    ips: set[str] = set()
    for conn in _direct_connections(p2p, peer):
        try:
            remote = conn.muxed_conn.get_remote_address()
            if remote:
                ips.add(_normalize_ip(remote[0]))
        except Exception:
            continue
    return ips


async def _probe_dial(p2p: P2P, peer: ID, addr: multiaddr.Multiaddr) -> bool:
    """Dial ``addr`` on a fresh connection, check it is ``peer`` (security handshake), close.

    The connection is never added to the swarm: an existing connection cannot answer for it.
    """
    swarm = p2p.host.get_network()
    target = multiaddr.Multiaddr(f"{addr}/p2p/{peer}")
    transport = swarm.transport_manager.transport_for_dialing(target)
    if transport is None:
        return False
    raw = None
    try:
        raw = await transport.dial(target)
        secure = await swarm.upgrader.upgrade_security(raw, True, peer)
    except Exception as e:
        logger.debug("AutoNAT dial-back to %s at %s failed: %s", peer, addr, e)
        if raw is not None:
            await _close_quietly(raw)
        return False
    except BaseException:
        if raw is not None:
            await _close_quietly(raw)
        raise
    await _close_quietly(secure)
    return True


async def _close_quietly(conn) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await conn.close()
        except Exception:
            logger.debug("error closing a dial-back connection", exc_info=True)
