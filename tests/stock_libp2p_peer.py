"""A stock py-libp2p peer for interop tests: never imports swarmtrain, so nothing is tuned.

    python tests/stock_libp2p_peer.py

Prints one JSON line ``{"peer_id": ..., "addrs": [...]}`` once it listens (127.0.0.1, TCP,
Noise, yamux), serves ``ECHO_PROTOCOL`` (reads a stream to its end, writes it back, closes),
then reads commands from stdin, one JSON line each:

- ``{"echo_to": maddr, "peer_id": id, "size": n}``: dial that peer, open ``ECHO_PROTOCOL``,
  send ``n`` bytes of a fixed pattern, read the echo; prints ``{"echo_ok": bool, "got": m}``;
- ``{"quit": true}``: stop.
"""

from __future__ import annotations

import json
import sys

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

ECHO_PROTOCOL = "/swarmtrain-contract/echo/1.0.0"
CHUNK = 256 * 1024


def pattern(size: int) -> bytes:
    block = bytes(range(251))  # a prime length: misplaced chunks do not line up
    return (block * (size // len(block) + 1))[:size]


async def read_to_end(stream) -> bytes:
    received = bytearray()
    while True:
        try:
            chunk = await stream.read(CHUNK)
        except StreamEOF:
            return bytes(received)
        if not chunk:
            return bytes(received)
        received += chunk


async def echo_handler(stream) -> None:
    data = await read_to_end(stream)
    for start in range(0, len(data), CHUNK):
        await stream.write(data[start : start + CHUNK])
    await stream.close()


async def send_and_read_back(host, maddr: str, peer_id: str, size: int) -> dict:
    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(f"{maddr}/p2p/{peer_id}")))
    stream = await host.new_stream(ID.from_base58(peer_id), [ECHO_PROTOCOL])
    data = pattern(size)

    async def send() -> None:
        for start in range(0, size, CHUNK):
            await stream.write(data[start : start + CHUNK])
        await stream.close()  # half-close: the echo ends when our data does

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        echoed = await read_to_end(stream)
    return {"echo_ok": echoed == data, "got": len(echoed)}


async def main() -> None:
    host = new_host(
        key_pair=create_new_key_pair(),
        muxer_preference="YAMUX",
        listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")],
    )
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        host.set_stream_handler(ECHO_PROTOCOL, echo_handler)
        addrs = [str(a) for a in host.get_addrs()]
        print(json.dumps({"peer_id": host.get_id().to_base58(), "addrs": addrs}), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        while line := await stdin.readline():
            command = json.loads(line)
            if command.get("quit"):
                break
            with trio.fail_after(60):
                reply = await send_and_read_back(
                    host, command["echo_to"], command["peer_id"], command["size"]
                )
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    trio.run(main)
