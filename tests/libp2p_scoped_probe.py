"""Runs swarmtrain hosts, then a plain py-libp2p host, in one fresh process; prints JSON.

    python tests/libp2p_scoped_probe.py   (from the repository root; used by
    tests/test_libp2p_scoped.py)

Before the first ``P2P.create`` it records ``vars()`` of every loaded ``libp2p.*`` module and of
every class defined in them; two swarmtrain hosts then call each other (small RPCs, 3 MiB over
yamux, both directions); the record is taken again and compared by identity (what was
assigned, added or deleted). Then two plain py-libp2p hosts (``new_host`` with its defaults)
talk in the same process, and what our subclasses used to change process-wide is read off
them: the classes of their connection pieces, their yamux frame sizes, identify on inbound
connections (and, for the record, their dial time).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import types

import multiaddr
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

import swarmtrain.p2p
from swarmtrain.p2p import P2P

ECHO = "/swarmtrain-scoped-probe/echo/1.0.0"
BULK = 3 * 1024 * 1024 + 12345
STOCK_WRITE = 200 * 1024
_MISSING = object()
#: the modules whose attributes (or whose classes' attributes) swarmtrain used to assign, some
#: loaded only once a host runs: imported before the first record
PATCHED_BEFORE = (
    "libp2p.host.basic_host",
    "libp2p.io.trio",
    "libp2p.network.config",
    "libp2p.network.connection.swarm_connection",
    "libp2p.network.swarm",
    "libp2p.protocol_muxer.multiselect_client",
    "libp2p.security.noise.io",
    "libp2p.stream_muxer.muxer_multistream",
    "libp2p.stream_muxer.yamux.yamux",
    "libp2p.transport.tcp.tcp",
)


def libp2p_namespaces() -> dict[str, dict]:
    """``vars()`` of every loaded libp2p module and of every class defined in one."""
    found: dict[str, dict] = {}
    for name, module in list(sys.modules.items()):
        if not (name == "libp2p" or name.startswith("libp2p.")) or module is None:
            continue
        found[name] = dict(vars(module))
        for value in vars(module).values():
            if isinstance(value, type) and getattr(value, "__module__", "") == name:
                found[f"{name}.{value.__qualname__}"] = dict(vars(value))
    return found


def own_state(owner: str, key: str) -> bool:
    """Whether ``owner`` is a module whose own code assigns ``key`` (``global key``): py-libp2p's
    runtime state (caches, counters), which any host changes."""
    module = sys.modules.get(owner)
    if module is None:
        return False
    try:
        return f"global {key}" in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def changes(before: dict[str, dict], after: dict[str, dict]) -> tuple[list[str], list[str]]:
    """``owner:attribute`` for every attribute assigned, deleted or added (a submodule that
    the import system added to its package is not a change), and apart, the module globals
    py-libp2p assigns itself (``own_state``)."""
    changed, own = [], []
    for owner, old in before.items():
        new = after.get(owner, {})
        for key in old.keys() | new.keys():
            was, now = old.get(key, _MISSING), new.get(key, _MISSING)
            if was is now:
                continue
            if was is _MISSING and isinstance(now, types.ModuleType):
                continue
            (own if own_state(owner, key) else changed).append(f"{owner}:{key}")
    return sorted(changed), sorted(own)


def spy_frames(muxed_conn, sizes: list[int]) -> None:
    """Record the payload size of every frame ``muxed_conn`` writes (an instance attribute on
    this one connection: the probe's own instrument)."""
    write_frame = muxed_conn._write_frame

    async def recording(data: bytes) -> None:
        sizes.append(len(data) - 12)
        await write_frame(data)

    muxed_conn._write_frame = recording


def pieces(host, peer_id) -> dict:
    """The classes of a host's connection pieces toward ``peer_id``."""
    network = host.get_network()
    conn = network.connections[peer_id][0]
    muxed = conn.muxed_conn
    secured = muxed.secured_conn
    upgrader = network.upgrader
    return {
        "connection": type(conn).__name__,
        "muxer": type(muxed).__name__,
        "streams": type(muxed.streams).__name__,
        "noise": type(secured.conn).__name__,
        "tcp": type(secured.conn.read_writer.read_write_closer.stream).__name__,
        "multiselect": sorted(
            {
                type(host.multiselect_client).__name__,
                type(upgrader.security_multistream._selector.multiselect_client).__name__,
                type(upgrader.muxer_multistream._selector.multiselect_client).__name__,
            }
        ),
        "muxer_multistream": type(upgrader.muxer_multistream).__name__,
        "tcp_transport": sorted(
            type(t).__name__ for t in network.transport_manager.get_transports()
        ),
        "identify_on_instance": "_schedule_identify" in vars(host),
        # the happy-eyeballs delay as this swarm's dial_peer reads it
        "dial_delay": network.dial_peer.__func__.__globals__["_HAPPY_EYEBALLS_DELAY"],
    }


async def echo(request, context):
    return request


async def run_ours() -> dict:
    frames: list[int] = []
    async with (
        P2P.create(use_data_lanes=False) as a,  # relay, hole punching, AutoNAT: on
        P2P.create(a.get_visible_maddrs(), use_data_lanes=False) as b,
    ):
        for host in (a, b):
            host.add_protobuf_handler("probe::Echo.echo", echo, BytesValue)
        small = BytesValue(value=b"x" * 300)
        for _ in range(20):
            await b.call_protobuf_handler(a.peer_id, "probe::Echo.echo", small, BytesValue)
        await a.call_protobuf_handler(b.peer_id, "probe::Echo.echo", small, BytesValue)
        spy_frames(b._host.get_network().connections[a.peer_id][0].muxed_conn, frames)
        big = BytesValue(value=bytes(BULK))
        reply = await b.call_protobuf_handler(
            a.peer_id, "probe::Echo.echo", big, BytesValue, bulk=True
        )
        assert reply.value == big.value
        return {"pieces": pieces(b._host, a.peer_id), "max_frame": max(frames)}


async def read_all(stream) -> int:
    from libp2p.network.stream.exceptions import StreamEOF

    got = 0
    while True:
        try:
            chunk = await stream.read(65536)
        except StreamEOF:
            return got
        if not chunk:
            return got
        got += len(chunk)


async def run_stock() -> dict:
    def plain_host():
        return new_host(
            key_pair=create_new_key_pair(),
            listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")],
        )

    listener, dialer = plain_host(), plain_host()
    received: list[int] = []
    done = trio.Event()

    async def handler(stream) -> None:
        received.append(await read_all(stream))
        await stream.close()
        done.set()

    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with listener.run(listen_addrs=listen), dialer.run(listen_addrs=listen):
        listener.set_stream_handler(ECHO, handler)
        started = trio.current_time()
        with trio.fail_after(10):
            await dialer.connect(PeerInfo(listener.get_id(), listener.get_addrs()))
        dial_seconds = trio.current_time() - started
        frames: list[int] = []
        spy_frames(dialer.get_network().connections[listener.get_id()][0].muxed_conn, frames)
        with trio.fail_after(10):
            stream = await dialer.new_stream(listener.get_id(), [ECHO])
            await stream.write(bytes(STOCK_WRITE))
            await stream.close()
            await done.wait()
        # identify on the inbound connection: the listener identifies its dialer by itself
        identified_inbound = False
        with trio.move_on_after(10):
            while not identified_inbound:
                identified_inbound = dialer.get_id() in listener._identified_peers
                await trio.sleep(0.02)
        return {
            "pieces": pieces(dialer, listener.get_id()),
            "listener_pieces": pieces(listener, dialer.get_id()),
            "max_frame": max(frames),
            "received": received,
            "dial_seconds": dial_seconds,
            "identified_inbound": identified_inbound,
        }


async def main() -> None:
    for name in PATCHED_BEFORE:
        importlib.import_module(name)
    before = libp2p_namespaces()
    ours = await run_ours()
    after = libp2p_namespaces()
    stock = await run_stock()
    changed, own = changes(before, after)
    print(
        json.dumps(
            {
                "swarmtrain": swarmtrain.p2p.__file__,
                "changes": changed,
                "libp2p_own_state": own,
                "namespaces": len(before),
                "ours": ours,
                "stock": stock,
            }
        )
    )


if __name__ == "__main__":
    trio.run(main)
