"""``swarmtrain runs --initial_peers ...``: list the runs announced in the DHT's run directory
(:mod:`swarmtrain.monitor.runs`) with how to join each."""

from __future__ import annotations

import sys
from collections import Counter

import trio

from swarmtrain.cli.options import add_option
from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.monitor.runs import RunAnnouncement, list_runs
from swarmtrain.p2p import P2PError

HELP = "list the training runs announced in the DHT, with how to join each"


def add_arguments(parser) -> None:
    add_option(parser, "--initial_peers", nargs="+", default=[], help="peers to join (required)")
    add_option(
        parser,
        "--timeout",
        type=float,
        default=30.0,
        help="give up after this many seconds (default 30)",
    )
    add_option(parser, "--swarm_key_path", default=None, help="swarm key of a private DHT")
    parser.set_defaults(run=run)


def describe(run: RunAnnouncement, now: float, announcers: int = 1) -> list[str]:
    """The lines printed for one run (``announcers``: how many peers announce its ``run_id``)."""
    title = f"{run.run_id}" + (f" ({run.name})" if run.name else "")
    lines = [f"{title}  [announced {max(0.0, now - run.time):.0f} s ago]"]
    vouch = "one of its initial peers" if run.announced_by_initial_peer else "not an initial peer"
    lines.append(f"  announced by peer {run.announcer} ({vouch})")
    if announcers > 1:
        lines.append(
            f"  warning: {announcers} peers announce run_id {run.run_id!r}: "
            "check which announcer you trust"
        )
    if run.description:
        lines.append(f"  {run.description}")
    if run.model:
        lines.append(f"  model: {run.model}")
    if run.requirements:
        lines.append(f"  requirements: {run.requirements}")
    if run.private:
        lines.append("  private: ask the organisers for the swarm key")
    if run.command:
        lines.append(f"  join with: {run.command}")
    if run.initial_peers:
        lines.append(f"  initial peers: {' '.join(run.initial_peers)}")
    return lines


async def list_and_print(args, out=sys.stdout) -> int:
    with trio.fail_after(args.timeout):
        async with DHT.create(
            initial_peers=args.initial_peers, client_mode=True, swarm_key=args.swarm_key_path
        ) as dht:
            runs = await list_runs(dht)
    if not runs:
        print("no runs announced", file=out, flush=True)
        return 0
    now = get_dht_time()
    announcers = Counter(run.run_id for run in runs)
    for run in runs:
        print("\n".join(describe(run, now, announcers[run.run_id])), file=out, flush=True)
    return 0


def run(args) -> int:
    if not args.initial_peers:
        raise SystemExit("swarmtrain runs: --initial_peers is required (a peer of the run's DHT)")
    try:
        return trio.run(list_and_print, args)
    except trio.TooSlowError:
        print(f"swarmtrain runs: no answer within {args.timeout:g} s", file=sys.stderr)
    except (P2PError, ValueError) as e:
        print(f"swarmtrain runs: {e}", file=sys.stderr)
    return 1
