"""The DCUtR dial-leak fix for py-libp2p 0.8.1 (see ``_fix_hole_punch_dial_leak``)."""

from __future__ import annotations

import trio


def _fix_hole_punch_dial_leak() -> None:
    """Replace py-libp2p 0.8.1's source-bound TCP dial, which only DCUtR uses, idempotently.

    DCUtR dials every address of the peer at once from our listen port and cancels the other
    dials as soon as one direct connection verifies. The original function closes its socket
    only on ``OSError``, so a dial cancelled inside ``bind``/``connect`` leaks the socket
    (a ``ResourceWarning`` at garbage collection; measured in about 1 of 12 loopback hole
    punches with a listening target). This version closes it on every exit but success.
    """
    from libp2p.transport.tcp import tcp as tcp_module

    current = getattr(tcp_module, "_open_tcp_stream_from", None)
    if getattr(current, "swarmtrain_fixed", False):
        return
    for name in ("_open_tcp_stream_from", "_set_reuse_flags", "OpenConnectionError"):
        if not hasattr(tcp_module, name):
            raise RuntimeError(f"libp2p internals changed: {tcp_module.__name__}.{name} is missing")
    set_reuse_flags = tcp_module._set_reuse_flags
    open_error = tcp_module.OpenConnectionError

    async def open_tcp_stream_from(host: str, port: int, source: tuple[str, int]):
        src_ip, src_port = source
        if (":" in src_ip) != (":" in host):
            raise open_error(f"Source/destination IP family mismatch: {src_ip} vs {host}")
        family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
        try:
            sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
        except OSError as e:
            raise open_error(f"Failed to create TCP socket: {e}") from e
        bound = False
        try:
            set_reuse_flags(sock)
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
            raise open_error(
                f"Failed to connect {host}:{port} from {src_ip}:{src_port}: {e}"
            ) from e
        except BaseException:
            sock.close()
            raise
        sock.close()
        try:
            return await trio.open_tcp_stream(host, port)
        except OSError as e:
            raise open_error(f"Failed to connect {host}:{port}: {e}") from e

    open_tcp_stream_from.swarmtrain_fixed = True  # type: ignore[attr-defined]
    tcp_module._open_tcp_stream_from = open_tcp_stream_from
