"""``swarmtrain node`` (alias ``swarmtrain dht``): a long-running DHT bootstrap and relay peer
that others pass as ``initial_peers``."""

from __future__ import annotations

import signal

import trio

from swarmtrain.dht import DHT

HELP = "run a long-lived DHT bootstrap/relay peer and print the multiaddrs others join with"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--host_maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        help="multiaddrs to listen on (default: all interfaces, a random TCP port)",
    )
    parser.add_argument("--announce_maddrs", nargs="*", default=[], help="public multiaddrs")
    parser.add_argument("--initial_peers", nargs="*", default=[], help="peers to join")
    parser.add_argument("--identity_path", default=None, help="Ed25519 key file (0600)")
    parser.add_argument(
        "--swarm_key_path",
        default=None,
        help="private run: only peers with this swarm key file connect (see `swarmtrain keygen`)",
    )
    parser.set_defaults(run=run)


async def serve(args) -> None:
    # The signal handler is installed before we print, so Ctrl-C right after the addresses
    # appear still shuts down cleanly.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with DHT.create(
            initial_peers=args.initial_peers,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            identity_path=args.identity_path,
            swarm_key=args.swarm_key_path,
        ) as dht:
            print(f"peer id: {dht.p2p.peer_id}", flush=True)
            print("others can join with --initial_peers:", flush=True)
            for addr in dht.get_visible_maddrs():
                print(f"  {addr}", flush=True)
            async for signum in signals:
                print(f"received {signal.Signals(signum).name}, shutting down", flush=True)
                break


def run(args) -> int:
    trio.run(serve, args)
    return 0
