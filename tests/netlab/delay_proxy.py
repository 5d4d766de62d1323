"""A transparent TCP delay proxy (netem is not in this kernel): run it inside a namespace whose
outgoing TCP connections iptables REDIRECTs to ``--port`` (``Lab.add_latency``).

For each connection it reads the original destination (``SO_ORIGINAL_DST``), connects there
with ``SO_MARK`` = ``MARK`` set (so the REDIRECT rule skips its own connection), and forwards
both directions. Every chunk read is stamped with its arrival time and written once
``delay`` (+ a uniform draw in [0, ``jitter``]) has passed: chunks in flight overlap (a busy
link is not serialized by the delay), and a chunk is never sent before the one read before it
(due times are kept non-decreasing), so the byte stream keeps its order. At most
``BUFFER_LIMIT`` bytes wait per direction; reading pauses beyond that. EOF is passed on as a
half-close once the data before it went out; a reset closes both sides.

Prints one JSON line ``{"ready": port, "mark": "0x..."}`` when listening; runs until stdin
closes (or a ``{"op": "quit"}`` line).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import socket
import struct
import sys

MARK = 0x231
SO_ORIGINAL_DST = 80
CHUNK = 65536
BUFFER_LIMIT = 16 << 20


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed_ip = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed_ip), port


class DelayedPipe:
    """One direction of a connection: read, stamp, wait, write."""

    def __init__(self, reader, writer, delay: float, jitter: float, rng: random.Random):
        self.reader, self.writer = reader, writer
        self.delay, self.jitter, self.rng = delay, jitter, rng
        self.queue: collections.deque = collections.deque()
        self.queued = 0
        self.ready = asyncio.Event()  # something is queued
        self.room = asyncio.Event()  # below BUFFER_LIMIT
        self.room.set()
        self.last_due = 0.0

    async def read_side(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self.room.wait()
                chunk = await self.reader.read(CHUNK)
                due = loop.time() + self.delay + self.rng.uniform(0.0, self.jitter)
                self.last_due = due = max(due, self.last_due)
                self.queue.append((due, chunk))  # b"" = EOF
                self.queued += len(chunk)
                if self.queued >= BUFFER_LIMIT:
                    self.room.clear()
                self.ready.set()
                if not chunk:
                    return
        except (ConnectionError, OSError):
            self.queue.append((0.0, None))  # reset
            self.ready.set()

    async def write_side(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.ready.clear()
                await self.ready.wait()
            due, chunk = self.queue.popleft()
            if chunk is None:
                raise ConnectionResetError
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(chunk)
            await self.writer.drain()
            self.queued -= len(chunk)
            if self.queued < BUFFER_LIMIT:
                self.room.set()


async def handle(client_reader, client_writer, args, rng: random.Random) -> None:
    server_writer = None
    try:
        client_sock = client_writer.get_extra_info("socket")
        host, port = original_destination(client_sock)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        server_reader, server_writer = await asyncio.open_connection(sock=sock)
        for s in (client_sock, sock):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipes = [
            DelayedPipe(client_reader, server_writer, args.delay, args.jitter, rng),
            DelayedPipe(server_reader, client_writer, args.delay, args.jitter, rng),
        ]
        sides = [side for p in pipes for side in (p.read_side, p.write_side)]
        tasks = [asyncio.ensure_future(side()) for side in sides]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)  # a reset ends all
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    except (ConnectionError, OSError):
        pass
    finally:
        for writer in (client_writer, server_writer):
            if writer is not None:
                writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, required=True, help="seconds, each way")
    parser.add_argument("--jitter", type=float, default=0.0, help="extra seconds, 0..jitter")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, args, rng), "0.0.0.0", args.port, reuse_address=True
    )
    print(json.dumps({"ready": args.port, "mark": hex(MARK)}), flush=True)
    async with server:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or "quit" in line:
                return


if __name__ == "__main__":
    asyncio.run(main())
