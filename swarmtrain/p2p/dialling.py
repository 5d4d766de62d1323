"""How a ``P2P`` host reaches peers: address bookkeeping, dialling (direct, then through a
relay), and opening negotiated streams (``Dialling``, a base class of ``swarmtrain.p2p.P2P``).

It expects the host's attributes: ``_host`` (the py-libp2p host), ``config`` (``P2PConfig``),
``peer_id``, ``relay`` (``RelayManager`` or None), ``_dial_locks``, ``_addresses_checked`` and
``_noise`` (``PrivateNoiseTransport``: which peers failed our handshake as a swarm-key mismatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.swarm_connection import SwarmConn
from libp2p.network.exceptions import SwarmException
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from swarmtrain.p2p._multistream import open_lazily_negotiated_stream
from swarmtrain.p2p.errors import P2PError, PeerUnreachableError, SwarmKeyMismatchError
from swarmtrain.p2p.private_network import KEY_MISMATCH_HINT, is_swarm_key_mismatch

if TYPE_CHECKING:
    from libp2p.host.basic_host import BasicHost

    from swarmtrain.p2p.host import P2PConfig
    from swarmtrain.p2p.private_network import PrivateNoiseTransport
    from swarmtrain.p2p.relay import RelayManager

PEERSTORE_ADDR_TTL = 3600  # seconds (py-libp2p's peerstore takes an int)


def as_peer_id(peer: ID | str | bytes) -> ID:
    if isinstance(peer, ID):
        return peer
    if isinstance(peer, str):
        return ID.from_base58(peer)
    if isinstance(peer, bytes):
        return ID(peer)
    raise TypeError(f"expected a peer id, got {type(peer).__name__}")


class Dialling:
    """Address bookkeeping, dialling and stream opening of a ``P2P`` host."""

    # set by P2P (see the module docstring)
    _host: BasicHost
    config: P2PConfig
    peer_id: ID
    relay: RelayManager | None
    _dial_locks: dict[ID, trio.Lock]
    _addresses_checked: set[ID]
    _noise: PrivateNoiseTransport | None

    def is_connected(self, peer: ID | str) -> bool:
        """Whether an open connection to ``peer`` exists."""
        conns = self._host.get_network().connections.get(as_peer_id(peer), ())
        return any(not conn.is_closed for conn in conns)

    def _not_a_replaced_relay_path(self, peer_id: ID, stream) -> bool:
        """False for a pooled stream on a relayed connection to a peer we now also reach
        directly (after a hole punch): new calls then open streams on the direct connection
        instead of reusing the relayed path until it closes. Data lanes are always fine."""
        muxed_conn = getattr(getattr(stream, "stream", None), "muxed_conn", None)
        if muxed_conn is None:
            return True
        conns = self._host.get_network().connections.get(peer_id) or []
        conns = [c for c in (conns if isinstance(conns, list) else [conns]) if not c.is_closed]
        relayed = ConnectionType.RELAYED
        ours = [c for c in conns if c.muxed_conn is muxed_conn]
        if not ours or ours[0].get_connection_type() != relayed:
            return True
        return not any(c.get_connection_type() != relayed for c in conns)

    def connection_paths(self) -> dict[ID, list[str]]:
        """How each connected peer is reached: one entry per open connection, ``"direct"`` or
        ``"relayed"`` (both while a hole-punched connection replaces a relayed one)."""
        paths: dict[ID, list[str]] = {}
        for peer, conns in self._host.get_network().connections.items():
            kinds = [
                "relayed" if conn.get_connection_type() == ConnectionType.RELAYED else "direct"
                for conn in (conns if isinstance(conns, list) else [conns])
                if not conn.is_closed
            ]
            if kinds:
                paths[peer] = sorted(kinds)
        return paths

    def _forget_closed_connections(self, peer_id: ID) -> None:
        # py-libp2p 0.8.1 can keep a dead connection listed; its new_stream then fails "No
        # valid connections available" instead of dialling
        network = self._host.get_network()
        if not isinstance(network, Swarm):
            raise RuntimeError("libp2p internals changed: the host's network is not a Swarm")
        for conn in list(network.connections.get(peer_id, ())):
            if conn.is_closed and isinstance(conn, SwarmConn):  # the Swarm's only kind
                network.remove_conn(conn)

    def add_addrs(self, peer: ID | str, addrs: Sequence[str]) -> None:
        """Remember addresses of a peer (without dialling it)."""
        self._host.get_peerstore().add_addrs(
            as_peer_id(peer), [multiaddr.Multiaddr(a) for a in addrs], PEERSTORE_ADDR_TTL
        )

    def known_addrs(self, peer: ID | str) -> list[str]:
        try:
            return [str(a) for a in self._host.get_peerstore().addrs(as_peer_id(peer))]
        except Exception:
            return []

    # --------------------------------------------------------------- dialling

    async def connect(self, maddr: str) -> ID:
        """Dial the peer at ``maddr`` (``.../p2p/<id>``, possibly a ``/p2p-circuit`` address)."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
        except Exception as e:
            raise ValueError(f"{maddr!r} is not a dialable multiaddr with /p2p/<id>: {e}") from None
        self._host.get_peerstore().add_addrs(info.peer_id, info.addrs, PEERSTORE_ADDR_TTL)
        await self.ensure_connected(info.peer_id)
        return info.peer_id

    async def ensure_connected(self, peer: ID | str) -> None:
        """Connect to ``peer`` unless already connected. Raises ``PeerUnreachableError``."""
        peer_id = as_peer_id(peer)
        if peer_id == self.peer_id:
            raise PeerUnreachableError("a peer cannot dial itself")
        if self.is_connected(peer_id):
            return
        lock = self._dial_locks.setdefault(peer_id, trio.Lock())
        async with lock:
            if self.is_connected(peer_id):
                return
            self._forget_closed_connections(peer_id)
            addrs = self._host.get_peerstore().addrs(peer_id) if self._known(peer_id) else []
            direct = [a for a in addrs if "/p2p-circuit" not in str(a)]
            relayed = [a for a in addrs if "/p2p-circuit" in str(a)]
            if not addrs:
                raise PeerUnreachableError(f"no known addresses for peer {peer_id}")
            errors: list[str] = []
            rejected = False  # a handshake failed as a swarm-key mismatch makes it fail
            if direct:
                try:
                    with trio.fail_after(self.config.dial_timeout):
                        await self._host.connect(PeerInfo(peer_id, direct))
                    return
                except trio.TooSlowError:
                    errors.append(f"direct dial timed out after {self.config.dial_timeout} s")
                except (SwarmException, OSError) as e:
                    rejected |= is_swarm_key_mismatch(e)
                    errors.append(f"direct dial failed: {e}")
            if relayed and self.relay is not None:
                try:
                    with trio.fail_after(self.config.dial_timeout):
                        await self.relay.dial_through_relay(peer_id, relayed)
                    return
                except trio.TooSlowError:
                    errors.append(f"relayed dial timed out after {self.config.dial_timeout} s")
                except (SwarmException, OSError, P2PError) as e:
                    rejected |= is_swarm_key_mismatch(e)
                    errors.append(f"relayed dial failed: {e}")
            elif relayed:
                errors.append("only /p2p-circuit addresses are known and relaying is disabled")
            if rejected or (self._noise is not None and self._noise.rejected_by(peer_id)):
                raise SwarmKeyMismatchError(f"cannot reach {peer_id}: {KEY_MISMATCH_HINT}")
            raise PeerUnreachableError(f"cannot reach {peer_id}: " + "; ".join(errors))

    def _learn_addrs_of(self, peer_id: ID) -> None:
        """Identify a peer that dialled us (we skip that on connect, see ``_tuning``) the first
        time we open a stream to it without knowing its addresses: we can then dial it again
        should the connection drop."""
        if peer_id in self._addresses_checked:
            return
        if len(self._addresses_checked) > 65536:
            self._addresses_checked.clear()
        self._addresses_checked.add(peer_id)
        if not self.known_addrs(peer_id):
            self._host._schedule_identify(peer_id, reason="swarmtrain-first-stream")

    def _known(self, peer_id: ID) -> bool:
        try:
            return peer_id in self._host.get_peerstore().peer_ids()
        except Exception:
            return False

    async def new_stream(self, peer: ID | str, protocol_id: str, *, lazily: bool = False):
        """Open a libp2p stream to ``peer`` (dialling first if needed). ``lazily``: do not wait
        for the peer to agree to ``protocol_id`` (checked on the first read; for protocols
        every peer we call serves, see ``_multistream.open_lazily_negotiated_stream``)."""
        peer_id = as_peer_id(peer)
        await self.ensure_connected(peer_id)
        self._learn_addrs_of(peer_id)
        try:
            with trio.fail_after(self.config.dial_timeout):
                try:
                    return await self._negotiated_stream(peer_id, protocol_id, lazily)
                except Exception:
                    if self.is_connected(peer_id):
                        raise
                # the connection died (e.g. the peer restarted): dial once more
                await self.ensure_connected(peer_id)
                return await self._negotiated_stream(peer_id, protocol_id, lazily)
        except trio.TooSlowError:
            raise PeerUnreachableError(
                f"{peer_id} did not accept a {protocol_id} stream within "
                f"{self.config.dial_timeout} s"
            ) from None
        except Exception as e:
            raise PeerUnreachableError(
                f"cannot open a {protocol_id} stream to {peer_id}: {e}"
            ) from e

    async def _negotiated_stream(self, peer_id: ID, protocol_id: str, lazily: bool):
        if lazily:
            network = self._host.get_network()
            return await open_lazily_negotiated_stream(network, peer_id, protocol_id)
        return await self._host.new_stream(peer_id, [TProtocol(protocol_id)])
