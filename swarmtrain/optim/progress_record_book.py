"""The progress records of other peers that a progress core holds, by peer id (sans-IO).

Every peer publishes a :class:`LocalProgress` under its own peer id (the subkey of a per-peer
record, signed with the identity key behind that id: the tracker passes on only records whose
signature it verified, keyed by that peer id). One peer id is one record and one vote: a record
whose ``peer_id`` field is not the id it is stored under is refused (counted in
:attr:`RecordBook.num_unbound`), so claims made under many keys for one peer count once at
most, and never for another peer. A record is versioned by its DHT expiration time: it replaces
what we hold for its owner only if it does not expire earlier. A record whose expiration passed
is stale and forgotten; a ``None`` record says its owner left the run. Our own record is never
taken from the network: the local state is always newer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from .progress_types import LocalProgress

__all__ = ["RecordBook"]


@dataclass(frozen=True)
class _Record:
    progress: LocalProgress | None  # None: the peer left
    expiration_time: float


class RecordBook:
    """The other peers' records (see the module docstring).

    :param local_key: this peer's id: records under it are refused
    """

    def __init__(self, local_key: bytes):
        self.local_key = local_key
        self._records: dict[bytes, _Record] = {}
        self._num_merged = self._num_unbound = 0

    @property
    def num_merged(self) -> int:
        """Records that replaced an older one we held (or came first)."""
        return self._num_merged

    @property
    def num_unbound(self) -> int:
        """Records refused because their ``peer_id`` field was not the id they came under."""
        return self._num_unbound

    def refuses(
        self, key: bytes, progress: LocalProgress | None, expiration_time: float, now: float
    ) -> bool:
        """Whether the record ``progress`` under ``key``, expiring at ``expiration_time``, is
        not to be held: ours, unbound, stale, older than or the same as the one held."""
        if key == self.local_key or not math.isfinite(expiration_time):
            return True
        if progress is not None and progress.peer_id != key:
            self._num_unbound += 1  # it claims to be another peer than the one that signed it
            return True
        if expiration_time <= now:
            return True  # stale
        held = self._records.get(key)
        if held is not None and held.expiration_time > expiration_time:
            return True  # older than what we hold
        if held is not None and held == _Record(progress, expiration_time):
            return True
        return False

    def held(self, key: bytes) -> LocalProgress | None:
        """The record held under ``key`` (None: none, or its owner left)."""
        record = self._records.get(key)
        return record.progress if record is not None else None

    def put(self, key: bytes, progress: LocalProgress | None, expiration_time: float) -> None:
        """Hold a record that :meth:`refuses` did not refuse."""
        self._records[key] = _Record(progress, expiration_time)
        self._num_merged += 1

    def prune(self, now: float) -> None:
        """Forget the records whose expiration passed."""
        self._records = {
            key: record for key, record in self._records.items() if record.expiration_time > now
        }

    def records(self, now: float) -> Iterator[tuple[bytes, LocalProgress, float]]:
        """(peer id, record, expiration time) of the unexpired records of peers still in."""
        for key, record in self._records.items():
            if record.progress is not None and record.expiration_time > now:
                yield key, record.progress, record.expiration_time
