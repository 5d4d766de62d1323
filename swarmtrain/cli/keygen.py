"""``swarmtrain keygen PATH``: write a fresh random swarm key (hex, mode 0600) for a private run;
give the same file to every peer (``--swarm_key_path``, ``P2P.create(swarm_key=PATH)``).

``swarmtrain keygen --run_owner PATH``: write a run owner key instead (Ed25519, PEM, mode 0600)
to sign the run's announcements (``AsyncRunAnnouncer.create(..., owner_key=load_owner_key(PATH))``)
and print its public key, which the organisers publish."""

from __future__ import annotations

import sys

from swarmtrain.cli.options import add_option
from swarmtrain.monitor.runs import generate_owner_key, owner_public_key, save_owner_key
from swarmtrain.p2p.private_network import SwarmKeyError, generate_swarm_key, save_swarm_key

HELP = "write a new random swarm key file for a private run (share it with your peers only)"


def add_arguments(parser) -> None:
    parser.add_argument("path", help="where to write the key (refuses to overwrite a file)")
    add_option(
        parser,
        "--run_owner",
        action="store_true",
        help="write a run owner key (signs run announcements) instead of a swarm key",
    )
    parser.set_defaults(run=run)


def run_owner_key(path: str) -> int:
    key = generate_owner_key()
    try:
        save_owner_key(key, path)
    except OSError as e:
        print(f"swarmtrain keygen: {e}", file=sys.stderr)
        return 1
    print(f"wrote a run owner key to {path}; its public key (publish it with the run):")
    print(owner_public_key(key))
    return 0


def run(args) -> int:
    if args.run_owner:
        return run_owner_key(args.path)
    try:
        save_swarm_key(generate_swarm_key(), args.path)
    except SwarmKeyError as e:
        print(f"swarmtrain keygen: {e}", file=sys.stderr)
        return 1
    print(f"wrote a swarm key to {args.path}; peers started with it only admit each other")
    return 0
