"""Who stored what in a node's DHT storage: per-peer quotas and a total byte budget (sans-IO).

Every record a node holds -- a regular value or one subkey of a dictionary -- is charged to the
peer that stored it (``None``: this node itself, which no quota limits). A peer over its quota
is refused; nothing already stored is evicted for it. The total byte budget is enforced by
evicting the record written longest ago, whoever wrote it: eviction never looks at the
expiration time, which the writer chooses.

Bytes of a record: its (signed) value plus its subkey. Keys are node-sized ids and not counted.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "PeerUsage",
    "StorageLedger",
    "StorageQuota",
    "StoreOutcome",
]

#: a peer's records on one node (regular values and subkeys): enough for thousands of keys
DEFAULT_MAX_RECORDS_PER_PEER = 8192
#: a peer's bytes on one node: 32 values of the largest size (1 MiB), or thousands of small ones
DEFAULT_MAX_BYTES_PER_PEER = 32 * 1024 * 1024
#: all records of one storage (and, separately, of the cache) of one node
DEFAULT_MAX_TOTAL_BYTES = 256 * 1024 * 1024

PeerT = TypeVar("PeerT", bound=Hashable)
RecordRef = tuple[Hashable, "bytes | None"]  # (key id, subkey or None for a regular value)


class StoreOutcome(enum.Enum):
    """What became of one record offered to a storage; everything but STORED is a refusal."""

    STORED = "stored"
    EXPIRED = "expired"  #: its expiration time has passed
    OUTDATED = "outdated"  #: a record with the same or a later expiration is already stored
    EXPIRATION_TOO_FAR = "expiration_too_far"  #: beyond now + the expiration horizon
    KEY_HOLDS_DICTIONARY = "key_holds_dictionary"  #: a regular value over live subkeys
    PEER_RECORD_QUOTA = "peer_record_quota"  #: the storing peer holds its quota of records
    PEER_BYTE_QUOTA = "peer_byte_quota"  #: the storing peer holds its quota of bytes
    TOO_LARGE = "too_large"  #: larger than the storage's whole byte budget
    INVALID = "invalid"  #: a record validator rejected it (decided before the storage)

    @property
    def stored(self) -> bool:
        return self is StoreOutcome.STORED


@dataclass(frozen=True)
class StorageQuota:
    """Bounds on one storage (and, separately, the cache) of a DHT node; None: unbounded.

    :param max_records_per_peer: records (regular values and subkeys) one remote peer may hold
    :param max_bytes_per_peer: bytes (signed values plus subkeys) one remote peer may hold
    :param max_total_bytes: bytes of all records; when over, the records written longest ago
      are evicted (whoever wrote them; expiration times play no part)
    """

    max_records_per_peer: int | None = DEFAULT_MAX_RECORDS_PER_PEER
    max_bytes_per_peer: int | None = DEFAULT_MAX_BYTES_PER_PEER
    max_total_bytes: int | None = DEFAULT_MAX_TOTAL_BYTES

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"StorageQuota.{name} must be a positive integer or None: {value!r}"
                )


@dataclass(frozen=True)
class PeerUsage:
    """What one peer holds in a storage."""

    records: int = 0
    bytes: int = 0


@dataclass
class _Charge(Generic[PeerT]):
    peer: PeerT | None
    nbytes: int
    expiration_time: float
    seq: int


class StorageLedger(Generic[PeerT]):
    """Charges of live records to the peers that stored them (see the module docstring).

    The storage calls :meth:`refusal` before a write, :meth:`charge` after it and
    :meth:`release` whenever a record leaves; charges also lapse at their expiration time.
    """

    def __init__(self, quota: StorageQuota | None = None):
        self.quota = quota if quota is not None else StorageQuota(None, None, None)
        self._charges: dict[RecordRef, _Charge[PeerT]] = {}  # oldest write first
        self._usage: dict[PeerT | None, list[int]] = {}  # peer -> [records, bytes]
        self._heap: list[tuple[float, int, RecordRef]] = []
        self._seq = 0
        self.total_bytes = 0

    def refusal(
        self, peer: PeerT | None, ref: RecordRef, nbytes: int, now: float
    ) -> StoreOutcome | None:
        """Why ``peer`` may not store ``nbytes`` under ``ref`` (a record of its own there is
        replaced, so it does not count), or None if it may."""
        if peer is None:
            return None
        refusal = self._refusal(peer, ref, nbytes)
        if refusal is not None:  # maybe only because of expired charges: purge, then decide
            self.purge(now)
            refusal = self._refusal(peer, ref, nbytes)
        return refusal

    def _refusal(self, peer: PeerT, ref: RecordRef, nbytes: int) -> StoreOutcome | None:
        records, used = self._usage.get(peer, (0, 0))
        previous = self._charges.get(ref)
        if previous is not None and previous.peer == peer:
            records, used = records - 1, used - previous.nbytes
        quota = self.quota
        if quota.max_records_per_peer is not None and records + 1 > quota.max_records_per_peer:
            return StoreOutcome.PEER_RECORD_QUOTA
        if quota.max_bytes_per_peer is not None and used + nbytes > quota.max_bytes_per_peer:
            return StoreOutcome.PEER_BYTE_QUOTA
        return None

    def charge(
        self, peer: PeerT | None, ref: RecordRef, nbytes: int, expiration_time: float
    ) -> None:
        """Charge ``ref`` to ``peer`` (replacing whatever was charged for it); it becomes the
        newest record."""
        self.release(ref)
        self._seq += 1
        self._charges[ref] = _Charge(peer, nbytes, expiration_time, self._seq)
        usage = self._usage.setdefault(peer, [0, 0])
        usage[0] += 1
        usage[1] += nbytes
        self.total_bytes += nbytes
        heapq.heappush(self._heap, (expiration_time, self._seq, ref))
        if len(self._heap) > 2 * len(self._charges) + 16:  # drop stale heap entries
            self._heap = [(c.expiration_time, c.seq, r) for r, c in self._charges.items()]
            heapq.heapify(self._heap)

    def release(self, ref: RecordRef) -> None:
        """Forget the charge for ``ref``, if any."""
        charge = self._charges.pop(ref, None)
        if charge is None:
            return
        usage = self._usage[charge.peer]
        usage[0] -= 1
        usage[1] -= charge.nbytes
        self.total_bytes -= charge.nbytes
        if usage[0] == 0:
            del self._usage[charge.peer]

    def purge(self, now: float) -> None:
        """Release the charges of records expired at ``now``."""
        while self._heap:
            expiration_time, seq, ref = self._heap[0]
            charge = self._charges.get(ref)
            if charge is not None and charge.seq == seq and expiration_time > now:
                break
            heapq.heappop(self._heap)
            if charge is not None and charge.seq == seq:
                self.release(ref)

    def oldest(self) -> RecordRef | None:
        """The record written longest ago (the next to evict), or None."""
        return next(iter(self._charges), None)

    def usage(self, peer: PeerT | None, now: float) -> PeerUsage:
        """What ``peer`` (None: this node) holds at ``now``."""
        self.purge(now)
        records, nbytes = self._usage.get(peer, (0, 0))
        return PeerUsage(records, nbytes)

    def num_peers(self, now: float) -> int:
        """Peers (this node included) holding at least one live record."""
        self.purge(now)
        return len(self._usage)

    def __len__(self) -> int:
        """Records charged, possibly including expired ones not yet purged."""
        return len(self._charges)
