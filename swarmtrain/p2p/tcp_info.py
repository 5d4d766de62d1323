"""What the kernel knows of a connected TCP socket (Linux ``TCP_INFO``): its smoothed RTT
and an estimate of its loss. Used by data lanes (stripes per path) and our yamux (long-path
tuning); None wherever the platform or the socket cannot tell."""

from __future__ import annotations

import socket
import sys

__all__ = ["MIN_SEGMENTS_FOR_LOSS", "tcp_loss", "tcp_rtt"]


#: the loss estimate of a connection that sent fewer segments than this is unknown
MIN_SEGMENTS_FOR_LOSS = 50


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
