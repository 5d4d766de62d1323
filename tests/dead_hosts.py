"""A dead peer's TCP port that drops dials, as a host that left the network does (tests and
``benchmarks/benchmark_rerun.py``)."""

from __future__ import annotations

import socket


def silent_port(port: int) -> list[socket.socket]:
    """Take over ``port`` on 127.0.0.1 so that dials to it hang: a listener that never accepts,
    its backlog filled, so the kernel drops new SYNs. The caller closes the sockets."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    sockets = [listener]
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        sockets.append(filler)
    return sockets
