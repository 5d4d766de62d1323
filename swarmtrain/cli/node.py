"""``swarmtrain node`` (alias ``swarmtrain dht``): a long-running DHT bootstrap and relay peer
that others pass as ``initial_peers``.

The node registers every owned key pattern (:mod:`swarmtrain.dht.owned_keys`): it refuses
unsigned and forged records under matchmaking, state-sharing, presence, metrics and run-directory
keys, as the trainers' nodes do, without importing torch."""

from __future__ import annotations

import signal
import sys
import time

import trio

from swarmtrain.cli.options import add_option
from swarmtrain.dht import DHT, owned_keys_validator
from swarmtrain.p2p import P2PError

HELP = "run a long-lived DHT bootstrap/relay peer and print the multiaddrs others join with"
BOLD, RESET = "\x1b[1m", "\x1b[0m"


def add_arguments(parser) -> None:
    add_option(
        parser,
        "--host_maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        help="multiaddrs to listen on (default: all interfaces, a random TCP port)",
    )
    add_option(parser, "--announce_maddrs", nargs="*", default=[], help="public multiaddrs")
    add_option(parser, "--initial_peers", nargs="*", default=[], help="peers to join")
    add_option(parser, "--identity_path", default=None, help="Ed25519 key file (0600)")
    add_option(
        parser,
        "--refresh_period",
        type=float,
        default=30.0,
        help="print the routing table and storage every this many seconds (default 30; 0: never)",
    )
    add_option(
        parser,
        "--swarm_key_path",
        default=None,
        help="private run: only peers with this swarm key file connect (see `swarmtrain keygen`)",
    )
    parser.set_defaults(run=run)


def print_addresses(dht, out=sys.stdout) -> None:
    """The peer id, the address to join with (bold on a terminal), and every address."""
    addresses = dht.get_visible_maddrs()
    print(f"peer id: {dht.p2p.peer_id}", file=out, flush=True)
    if not addresses:
        print("this node has no address others can dial (client mode?)", file=out, flush=True)
        return
    first = addresses[0]
    if out.isatty():
        first = f"{BOLD}{first}{RESET}"
    print(f"others can join with: --initial_peers {first}", file=out, flush=True)
    print("all addresses of this node:", file=out, flush=True)
    for addr in addresses:
        print(f"  {addr}", file=out, flush=True)


def status_line(dht, started: float) -> str:
    stats = dht.node.statistics()
    return (
        f"up {time.monotonic() - started:.0f} s: {stats.routing_table.num_nodes} peers in the "
        f"routing table, {len(dht.p2p.get_connected_peers())} connected, "
        f"{stats.num_stored_keys} records stored ({stats.num_cached_keys} cached)"
    )


async def report_status(dht, period: float, out=sys.stdout) -> None:
    started = time.monotonic()
    while True:
        await trio.sleep(period)
        print(status_line(dht, started), file=out, flush=True)


async def serve(args) -> None:
    # The signal handler is installed before we print, so Ctrl-C right after the addresses
    # appear still shuts down cleanly.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            DHT.create(
                initial_peers=args.initial_peers,
                host_maddrs=args.host_maddrs,
                announce_maddrs=args.announce_maddrs,
                identity_path=args.identity_path,
                swarm_key=args.swarm_key_path,
                record_validators=[owned_keys_validator()],
            ) as dht,
            trio.open_nursery() as nursery,
        ):
            print_addresses(dht)
            if args.refresh_period > 0:
                nursery.start_soon(report_status, dht, args.refresh_period)
            async for signum in signals:
                print(f"received {signal.Signals(signum).name}, shutting down", flush=True)
                break
            nursery.cancel_scope.cancel()


def run(args) -> int:
    if args.refresh_period < 0:
        raise SystemExit("swarmtrain node: --refresh_period must be >= 0")
    try:
        trio.run(serve, args)
    except (P2PError, ValueError) as e:  # a taken port, a bad or unreachable initial peer
        print(f"swarmtrain node: {e}", file=sys.stderr)
        return 1
    return 0
