"""Our hosts' TCP transport: py-libp2p 0.8.1's, without the socket leak of DCUtR's dials;
our hosts' peerstore: py-libp2p 0.8.1's, keeping the ways to reach a peer through relays.

DCUtR dials every address of the peer at once from our listen port and cancels the other dials
as soon as one direct connection verifies. py-libp2p's source-bound dial
(``tcp._open_tcp_stream_from``) closes its socket only on ``OSError``, so a dial cancelled
inside ``bind``/``connect`` leaked the socket (a ``ResourceWarning`` at garbage collection;
measured in about 1 of 12 loopback hole punches with a listening target).
``HolePunchTCP`` dials from a source port with ``open_tcp_stream_from``, which closes the
socket on every exit but success. Our hosts' TCP transport is adopted into it
(``use_hole_punch_tcp``); py-libp2p's ``TCP`` class and ``tcp`` module are not changed.

py-libp2p replaces *all* of a peer's addresses when identify reports the peer's signed peer
record or listen addresses (``PeerStore.consume_peer_record``, ``clear_addrs``), and when a
dial reaches another peer than expected ("Peer ID mismatch"). A peer behind a NAT listens on
private addresses and is reachable only through its ``/p2p-circuit`` addresses (learned from
the DHT or the caller), which its listen addresses do not include: the first identify over a
relayed connection erased them, and once that connection closed the peer could not be
dialled again (the DHT does not hand out addresses it already announced; the private ones
failed). ``CircuitKeepingPeerStore`` keeps a peer's circuit addresses through both
replacements (they expire with the peer's entry, as the others); our hosts' peerstore is
adopted into it (``keep_circuit_addrs``).
"""

from __future__ import annotations

import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.peerstore import PeerStore
from libp2p.transport.exceptions import OpenConnectionError
from libp2p.transport.tcp import tcp as tcp_module
from libp2p.transport.tcp.tcp import TCP
from libp2p.utils.multiaddr_utils import extract_ip_from_multiaddr

_set_reuse_flags = tcp_module._set_reuse_flags  # SO_REUSEADDR/SO_REUSEPORT as its listener


async def open_tcp_stream_from(host: str, port: int, source: tuple[str, int]):
    """A TCP stream to ``host:port`` from ``source`` (our listen port; an ephemeral one where
    the platform refuses to share it). Raises ``OpenConnectionError``; never leaks the socket."""
    src_ip, src_port = source
    if (":" in src_ip) != (":" in host):
        raise OpenConnectionError(f"Source/destination IP family mismatch: {src_ip} vs {host}")
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    try:
        sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    except OSError as e:
        raise OpenConnectionError(f"Failed to create TCP socket: {e}") from e
    bound = False
    try:
        _set_reuse_flags(sock)
        try:
            await sock.bind((src_ip, src_port))
            bound = True
        except OSError:
            pass  # this platform cannot share the listen port: dial from an ephemeral one
        if bound:
            await sock.connect((host, port))
            return trio.SocketStream(sock)
    except OSError as e:
        sock.close()
        raise OpenConnectionError(
            f"Failed to connect {host}:{port} from {src_ip}:{src_port}: {e}"
        ) from e
    except BaseException:
        sock.close()
        raise
    sock.close()
    try:
        return await trio.open_tcp_stream(host, port)
    except OSError as e:
        raise OpenConnectionError(f"Failed to connect {host}:{port}: {e}") from e


class HolePunchTCP(TCP):
    """py-libp2p's TCP transport whose source-bound dials (DCUtR's) use
    ``open_tcp_stream_from``; every other dial is py-libp2p's."""

    async def _dial_resolved(self, maddr, source: tuple[str, int] | None = None):
        if source is None:
            return await super()._dial_resolved(maddr)
        host = extract_ip_from_multiaddr(maddr)
        try:
            port = int(maddr.value_for_protocol("tcp"))
        except Exception:
            raise OpenConnectionError(f"Failed to dial {maddr}: no valid TCP port") from None
        if host is None:
            raise OpenConnectionError(f"Failed to dial {maddr}: IP address not found")
        stream = await open_tcp_stream_from(host, port, source)
        return RawConnection(TrioTCPStream(stream), True)


def use_hole_punch_tcp(host) -> None:
    """Adopt ``host``'s (a py-libp2p BasicHost, not yet running) TCP transport into
    ``HolePunchTCP``, in place."""
    for transport in host.get_network().transport_manager.get_transports():
        if type(transport) is TCP:
            transport.__class__ = HolePunchTCP


#: the part of a multiaddr that makes it a circuit-relay address
CIRCUIT = "/p2p-circuit"


class CircuitKeepingPeerStore(PeerStore):
    """py-libp2p's peerstore that keeps a peer's ``/p2p-circuit`` addresses when it replaces
    the peer's addresses (``clear_addrs``, ``consume_peer_record``: identify); see the module
    docstring. Everything else is py-libp2p's."""

    def clear_addrs(self, peer_id) -> None:
        kept = self._circuit_addrs(peer_id)
        super().clear_addrs(peer_id)
        self._restore(peer_id, kept)

    def consume_peer_record(self, envelope, ttl: int) -> bool:
        try:
            peer_id = envelope.record().peer_id
        except Exception:  # py-libp2p rejects it as it sees fit
            return super().consume_peer_record(envelope, ttl)
        kept = self._circuit_addrs(peer_id)
        accepted = super().consume_peer_record(envelope, ttl)
        self._restore(peer_id, kept)
        return accepted

    def _circuit_addrs(self, peer_id) -> list:
        peer_data = self.peer_data_map.get(peer_id)
        return [a for a in peer_data.get_addrs() if CIRCUIT in str(a)] if peer_data else []

    def _restore(self, peer_id, kept: list) -> None:
        peer_data = self.peer_data_map.get(peer_id)
        if kept and peer_data is not None:
            peer_data.add_addrs(kept)  # no-op for those still there


def keep_circuit_addrs(host) -> None:
    """Adopt ``host``'s (a py-libp2p BasicHost) peerstore into ``CircuitKeepingPeerStore``, in
    place."""
    peerstore = host.get_peerstore()
    if type(peerstore) is not PeerStore:
        raise RuntimeError(f"libp2p internals changed: the host's peerstore is a {peerstore}")
    peerstore.__class__ = CircuitKeepingPeerStore
