"""``swarmtrain node``: a long-running bootstrap peer that others pass as ``initial_peers``."""

from __future__ import annotations

import signal

import trio

from swarmtrain.p2p import P2P

HELP = "run a long-lived bootstrap peer and print the multiaddrs others should join with"


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
    parser.set_defaults(run=run)


async def serve(args) -> None:
    async with P2P.create(
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
    ) as p2p:
        print(f"peer id: {p2p.peer_id}", flush=True)
        print("others can join with --initial_peers:", flush=True)
        for addr in p2p.get_visible_maddrs():
            print(f"  {addr}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                print(f"received {signal.Signals(signum).name}, shutting down", flush=True)
                break


def run(args) -> int:
    trio.run(serve, args)
    return 0
