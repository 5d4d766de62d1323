"""One flag style for the ``swarmtrain`` command: hivemind's underscores (``--initial_peers``),
with the dash spelling (``--initial-peers``) accepted as an alias, so both forms work."""

from __future__ import annotations

import argparse
from typing import Any


def add_option(parser: argparse.ArgumentParser | Any, name: str, **kwargs: Any) -> None:
    """``parser.add_argument("--a_b", **kwargs)``, plus ``--a-b`` for the same destination (not
    listed in ``--help``)."""
    if not name.startswith("--"):
        raise ValueError(f"option names start with '--', got {name!r}")
    underscored = "--" + name[2:].replace("-", "_")
    dashed = "--" + name[2:].replace("_", "-")
    action = parser.add_argument(underscored, **kwargs)
    if dashed != underscored:
        alias = {k: v for k, v in kwargs.items() if k != "help"}
        parser.add_argument(dashed, dest=action.dest, help=argparse.SUPPRESS, **alias)
