"""Which progress records come from peers that could not be reached (sans-IO).

A peer that is killed (SIGKILL, a crash, a lost machine) never withdraws its progress record:
the record stays in the DHT for up to ``metadata_expiration`` seconds and claims an epoch
nobody trains at any more. A rerun of the same ``run_id`` within that minute believed the swarm
was at the dead run's epoch, tried to load the state from peers that were gone, and waited for
the records to expire (~60 s before its first epoch).

So the tracker dials the owner of every record that would move this peer (a non-client record
at an epoch ahead of ours), at most once per record key while it answers, within a short
deadline. A record whose owner could not be dialled is ignored until the owner stores a newer
one (a later expiration time): a live peer re-stores its record after every report and every
``metadata_expiration / 2``, a dead one never does. A key whose owner failed is dialled again
no sooner than ``retry_period`` later, so a live peer that we cannot dial (a firewall) counts
most of the time, and a dead one costs one short dial per ``retry_period``.

A probe that could not even be tried (no known address for the owner: the DHT nodes we asked
did not name it, e.g. because they dropped it from their routing tables) is weaker evidence: in
a large swarm a newcomer knows the addresses of only some peers. Such a record counts while
some other owner was reached (the swarm we join is alive, so we give its other records the
benefit of the doubt) and is ignored when no owner could be reached at all (a killed run: all
its peers are gone), until it is stored again, like a failed one.

Everything is keyed by the record key. Progress records and DiLoCo presence records are
per-peer records (``swarmtrain.dht.peer_records``): the key is the peer id whose identity key
signed the record, and that is the peer id dialled; a confirmation holds for that key and that
peer id only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

__all__ = ["OwnerLiveness", "Probe", "ProbeOutcome"]


class ProbeOutcome(enum.Enum):
    REACHABLE = "reachable"  #: a connection to the owner is open
    UNREACHABLE = "unreachable"  #: the dial failed or ran past its deadline
    UNKNOWN = "unknown"  #: the dial could not be tried (no known address)


@dataclass(frozen=True)
class Probe:
    """Dial ``peer_id``, the owner of the record under ``key`` that expires at ``version``."""

    key: bytes
    peer_id: bytes
    version: float


@dataclass(frozen=True)
class OwnerCandidate:
    """A record whose owner may be probed: one that would steer us (the caller decides)."""

    key: bytes
    peer_id: bytes
    expiration_time: float


class OwnerLiveness:
    """Probe decisions and their results (see the module docstring).

    :param retry_period: seconds before a key whose owner failed (or could not be dialled) is
      probed again
    """

    def __init__(self, retry_period: float):
        if not (retry_period > 0 and math.isfinite(retry_period)):
            raise ValueError(f"retry_period must be positive and finite, got {retry_period!r}")
        self.retry_period = retry_period
        self._confirmed: dict[bytes, bytes] = {}  # key -> the peer id that answered
        self._failed_version: dict[bytes, float] = {}  # key -> newest version whose dial failed
        self._unknown_version: dict[bytes, float] = {}  # ... that could not be dialled at all
        self._retry_at: dict[bytes, float] = {}
        self._probing: set[bytes] = set()
        self.probes_started = 0
        self.unreachable_found = 0

    def counts(self, key: bytes, expiration_time: float) -> bool:
        """Whether a record under ``key`` expiring at ``expiration_time`` is taken into account
        (False: its owner failed a dial and has stored nothing newer since)."""
        failed = self._failed_version.get(key)
        if failed is not None and expiration_time <= failed:
            return False
        unknown = self._unknown_version.get(key)
        return unknown is None or expiration_time > unknown or bool(self._confirmed)

    def ignored(self) -> int:
        """Keys whose records are ignored now (their owner failed and stored nothing newer)."""
        return len(self._failed_version) + (0 if self._confirmed else len(self._unknown_version))

    def due(self, candidates: Iterable[OwnerCandidate], now: float) -> list[Probe]:
        """The probes to start now; each is in flight until :meth:`on_result` is called."""
        return list(self._due(candidates, now))

    def _due(self, candidates: Iterable[OwnerCandidate], now: float) -> Iterator[Probe]:
        for c in candidates:
            if self._confirmed.get(c.key) == c.peer_id or c.key in self._probing:
                continue
            if c.key in self._failed_version and not self.counts(c.key, c.expiration_time):
                continue  # already ignored until it stores a newer record
            if now < self._retry_at.get(c.key, -math.inf):
                continue
            self._probing.add(c.key)
            self.probes_started += 1
            yield Probe(c.key, c.peer_id, c.expiration_time)

    def on_result(self, probe: Probe, outcome: ProbeOutcome, now: float) -> bool:
        """Record a probe's outcome; returns whether the set of counted records may change."""
        self._probing.discard(probe.key)
        key = probe.key
        if outcome is ProbeOutcome.REACHABLE:
            first = not self._confirmed
            self._confirmed[key] = probe.peer_id
            self._retry_at.pop(key, None)
            self._unknown_version.pop(key, None)
            had_failed = self._failed_version.pop(key, None) is not None
            return had_failed or (first and bool(self._unknown_version))
        self._retry_at[key] = now + self.retry_period
        lost_confirmation = self._confirmed.pop(key, None) is not None and not self._confirmed
        if outcome is ProbeOutcome.UNKNOWN:
            self._unknown_version[key] = max(
                probe.version, self._unknown_version.get(key, -math.inf)
            )
            return lost_confirmation or not self._confirmed
        self.unreachable_found += 1
        self._failed_version[key] = max(probe.version, self._failed_version.get(key, -math.inf))
        self._unknown_version.pop(key, None)
        return True

    def abandon(self, probe: Probe) -> None:
        """A probe that could not run (our side failed): no verdict, tried again when due."""
        self._probing.discard(probe.key)

    def prune(self, live: Mapping[bytes, float]) -> None:
        """Forget keys that have no record any more (``live``: key -> expiration time); a
        failed mark is dropped once its owner stored a newer record."""
        for book in (self._confirmed, self._retry_at):
            for key in [k for k in book if k not in live]:
                del book[key]
        for book in (self._failed_version, self._unknown_version):
            for key, marked in list(book.items()):
                expiration = live.get(key)
                if expiration is None or expiration > marked:
                    del book[key]
