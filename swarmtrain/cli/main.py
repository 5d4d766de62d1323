"""swarmtrain command line: `swarmtrain demo` trains a model with local peers, `swarmtrain node`
runs a DHT bootstrap peer, `swarmtrain keygen` writes a swarm key for a private run,
`swarmtrain runs` lists the announced runs, `swarmtrain monitor` serves a live dashboard
(`swarmtrain COMMAND --help` for each)."""

from __future__ import annotations

import argparse
import sys

import swarmtrain
from swarmtrain.cli import demo, keygen, monitor, node, runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmtrain", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"swarmtrain {swarmtrain.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help=demo.HELP, description=demo.HELP))
    node.add_arguments(
        commands.add_parser("node", aliases=["dht"], help=node.HELP, description=node.HELP)
    )
    keygen.add_arguments(commands.add_parser("keygen", help=keygen.HELP, description=keygen.HELP))
    runs.add_arguments(commands.add_parser("runs", help=runs.HELP, description=runs.HELP))
    monitor.add_arguments(
        commands.add_parser("monitor", help=monitor.HELP, description=monitor.HELP)
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
