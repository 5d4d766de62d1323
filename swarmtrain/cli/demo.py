"""``swarmtrain demo``: local peers train one model together (``--rpc``: the p2p RPC demo)."""

from __future__ import annotations

import argparse

from swarmtrain.cli.options import add_option

HELP = "start N local peers (one process each) that train one model together"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    parser.add_argument(
        "--epochs", type=int, default=None, help="train this many epochs (default 10)"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="train about this many seconds, then finish at the next epoch",
    )
    add_option(
        parser,
        "--target_batch_size",
        type=int,
        default=256,
        help="samples the swarm accumulates per epoch (default 256)",
    )
    add_option(
        parser, "--batch_size", type=int, default=16, help="samples per local step (default 16)"
    )
    add_option(
        parser,
        "--matchmaking_time",
        type=float,
        default=1.0,
        help="seconds to gather the peers for each averaging round (default 1)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    add_option(parser, "--log_dir", default=None, help="keep the peers' logs in this folder")
    parser.add_argument(
        "--rpc",
        action="store_true",
        help="instead: peers find each other through a bootstrap peer and call each other",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.rpc:
        from swarmtrain.cli import rpc_demo

        return rpc_demo.run(args.peers)
    from swarmtrain.cli import train_demo

    epochs = args.epochs if args.epochs is not None or args.duration is not None else 10
    options = train_demo.DemoOptions(
        peers=args.peers,
        epochs=epochs,
        duration=args.duration,
        target_batch_size=args.target_batch_size,
        batch_size=args.batch_size,
        matchmaking_time=args.matchmaking_time,
        quiet=args.quiet,
        log_dir=args.log_dir,
    )
    try:
        options.validate()
    except ValueError as e:
        raise SystemExit(f"swarmtrain demo: {e}") from None
    return train_demo.run(options)
