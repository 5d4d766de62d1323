"""``swarmtrain`` command line: ``swarmtrain demo``, ``swarmtrain node``, ``swarmtrain keygen``."""

from __future__ import annotations

import argparse
import sys

from swarmtrain.cli import demo, keygen, node


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmtrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help=demo.HELP, description=demo.HELP))
    node.add_arguments(
        commands.add_parser("node", aliases=["dht"], help=node.HELP, description=node.HELP)
    )
    keygen.add_arguments(commands.add_parser("keygen", help=keygen.HELP, description=keygen.HELP))
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
