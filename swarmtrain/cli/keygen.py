"""``swarmtrain keygen PATH``: write a fresh random swarm key (hex, mode 0600) for a private run;
give the same file to every peer (``--swarm_key_path``, ``P2P.create(swarm_key=PATH)``)."""

from __future__ import annotations

import sys

from swarmtrain.p2p.private_network import SwarmKeyError, generate_swarm_key, save_swarm_key

HELP = "write a new random swarm key file for a private run (share it with your peers only)"


def add_arguments(parser) -> None:
    parser.add_argument("path", help="where to write the key (refuses to overwrite a file)")
    parser.set_defaults(run=run)


def run(args) -> int:
    try:
        save_swarm_key(generate_swarm_key(), args.path)
    except SwarmKeyError as e:
        print(f"swarmtrain keygen: {e}", file=sys.stderr)
        return 1
    print(f"wrote a swarm key to {args.path}; peers started with it only admit each other")
    return 0
