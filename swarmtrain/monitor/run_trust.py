"""Which run announcements to trust: the first owner key seen for a ``run_id`` is pinned.

Pure (no I/O, no clock). :class:`RunTrust` holds ``{run_id: owner public key}`` pins (from
earlier listings, a ``--known_runs`` file, or the organisers' published key) and classifies
announcements (:class:`~swarmtrain.monitor.runs.RunAnnouncement`, whose owner signatures were
checked when read):

==============  ===============================================================================
verdict         when
==============  ===============================================================================
``owner``       signed by the ``run_id``'s pinned owner key
``impostor``    the ``run_id`` has a pinned owner key and this announcement is not signed by it
                (unsigned, or signed by another key)
``conflict``    no pin yet, and announcements of this ``run_id`` are signed by several keys: none
                is pinned (check the key the organisers publish)
``unsigned``    no pin and no owner key: anyone could have announced it
==============  ===============================================================================

A ``run_id`` with no pin is pinned to its owner key when exactly one key signs its
announcements ("first seen wins", like ssh's known hosts). This stops an impostor who announces
a run after it was first seen; it does not stop one who was there first, or the only one seen
(see ``docs/security.md``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .runs import RunAnnouncement

__all__ = ["CONFLICT", "IMPOSTOR", "OWNER", "UNSIGNED", "RunTrust", "check_pins"]

OWNER, IMPOSTOR, CONFLICT, UNSIGNED = "owner", "impostor", "conflict", "unsigned"
MAX_PINS = 4096  #: pins kept (the oldest pins stay; new run_ids beyond it are not pinned)
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_RUN_ID_MAX = 64


def check_pins(pins: object) -> dict[str, str]:
    """``pins`` (e.g. loaded from JSON) as ``{run_id: owner key}``; ``ValueError`` if it is not
    such a mapping of valid keys."""
    if not isinstance(pins, Mapping):
        raise ValueError("known runs must be a mapping of run ids to owner keys")
    checked = {}
    for run_id, key in pins.items():
        if not (isinstance(run_id, str) and 0 < len(run_id) <= _RUN_ID_MAX):
            raise ValueError(f"not a run id: {run_id!r}")
        if not (isinstance(key, str) and _KEY_RE.match(key)):
            raise ValueError(f"not an owner key (64 hex digits) for {run_id!r}: {key!r}")
        checked[run_id] = key
    if len(checked) > MAX_PINS:
        raise ValueError(f"at most {MAX_PINS} known runs")
    return checked


class RunTrust:
    """Pins and verdicts (see the module docstring)."""

    def __init__(self, pins: Mapping[str, str] | None = None):
        self._pins = check_pins(pins or {})

    def pins(self) -> dict[str, str]:
        """``{run_id: owner key}`` pinned so far (save it to keep them)."""
        return dict(self._pins)

    def pinned(self, run_id: str) -> str | None:
        return self._pins.get(run_id)

    def classify(
        self, announcements: Iterable[RunAnnouncement]
    ) -> list[tuple[RunAnnouncement, str]]:
        """Each announcement with its verdict, in the given order; pins the owner key of each
        unpinned ``run_id`` that exactly one key signs."""
        listed = [(a, a.owner_key if a.signed else "") for a in announcements]
        keys: dict[str, set[str]] = {}
        for announcement, key in listed:
            if key:
                keys.setdefault(announcement.run_id, set()).add(key)
        for run_id, run_keys in keys.items():
            if run_id not in self._pins and len(run_keys) == 1 and len(self._pins) < MAX_PINS:
                (self._pins[run_id],) = run_keys
        verdicts = []
        for announcement, key in listed:
            pin = self._pins.get(announcement.run_id)
            if pin is not None:
                verdict = OWNER if key == pin else IMPOSTOR
            elif announcement.run_id in keys:
                verdict = CONFLICT
            else:
                verdict = UNSIGNED
            verdicts.append((announcement, verdict))
        return verdicts
