"""A small HTTP server on trio's sockets for the dashboard: static pages, a JSON snapshot and
server-sent events (``/events``). GET and HEAD only; one request per connection.

Resource handling: every connection is bounded (``max_connections`` at once, a request head of
at most 8 KiB read within ``request_timeout``; a client that does not take an event within
``send_timeout`` is dropped), so a slow or hostile browser cannot hold the loop or memory.
``publish`` replaces the snapshot; event streams send the latest one (older ones are skipped,
never queued).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from importlib import resources

import trio

__all__ = ["DashboardServer"]

logger = logging.getLogger(__name__)

MAX_REQUEST_HEAD = 8192
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


def load_assets() -> dict[str, tuple[str, bytes]]:
    """The dashboard's files shipped in ``swarmtrain/monitor/static``: ``{path: (type, body)}``."""
    assets = {}
    for entry in resources.files("swarmtrain.monitor").joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if suffix in _CONTENT_TYPES:
            assets["/" + entry.name] = (_CONTENT_TYPES[suffix], entry.read_bytes())
    assets["/"] = assets["/index.html"]
    return assets


def _response(status: str, content_type: str, body: bytes, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


class DashboardServer:
    """Serves ``assets``, ``/api/state`` (the latest published JSON; ``/state.js`` the same as a
    script for the page's first render) and ``/events`` (SSE)."""

    def __init__(
        self,
        assets: Mapping[str, tuple[str, bytes]] | None = None,
        *,
        max_connections: int = 64,
        request_timeout: float = 10.0,
        send_timeout: float = 10.0,
        keepalive: float = 15.0,
    ):
        self.assets = dict(load_assets() if assets is None else assets)
        self._limiter = trio.CapacityLimiter(max_connections)
        self.request_timeout, self.send_timeout, self.keepalive = (
            request_timeout,
            send_timeout,
            keepalive,
        )
        self._snapshot = b"{}"
        self._changed = trio.Event()
        self.requests = self.rejected = 0

    def publish(self, snapshot_json: bytes) -> None:
        """Make ``snapshot_json`` the current state; event streams send it soon."""
        self._snapshot = snapshot_json
        self._changed.set()
        self._changed = trio.Event()

    async def serve(
        self, port: int, host: str = "127.0.0.1", *, task_status=trio.TASK_STATUS_IGNORED
    ):
        """Listen until cancelled; ``task_status.started(port)`` reports the bound port."""
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, host=host), self._handle, port
            )
            task_status.started(listeners[0].socket.getsockname()[1])

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                self._limiter.acquire_nowait()
            except trio.WouldBlock:
                self.rejected += 1
                with trio.move_on_after(self.send_timeout):
                    await stream.send_all(_response("503 Busy", "text/plain", b"busy\n"))
                return
            try:
                await self._serve_one(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away
            finally:
                self._limiter.release()

    async def _read_head(self, stream: trio.SocketStream) -> bytes | None:
        """The request head; None if the client went quiet or away, b\"\" if it is too large."""
        data = b""
        with trio.move_on_after(self.request_timeout):
            while b"\r\n\r\n" not in data:
                if len(data) > MAX_REQUEST_HEAD:
                    return b""  # too large
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return None
                data += chunk
            return data
        return None

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        head = await self._read_head(stream)
        if head is None:
            return
        if not head:
            await self._send(stream, _response("431 Too Large", "text/plain", b"too large\n"))
            return
        self.requests += 1
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            await self._send(stream, _response("400 Bad Request", "text/plain", b"bad request\n"))
            return
        method, target = parts[0], parts[1].decode("ascii", errors="replace").split("?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            await self._send(
                stream, _response("405 Method Not Allowed", "text/plain", b"GET only\n")
            )
            return
        head_only = method == b"HEAD"
        if target == "/events" and not head_only:
            await self._stream_events(stream)
        elif target == "/state.js":  # the first render, before the event stream answers
            body = b"window.SWARMTRAIN_STATE = " + self._snapshot + b";\n"
            kind = _CONTENT_TYPES[".js"]
            await self._send(stream, _response("200 OK", kind, body, head_only))
        elif target == "/api/state":
            body = self._snapshot
            await self._send(stream, _response("200 OK", "application/json", body, head_only))
        elif target in self.assets:
            content_type, body = self.assets[target]
            await self._send(stream, _response("200 OK", content_type, body, head_only))
        else:
            await self._send(stream, _response("404 Not Found", "text/plain", b"not found\n"))

    async def _send(self, stream: trio.SocketStream, data: bytes) -> bool:
        with trio.move_on_after(self.send_timeout):
            await stream.send_all(data)
            return True
        return False  # too slow: drop it

    async def _stream_events(self, stream: trio.SocketStream) -> None:
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
            b"Connection: close\r\n\r\n"
        )
        sent = None
        if not await self._send(stream, head):
            return
        while True:
            changed = self._changed
            if self._snapshot is not sent:
                sent = self._snapshot
                if not await self._send(stream, b"event: state\ndata: " + sent + b"\n\n"):
                    return
            with trio.move_on_after(self.keepalive) as scope:
                await changed.wait()
            if scope.cancelled_caught and not await self._send(stream, b": keepalive\n\n"):
                return
