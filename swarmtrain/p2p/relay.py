"""NAT traversal for ``P2P``: circuit relay v2 (serve, reserve, dial) and DCUtR hole punching.

Roles, each switched by a ``P2PConfig`` field:

- relay service (``relay_service``, on by default): a peer that listens relays circuits for
  peers that hold a reservation on it (the circuit relay v2 "hop" protocol). A ``client_mode``
  peer never serves: nobody can dial it directly.
- reservations (``client_mode`` peers, any peer with ``use_auto_relay``, and peers that
  AutoNAT judges unreachable, see ``swarmtrain.p2p.autonat``): once its initial peers are
  connected, the peer reserves a slot on each of them that offers the hop protocol and renews
  the slots before they expire. Its ``/p2p-circuit`` addresses then appear in
  ``P2P.get_visible_maddrs()``.
- relayed dials and inbound circuits (``use_relay``): ``P2P.ensure_connected`` calls
  ``dial_through_relay`` when a peer has only ``/p2p-circuit`` addresses.
- hole punching (``use_hole_punching``): after a relayed dial, DCUtR runs in the background.
  libp2p's swarm opens new streams on a direct connection when one exists, so calls move to the
  direct connection as soon as it is up; DCUtR closes the relayed one after a grace period.

The relayed dial speaks the hop CONNECT exchange itself instead of calling
``CircuitV2Transport.dial``: in py-libp2p 0.8.1 that method first walks every circuit address
of the target in the peerstore with no per-attempt timeout, then falls back to a path that also
reserves a slot for the *dialler* on the relay, and it stores circuit addresses with a 68-year
TTL. Here each relay is tried once, bounded, and a refusal comes back with the relay's status.
Hole punching dials through our hosts' TCP transport, ``_libp2p_fixes.HolePunchTCP``, which
does not leak the sockets of cancelled dials as py-libp2p 0.8.1's does.

Resource handling: ``RelayManager.start`` runs libp2p's relay and DCUtR services in a task of
the host's nursery (``P2P.nursery``); reservation renewal and hole punches run there too, so
they all stop when the host closes. Every network wait is bounded by ``dial_timeout`` (hole
punches by ``HOLE_PUNCH_TIMEOUT``). Error handling: background tasks log failures and never
raise into the host's nursery; ``dial_through_relay`` raises ``PeerUnreachableError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service

from swarmtrain.p2p._relay_splice import SplicingCircuitRelay
from swarmtrain.p2p.autonat import observed_ips
from swarmtrain.p2p.errors import P2PError, PeerUnreachableError
from swarmtrain.p2p.relay_routes import (
    CIRCUIT,
    CircuitRoute,
    circuit_addrs_via,
    group_routes,
    renewal_time,
    reservations_due,
    specify_relay_addrs,
)

if TYPE_CHECKING:
    from swarmtrain.p2p.host import P2P

logger = logging.getLogger(__name__)

# After a failed renewal, try again this much later (the reservation stays until it lapses).
RENEWAL_RETRY_INTERVAL = 15.0
# How often a peer that wants reservations but holds none looks for relays again.
RELAY_RETRY_INTERVAL = 60.0
# Bound on one background hole punch: py-libp2p runs up to 3 dial rounds of 5 s plus pauses.
HOLE_PUNCH_TIMEOUT = 30.0
# How long to wait for the other side's hole-punch dial after our side found nothing to dial.
REVERSE_DIAL_GRACE = 5.0
# Circuit limits a relay grants (py-libp2p's defaults: 1 GiB or 1 hour per circuit).
RELAY_CIRCUIT_DURATION = 3600
RELAY_CIRCUIT_BYTES = 1 << 30
RELAY_CIRCUITS_PER_RESERVATION = 8


@dataclass(frozen=True)
class RelayStatistics:
    relay_service: bool
    reachability: str  # AutoNAT's verdict: "unknown", "public" or "private"
    reservations: int
    relayed_dials: int
    hole_punches_succeeded: int
    hole_punches_failed: int


@dataclass
class _Reservation:
    expires: float  # unix time (protocol data from the relay)
    renew_at: float
    circuit_addrs: list[str]


# ------------------------------------------------------------------------ manager


class RelayManager:
    """Circuit relay v2 and hole punching for one ``P2P`` host. Build it with ``start``."""

    def __init__(
        self,
        p2p: P2P,
        *,
        serve: bool,
        accept_relayed: bool,
        reserve: bool,
        hole_punching: bool,
        max_reservations: int,
        timeout: float,
    ):
        self._p2p = p2p
        self._host = p2p.host
        self.serve = serve
        self.accept_relayed = accept_relayed
        self.want_reservations = reserve
        self._reserve_always = reserve  # by configuration; AutoNAT toggles the others
        self._auto_reservations: trio.CancelScope | None = None
        self.hole_punching = hole_punching and accept_relayed
        self._max_reservations = max_reservations
        self._timeout = timeout
        self._reservations: dict[ID, _Reservation] = {}
        self._dcutr: DCUtRProtocol | None = None
        # py-libp2p's hop/stop protocol with our splice of each circuit (``_relay_splice``)
        self.circuit_relay: SplicingCircuitRelay | None = None
        self._relayed_dials = 0
        self._punches_ok = 0
        self._punches_failed = 0

    @classmethod
    async def start(cls, p2p: P2P) -> RelayManager:
        """Register the relay protocols on ``p2p`` and run their services in ``p2p.nursery``."""
        config = p2p.config
        self = cls(
            p2p,
            serve=config.relay_service and not config.client_mode,
            accept_relayed=config.use_relay,
            reserve=config.use_relay and (config.client_mode or config.use_auto_relay),
            hole_punching=config.use_hole_punching,
            max_reservations=config.relay_max_reservations,
            timeout=config.dial_timeout,
        )
        await p2p.nursery.start(self._run_services)
        return self

    async def _run_services(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with AsyncExitStack() as stack:
            if self.serve or self.accept_relayed:
                limits = RelayLimits(
                    duration=RELAY_CIRCUIT_DURATION,
                    data=RELAY_CIRCUIT_BYTES,
                    max_circuit_conns=RELAY_CIRCUITS_PER_RESERVATION,
                    max_reservations=self._max_reservations,
                )
                # allow_hop=False still serves the "stop" side: accepting relayed connections.
                self.circuit_relay = SplicingCircuitRelay(
                    self._host, limits=limits, allow_hop=self.serve
                )
                await stack.enter_async_context(background_trio_service(self.circuit_relay))
            if self.hole_punching:
                self._dcutr = DCUtRProtocol(
                    self._host,
                    read_timeout=self._timeout,  # type: ignore[arg-type]  # typed int, used as a float
                    write_timeout=self._timeout,  # type: ignore[arg-type]
                    dial_timeout=self._timeout,  # type: ignore[arg-type]
                )
                await stack.enter_async_context(background_trio_service(self._dcutr))
            task_status.started()
            await trio.sleep_forever()

    # ------------------------------------------------------------- reservations

    async def reserve_initial_relays(self) -> None:
        """Reserve a slot on every connected initial peer that serves relays; keep them fresh.

        Called by ``P2P.create`` once the initial peers are connected. Logs a warning (and
        leaves the peer a pure client) when no initial peer grants a reservation.
        """
        if not self.want_reservations:
            return
        await self._reserve_on_initial_peers()
        self._p2p.nursery.start_soon(self._keep_reservations)

    def set_auto_reservations(self, wanted: bool) -> None:
        """AutoNAT's hook: start (or stop) reserving slots as if ``use_auto_relay`` were set.

        No effect on a peer that reserves by configuration or does not use relays. Starting runs
        in the host's nursery; stopping forgets the reservations (the relays let them lapse).
        """
        if self._reserve_always or not self.accept_relayed or wanted == self.want_reservations:
            return
        self.want_reservations = wanted
        if wanted:
            self._auto_reservations = trio.CancelScope()
            self._p2p.nursery.start_soon(self._reserve_automatically, self._auto_reservations)
        else:
            if self._auto_reservations is not None:
                self._auto_reservations.cancel()
            self._reservations.clear()

    async def _reserve_automatically(self, scope: trio.CancelScope) -> None:
        with scope:
            await self._reserve_on_initial_peers()
            await self._keep_reservations()

    async def _reserve_on_initial_peers(self) -> None:
        candidates = self._candidate_relays(connected_only=True)
        failures = await self._reserve_on(candidates)
        if not self._reservations:
            logger.warning(
                "%s wants relay reservations but none of its %d connected initial peers granted "
                "one, so peers that cannot dial it directly cannot reach it (a client_mode peer "
                "works as a pure client); retrying every %.0f s. %s",
                self._p2p.peer_id,
                len(candidates),
                RELAY_RETRY_INTERVAL,
                "; ".join(f"{relay}: {error}" for relay, error in failures.items()),
            )

    def _candidate_relays(self, *, connected_only: bool) -> list[ID]:
        candidates: list[ID] = []
        for addr in self._p2p.config.initial_peers:
            if CIRCUIT in addr:
                continue
            peer = info_from_p2p_addr(multiaddr.Multiaddr(addr)).peer_id
            if peer in candidates or (connected_only and not self._p2p.is_connected(peer)):
                continue
            if peer != self._p2p.peer_id:
                candidates.append(peer)
        return candidates

    async def _reserve_on(self, relays: Sequence[ID]) -> dict[ID, str]:
        """Reserve on ``relays`` concurrently; returns why it failed on some of them."""
        failures: dict[ID, str] = {}

        async def reserve_one(relay: ID) -> None:
            try:
                await self.reserve_on(relay)
            except P2PError as e:
                held = self._reservations.get(relay)
                if held is not None:  # keep it until it lapses; try again soon
                    held.renew_at = min(held.expires, time.time() + RENEWAL_RETRY_INTERVAL)
                failures[relay] = str(e)
                logger.info("no relay reservation on %s: %s", relay, e)

        async with trio.open_nursery() as nursery:
            for relay in relays:
                nursery.start_soon(reserve_one, relay)
        return failures

    async def reserve_on(self, relay: ID) -> list[str]:
        """Reserve (or renew) a slot on ``relay``; returns our circuit addresses through it.

        Raises ``P2PError`` if the relay is unreachable, does not serve relays, or refuses.
        """
        granted_at = time.time()
        try:
            with trio.fail_after(self._timeout):
                stream = await self._host.new_stream(relay, [HOP_PROTOCOL_ID])
        except trio.TooSlowError:
            raise P2PError(f"no relay stream within {self._timeout} s") from None
        except Exception as e:
            raise P2PError(f"it does not serve relays ({e})") from e
        try:
            with trio.fail_after(self._timeout):
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                reply = await read_delimited_msg(stream, HopMessage)
        except trio.TooSlowError:
            raise P2PError(f"no reservation reply within {self._timeout} s") from None
        except Exception as e:
            raise P2PError(f"the reservation exchange failed: {e}") from e
        finally:
            await _close_quietly(stream)
        status = _status_name(reply)
        if status != "OK":
            raise P2PError(f"the relay refused the reservation ({status})")
        if not reply.HasField("reservation"):
            raise P2PError("the relay's reply carries no reservation")
        expires = float(reply.reservation.expire)
        relay_addrs: list[Any] = []
        for raw in reply.reservation.addrs:
            try:
                relay_addrs.append(multiaddr.Multiaddr(raw))
            except Exception:
                logger.debug("relay %s sent an undecodable address", relay)
        relay_addrs += self._p2p.known_addrs(relay)  # the address we reached it at
        # a relay listening on 0.0.0.0 reports that address: use the IP we reach it at instead
        relay_addrs = specify_relay_addrs(relay_addrs, observed_ips(self._p2p, relay))
        circuit_addrs = circuit_addrs_via(relay, relay_addrs, self._p2p.peer_id)
        if not circuit_addrs:
            raise P2PError("the relay has no address we can advertise")
        renewed = relay in self._reservations
        self._reservations[relay] = _Reservation(
            expires, renewal_time(expires, granted_at), circuit_addrs
        )
        logger.log(
            logging.DEBUG if renewed else logging.INFO,
            "relay reservation on %s %s for %.0f s",
            relay,
            "renewed" if renewed else "granted",
            expires - granted_at,
        )
        return circuit_addrs

    async def _keep_reservations(self) -> None:
        """Renew reservations before they lapse; look for relays again while we hold none."""
        last_search = time.time()
        while True:
            now = time.time()
            wake = min(
                (r.renew_at for r in self._reservations.values()),
                default=now + RELAY_RETRY_INTERVAL,
            )
            await trio.sleep(max(min(wake - now, RELAY_RETRY_INTERVAL), 0.0))
            now = time.time()
            for relay in [r for r, res in self._reservations.items() if res.expires <= now]:
                logger.warning("relay reservation on %s expired", relay)
                del self._reservations[relay]
            due = reservations_due({r: res.renew_at for r, res in self._reservations.items()}, now)
            if not self._reservations and now - last_search >= RELAY_RETRY_INTERVAL:
                last_search = now
                due = self._candidate_relays(connected_only=False)  # redials them
            if due:
                await self._reserve_on(due)

    def circuit_addrs(self) -> list[str]:
        """Our ``/p2p-circuit`` addresses through the relays that hold a live reservation."""
        now = time.time()
        addrs: list[str] = []
        for reservation in self._reservations.values():
            if reservation.expires > now:
                addrs += [a for a in reservation.circuit_addrs if a not in addrs]
        return addrs

    @property
    def relays(self) -> list[ID]:
        """Relays on which we hold a reservation."""
        return list(self._reservations)

    # ---------------------------------------------------------------- dialling

    async def dial_through_relay(
        self, peer_id: ID, relayed_addrs: Sequence[multiaddr.Multiaddr | str]
    ) -> None:
        """Open a relayed connection to ``peer_id`` through one of the relays named in
        ``relayed_addrs`` (tried in order), then start hole punching in the background.

        Raises ``PeerUnreachableError`` with every relay's failure.
        """
        if not self.accept_relayed:
            raise PeerUnreachableError("relayed connections are disabled (use_relay=False)")
        routes = [r for r in group_routes(peer_id, relayed_addrs) if r.relay != self._p2p.peer_id]
        if not routes:
            raise PeerUnreachableError(f"no usable circuit address for {peer_id}")
        errors: list[str] = []
        for route in routes:
            try:
                with trio.fail_after(self._timeout):
                    await self._connect_via(route)
            except trio.TooSlowError:
                errors.append(f"via {route.relay}: timed out after {self._timeout} s")
            except Exception as e:
                errors.append(f"via {route.relay}: {e}")
            else:
                self._relayed_dials += 1
                logger.debug("connected to %s through relay %s", peer_id, route.relay)
                if self._dcutr is not None:
                    self._p2p.nursery.start_soon(self._upgrade_to_direct, peer_id)
                return
        raise PeerUnreachableError("; ".join(errors))

    async def _connect_via(self, route: CircuitRoute) -> None:
        if not self._p2p.is_connected(route.relay):
            await self._host.connect(PeerInfo(route.relay, list(route.relay_addrs)))
        try:
            stream = await self._host.new_stream(route.relay, [HOP_PROTOCOL_ID])
        except Exception as e:
            raise P2PError(f"the relay does not serve relays ({e})") from e
        try:
            request = HopMessage(
                type=HopMessage.CONNECT, peer=CircuitPeerId(id=route.target.to_bytes())
            )
            await write_delimited_msg(stream, request)
            reply = await read_delimited_msg(stream, HopMessage)
            status = _status_name(reply)
            if status != "OK":
                hint = (
                    " (the peer holds no reservation there)" if status == "NO_RESERVATION" else ""
                )
                raise P2PError(f"the relay refused the circuit: {status}{hint}")
            circuit = multiaddr.Multiaddr(f"/p2p/{route.relay}{CIRCUIT}/p2p/{route.target}")
            raw = RawConnection(
                stream=stream,
                initiator=True,
                connection_type=ConnectionType.RELAYED,
                addresses=[circuit],
            )
            await self._host.upgrade_outbound_connection(raw, route.target)
        except BaseException:
            await _close_quietly(stream, reset=True)
            raise

    # ----------------------------------------------------------- hole punching

    async def _upgrade_to_direct(self, peer_id: ID) -> None:
        assert self._dcutr is not None
        started = trio.current_time()
        ok = False
        try:
            with trio.move_on_after(HOLE_PUNCH_TIMEOUT):
                ok = await self._dcutr.initiate_hole_punch(peer_id)
        except Exception:
            logger.debug("hole punch to %s failed", peer_id, exc_info=True)
        if not ok:
            # A peer that listens on nothing sends no addresses, so our side gives up at once,
            # but it dials us when it gets our SYNC: give that dial a moment to land.
            for _ in range(round(REVERSE_DIAL_GRACE / 0.05)):  # libp2p has no event for it
                if self.is_direct(peer_id):
                    break
                await trio.sleep(0.05)
        elapsed = trio.current_time() - started
        if ok or self.is_direct(peer_id):
            self._punches_ok += 1
            logger.debug("direct connection to %s after %.3f s", peer_id, elapsed)
        else:
            self._punches_failed += 1
            logger.debug("no direct connection to %s (%.1f s); staying relayed", peer_id, elapsed)

    def _connection_types(self, peer: ID) -> list[ConnectionType]:
        conns = self._host.get_network().connections.get(peer) or []
        if not isinstance(conns, list):
            conns = [conns]
        return [c.get_connection_type() for c in conns]

    def is_relayed(self, peer: ID) -> bool:
        """Whether we hold a relayed connection to ``peer`` (maybe a direct one as well)."""
        return ConnectionType.RELAYED in self._connection_types(peer)

    def is_direct(self, peer: ID) -> bool:
        """Whether we hold a direct (not relayed) connection to ``peer``."""
        return any(t != ConnectionType.RELAYED for t in self._connection_types(peer))

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            relay_service=self.serve,
            reachability=self._p2p.reachability.value,
            reservations=sum(r.expires > time.time() for r in self._reservations.values()),
            relayed_dials=self._relayed_dials,
            hole_punches_succeeded=self._punches_ok,
            hole_punches_failed=self._punches_failed,
        )


def _status_name(reply: HopMessage) -> str:
    code = reply.status if reply.HasField("status") else StatusCode.OK
    try:
        return StatusCode(code).name
    except ValueError:
        return f"status {code}"


async def _close_quietly(stream, *, reset: bool = False) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await (stream.reset() if reset else stream.close())
        except Exception:
            logger.debug("error closing a relay stream", exc_info=True)
