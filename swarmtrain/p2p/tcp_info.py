"""What the kernel knows of a connected TCP socket (Linux ``TCP_INFO``): its smoothed RTT
and an estimate of its loss, and the walk from a libp2p connection down to that socket
(:func:`tcp_socket_of`). Used by data lanes (stripes per path), our yamux (long-path tuning)
and AutoNAT (the RTT of a direct connection); None wherever the platform or the socket cannot
tell."""

from __future__ import annotations

import socket
import sys
from typing import Any

from libp2p.connection_types import ConnectionType

__all__ = ["MIN_SEGMENTS_FOR_LOSS", "tcp_loss", "tcp_rtt", "tcp_socket_of"]


#: the loss estimate of a connection that sent fewer segments than this is unknown
MIN_SEGMENTS_FOR_LOSS = 50
#: attributes that lead from a swarm connection down to its TCP socket, tried in this order at
#: each level (py-libp2p 0.8: yamux -> secure session -> Noise reader -> raw connection ->
#: TrioTCPStream -> trio SocketStream -> socket; a private network's layer in between)
_TOWARDS_THE_SOCKET = (
    "muxed_conn",
    "secured_conn",
    "conn",
    "read_write_closer",
    "stream",
    "socket",
)
_MAX_LAYERS = 12


def tcp_socket_of(conn: Any) -> Any:
    """The TCP socket under a libp2p connection, from any of its layers (the swarm's
    connection, its muxer, its secure session, its raw connection), or None: a relayed
    connection (its only socket is the relay's), another transport, or more than
    ``_MAX_LAYERS`` layers."""
    for _ in range(_MAX_LAYERS):
        if callable(getattr(conn, "getsockopt", None)):
            return conn
        if _says_relayed(conn):
            return None
        conn = next(
            (getattr(conn, n) for n in _TOWARDS_THE_SOCKET if getattr(conn, n, None) is not None),
            None,
        )
        if conn is None:
            return None
    return None


def _says_relayed(layer: Any) -> bool:
    """Whether ``layer`` knows it is (part of) a relayed connection: below it is a stream over
    another connection, whose socket is not this connection's."""
    get_type = getattr(layer, "get_connection_type", None)
    if not callable(get_type):
        return False
    try:
        return get_type() == ConnectionType.RELAYED
    except Exception:
        return False


def tcp_loss(raw: socket.socket) -> float | None:
    """An upper estimate of the share of a connected TCP socket's segments that were lost:
    retransmitted ones over sent ones (``tcpi_total_retrans / tcpi_segs_out``, Linux
    ``TCP_INFO``), and one in n where none of n was (nothing seen is not no loss); None where
    unknown or after fewer than ``MIN_SEGMENTS_FOR_LOSS`` segments."""
    try:
        info = raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 144)
    except (AttributeError, OSError):
        return None
    if len(info) < 140:
        return None
    retransmitted = int.from_bytes(info[100:104], sys.byteorder)
    sent = int.from_bytes(info[136:140], sys.byteorder)
    if sent < MIN_SEGMENTS_FOR_LOSS:
        return None
    return min(1.0, max(retransmitted, 1) / sent)


def tcp_rtt(raw: socket.socket) -> float | None:
    """The kernel's smoothed RTT of a connected TCP socket in seconds (Linux ``TCP_INFO``),
    None where unknown."""
    try:
        info = raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (AttributeError, OSError):
        return None
    if len(info) < 72:
        return None
    return int.from_bytes(info[68:72], sys.byteorder) / 1e6
