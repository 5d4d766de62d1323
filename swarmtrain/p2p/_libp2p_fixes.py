"""Our hosts' TCP transport: py-libp2p 0.8.1's, without the socket leak of DCUtR's dials.

DCUtR dials every address of the peer at once from our listen port and cancels the other dials
as soon as one direct connection verifies. py-libp2p's source-bound dial
(``tcp._open_tcp_stream_from``) closes its socket only on ``OSError``, so a dial cancelled
inside ``bind``/``connect`` leaked the socket (a ``ResourceWarning`` at garbage collection;
measured in about 1 of 12 loopback hole punches with a listening target).
``HolePunchTCP`` dials from a source port with ``open_tcp_stream_from``, which closes the
socket on every exit but success. Our hosts' TCP transport is adopted into it
(``use_hole_punch_tcp``); py-libp2p's ``TCP`` class and ``tcp`` module are not changed.
"""

from __future__ import annotations

import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
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
