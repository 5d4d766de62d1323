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

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID

from swarmtrain.p2p.autonat_core import (  # noqa: F401 (re-exported)
    AUTONAT_METHOD,
    CONFIRMATIONS,
    DIAL_BACKS_PER_MINUTE,
    MAX_CONCURRENT_DIAL_BACKS,
    MAX_DIAL_ADDRS,
    MAX_REQUEST_SIZE,
    PER_PEER_INTERVAL,
    RECHECK_INTERVAL,
    RETRY_UNKNOWN_INTERVAL,
    SERVERS_PER_ROUND,
    VOTE_TTL,
    DialBackLimiter,
    DialBackResult,
    Reachability,
    ReachabilityCore,
    _normalize_ip,
    dial_back_candidates,
    result_of,
)
from swarmtrain.p2p.errors import NoSuchMethodError, P2PError
from swarmtrain.p2p.tcp_info import tcp_loss, tcp_rtt, tcp_socket_of
from swarmtrain.proto.autonat_pb2 import AutoNATDialRequest, AutoNATDialResponse, AutoNATStatus

if TYPE_CHECKING:
    from swarmtrain.p2p.host import P2P

logger = logging.getLogger(__name__)

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
        observed = observed_ips(self._p2p, peer)
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


def observed_ips(p2p: P2P, peer: ID) -> set[str]:
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


def connection_path(p2p: P2P, peer: ID) -> tuple[float, float | None] | None:
    """(RTT in seconds, share of segments retransmitted or None) of a direct TCP connection
    to ``peer``, from the kernel (``TCP_INFO``; the one with the smallest RTT if several);
    None without one (relayed, other transports)."""
    paths = []
    for conn in _direct_connections(p2p, peer):
        sock = tcp_socket_of(conn)
        rtt = tcp_rtt(sock) if sock is not None else None
        if rtt:
            paths.append((rtt, tcp_loss(sock)))
    return min(paths, key=lambda path: path[0]) if paths else None


def connection_rtt(p2p: P2P, peer: ID) -> float | None:
    """The RTT of ``connection_path`` (None without a direct TCP connection)."""
    path = connection_path(p2p, peer)
    return path[0] if path is not None else None


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
