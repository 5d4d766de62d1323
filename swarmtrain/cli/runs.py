"""``swarmtrain runs --initial_peers ... [--known_runs FILE]``: list the runs announced in the
DHT's run directory (:mod:`swarmtrain.monitor.runs`) with how to join each, and whether each
announcement is signed by its run's owner key (:mod:`swarmtrain.monitor.run_trust`).

With ``--known_runs FILE`` (JSON ``{run_id: owner key}``, like ssh's known hosts) the owner keys
pinned there are checked and the first key seen for a new ``run_id`` is added to the file."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

import trio

from swarmtrain.cli.options import add_option
from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.monitor.run_trust import CONFLICT, IMPOSTOR, OWNER, RunTrust, check_pins
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
    add_option(
        parser,
        "--known_runs",
        default=None,
        help="JSON file of run owner keys: checked, and new runs' first keys added to it",
    )
    parser.set_defaults(run=run)


_VERDICTS = {
    OWNER: "signed by the run's owner key {key}",
    IMPOSTOR: "UNTRUSTED: not signed by this run_id's owner key {pin} (an impostor?)",
    CONFLICT: "UNTRUSTED: several owner keys claim this run_id; ask the organisers for theirs",
    "unsigned": "unsigned: anyone can announce this run_id",
}


def describe_trust(run: RunAnnouncement, verdict: str, pin: str | None) -> str:
    """The line that says whether to trust ``run`` (``verdict`` from ``RunTrust``)."""
    return "  " + _VERDICTS[verdict].format(
        key=run.owner_key[:16] + "…", pin=(pin or "")[:16] + "…"
    )


def load_known_runs(path: str | None) -> dict[str, str]:
    if path is None or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as file:
        try:
            return check_pins(json.loads(file.read(1 << 20)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None


def save_known_runs(path: str, pins: dict[str, str]) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(pins, file, indent=1, sort_keys=True)
    os.replace(temporary, path)


_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def describe(run: RunAnnouncement, now: float, announcers: int = 1) -> list[str]:
    """The lines printed for one run (``announcers``: how many peers announce its ``run_id``).
    Control characters in the announcement (terminal escapes) are printed as ``?``."""
    run = RunAnnouncement(
        **{
            key: _CONTROL.sub("?", value) if isinstance(value, str) else value
            for key, value in (run.to_dict() | {"announcer": run.announcer}).items()
        }
    )
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
    trust = RunTrust(load_known_runs(args.known_runs))
    verdicts = trust.classify(runs)
    if args.known_runs is not None:
        save_known_runs(args.known_runs, trust.pins())
    now = get_dht_time()
    announcers = Counter(run.run_id for run in runs)
    for run, verdict in verdicts:
        lines = describe(run, now, announcers[run.run_id])
        lines.insert(2, describe_trust(run, verdict, trust.pinned(run.run_id)))
        print("\n".join(lines), file=out, flush=True)
    return 0


def run(args) -> int:
    if not args.initial_peers:
        raise SystemExit("swarmtrain runs: --initial_peers is required (a peer of the run's DHT)")
    try:
        return trio.run(list_and_print, args)
    except trio.TooSlowError:
        print(f"swarmtrain runs: no answer within {args.timeout:g} s", file=sys.stderr)
    except (P2PError, ValueError, OSError) as e:
        print(f"swarmtrain runs: {e}", file=sys.stderr)
    return 1
