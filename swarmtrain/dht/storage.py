"""Expiring local storage of DHT records (sans-IO: every method takes ``now`` explicitly).

Expiration times are absolute DHT times (:func:`get_dht_time`, seconds since the epoch). A
record is live while ``now < expiration_time``. When a storage is full, it evicts what was
written longest ago, never by expiration time: writers choose their expirations, so an
eviction rule that kept far-future records would keep an attacker's.

Clock skew: peers compare expirations made on different clocks, so a peer whose clock runs
``d`` seconds ahead drops records ``d`` seconds early and the "newer" of two writes is decided
by the writers' clocks. Keep clocks in sync (NTP, well under a second in practice) and choose
expirations much longer than the expected skew.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import msgpack

from .identifiers import DHTID
from .serialization import MAX_VALUE_ELEMENTS, deserialize
from .storage_quota import PeerUsage, StorageLedger, StorageQuota, StoreOutcome

__all__ = [
    "CacheRefreshQueue",
    "DHTExpiration",
    "DHTLocalStorage",
    "DictionaryDHTValue",
    "StorageStatistics",
    "TimedStorage",
    "ValueWithExpiration",
    "get_dht_time",
]

DHTExpiration = float
#: a packed dictionary from a peer (:meth:`DictionaryDHTValue.unpackb`) holds at most
#: ``MAX_VALUE_ELEMENTS`` subkeys: 3 objects, then 4 per subkey
MAX_PACKED_ELEMENTS = 3 + 4 * MAX_VALUE_ELEMENTS
KeyT = TypeVar("KeyT", bound=Hashable)
ValueT = TypeVar("ValueT")


def get_dht_time() -> DHTExpiration:
    """Current DHT time: wall-clock seconds since the epoch (the only clock the DHT reads)."""
    return time.time()


@dataclass(frozen=True)
class ValueWithExpiration(Generic[ValueT]):
    """A value and the DHT time until which it stays valid; unpacks as ``value, expiration``."""

    value: ValueT
    expiration_time: DHTExpiration

    def __iter__(self) -> Iterator[object]:
        return iter((self.value, self.expiration_time))

    def __getitem__(self, index: int | slice) -> object:
        """``found[0]`` is the value, ``found[1]`` the expiration time (hivemind's tuple)."""
        return (self.value, self.expiration_time)[index]


class TimedStorage(Generic[KeyT, ValueT]):
    """A dict whose entries expire; at most ``maxsize`` entries, evicting the one written
    longest ago (a rewrite counts as a new write).

    Expired entries are purged lazily (on access) using a heap of expirations.
    """

    def __init__(self, maxsize: int | None = None):
        if maxsize is not None and maxsize < 1:
            raise ValueError(f"maxsize must be positive or None, got {maxsize}")
        self.maxsize = maxsize
        self._data: dict[KeyT, tuple[ValueWithExpiration[ValueT], int]] = {}  # oldest write first
        self._heap: list[tuple[DHTExpiration, int, KeyT]] = []  # (expiration, seq, key)
        self._seq = 0

    def store(self, key: KeyT, value: ValueT, expiration_time: DHTExpiration, now: float) -> bool:
        """Store unless expired or an entry with the same or later expiration exists.

        :returns: whether ``value`` was stored (a full storage evicts its oldest write instead)
        """
        if expiration_time <= now:
            return False
        previous = self._data.get(key)
        if previous is not None and previous[0].expiration_time >= expiration_time:
            return False
        self._put(key, ValueWithExpiration(value, expiration_time))
        self._purge(now)
        return True

    def _put(self, key: KeyT, item: ValueWithExpiration[ValueT]) -> None:
        self._seq += 1
        self._data.pop(key, None)  # a rewrite becomes the newest entry
        self._data[key] = (item, self._seq)
        heapq.heappush(self._heap, (item.expiration_time, self._seq, key))
        if len(self._heap) > 2 * len(self._data) + 16:  # drop stale heap entries
            self._heap = [(it.expiration_time, seq, k) for k, (it, seq) in self._data.items()]
            heapq.heapify(self._heap)

    def _touch(self, key: KeyT) -> None:
        """Make ``key``'s entry the newest write without changing it."""
        self._data[key] = self._data.pop(key)

    def _on_remove(self, key: KeyT, item: ValueWithExpiration[ValueT]) -> None:
        """Called for each entry that expires or is evicted (subclasses keep accounts)."""

    def _purge(self, now: float) -> None:
        while self._heap:
            expiration_time, seq, key = self._heap[0]
            entry = self._data.get(key)
            if entry is not None and entry[1] == seq and expiration_time > now:
                break
            heapq.heappop(self._heap)
            if entry is not None and entry[1] == seq:  # else stale: overwritten or deleted
                del self._data[key]
                self._on_remove(key, entry[0])
        if self.maxsize is not None:
            while len(self._data) > self.maxsize:
                key = next(iter(self._data))
                item, _ = self._data.pop(key)
                self._on_remove(key, item)

    def get(self, key: KeyT, now: float) -> ValueWithExpiration[ValueT] | None:
        """The live entry for ``key``, or None."""
        self._purge(now)
        entry = self._data.get(key)
        return entry[0] if entry is not None else None

    def items(self, now: float) -> list[tuple[KeyT, ValueWithExpiration[ValueT]]]:
        """A snapshot of all live entries, oldest write first."""
        self._purge(now)
        return [(key, item) for key, (item, _) in self._data.items()]

    def top(self, now: float) -> tuple[KeyT, ValueWithExpiration[ValueT]] | None:
        """The live entry that expires first, or None if empty."""
        self._purge(now)
        while self._heap:
            _, seq, key = self._heap[0]
            entry = self._data.get(key)
            if entry is not None and entry[1] == seq:
                return key, entry[0]
            heapq.heappop(self._heap)  # stale: evicted, overwritten or deleted
        return None

    def pop(self, key: KeyT) -> ValueWithExpiration[ValueT] | None:
        """Remove and return an entry (expired or not); None if absent."""
        entry = self._data.pop(key, None)
        return entry[0] if entry is not None else None

    def purge(self, now: float) -> None:
        """Drop expired entries now (otherwise done lazily)."""
        self._purge(now)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has an entry, possibly expired (call :meth:`purge` first to exclude)."""
        return key in self._data

    def __len__(self) -> int:
        """Number of entries, possibly including expired ones not yet purged."""
        return len(self._data)


class DictionaryDHTValue(TimedStorage[bytes, bytes]):
    """A dictionary DHT value: serialized subkey -> serialized value, each with its own expiration.

    Its own expiration, :attr:`latest_expiration_time`, is the latest of all subkeys ever stored.

    :param on_remove: called with each subkey that expires or is evicted (``max_subkeys``)
    """

    def __init__(
        self, maxsize: int | None = None, on_remove: Callable[[bytes], None] | None = None
    ):
        super().__init__(maxsize)
        self.latest_expiration_time: DHTExpiration = float("-inf")
        self._on_remove_subkey = on_remove

    def store(self, key: bytes, value: bytes, expiration_time: DHTExpiration, now: float) -> bool:
        """Store one subkey; the later expiration wins (see :meth:`TimedStorage.store`)."""
        stored = super().store(key, value, expiration_time, now)
        if stored:
            self.latest_expiration_time = max(self.latest_expiration_time, expiration_time)
        return stored

    def _on_remove(self, key: bytes, item: ValueWithExpiration[bytes]) -> None:
        if self._on_remove_subkey is not None:
            self._on_remove_subkey(key)

    def copy(self) -> DictionaryDHTValue:
        """A shallow copy with the same entries and expiration (and no ``on_remove``)."""
        new = DictionaryDHTValue(self.maxsize)
        for key, (item, _) in self._data.items():
            new._put(key, item)
        new.latest_expiration_time = self.latest_expiration_time
        return new

    def packb(self, now: float) -> bytes:
        """Msgpack of live subkeys: ``[latest_expiration, [[subkey, value, expiration], ...]]``."""
        items = [[k, it.value, it.expiration_time] for k, it in self.items(now)]
        return msgpack.packb([self.latest_expiration_time, items], use_bin_type=True)

    @classmethod
    def unpackb(cls, raw: bytes, now: float) -> DictionaryDHTValue:
        """Inverse of :meth:`packb`; subkeys already expired at ``now`` are skipped."""
        try:
            latest, items = deserialize(raw, max_size=None, max_elements=MAX_PACKED_ELEMENTS)
            new = cls()
            for key, value, expiration_time in items:
                if not isinstance(key, bytes) or not isinstance(value, bytes):
                    raise TypeError("subkeys and values must be bytes")
                new.store(key, value, _finite(expiration_time), now)
            new.latest_expiration_time = max(new.latest_expiration_time, _finite(latest))
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed packed DictionaryDHTValue: {e!r}") from e
        return new

    def __repr__(self) -> str:
        return f"DictionaryDHTValue({len(self)} subkeys, expires={self.latest_expiration_time})"


def _finite(expiration_time: object) -> float:
    """An expiration time from a peer (a NaN one would never expire and stop the purge)."""
    value = float(expiration_time)  # type: ignore[arg-type]
    if not math.isfinite(value):
        raise ValueError(f"expiration time {value} is not finite")
    return value


@dataclass(frozen=True)
class StorageStatistics:
    """A snapshot of a :class:`DHTLocalStorage`."""

    num_keys: int
    num_records: int  #: regular values plus subkeys
    num_bytes: int  #: signed values plus subkeys
    num_peers: int  #: peers (this node included) holding a record


class DHTLocalStorage(TimedStorage[DHTID, bytes | DictionaryDHTValue]):
    """Records this node holds: key id -> serialized value, or a :class:`DictionaryDHTValue`.

    A regular value replaces a regular value that expires sooner. A subkey write merges into
    the key's dictionary (each subkey keeps the later of its expirations) and replaces a
    regular value whatever their expirations; a regular value is refused while the key holds
    live subkeys (``KEY_HOLDS_DICTIONARY``). A dictionary collects many writers' records, so one
    writer's regular value must not erase them (hivemind lets the later expiration decide).
    :meth:`get` returns dictionaries live (they change with later writes); use
    :meth:`get_copy` to keep one across awaits.

    Every record (regular value or subkey) is charged to the peer that stored it
    (:class:`~swarmtrain.dht.storage_quota.StorageLedger`); a peer over its ``quota`` is refused.
    Full storages evict the oldest writes: keys beyond ``maxsize``, subkeys beyond
    ``max_subkeys``, records beyond ``quota.max_total_bytes``.

    :param maxsize: at most this many keys
    :param max_subkeys: at most this many subkeys per dictionary value
    :param quota: per-peer quotas and the total byte budget (default: none)
    :param expiration_horizon: refuse records expiring more than this many seconds after
      ``now`` (``EXPIRATION_TOO_FAR``; None: no limit)
    """

    def __init__(
        self,
        maxsize: int | None = None,
        max_subkeys: int | None = None,
        *,
        quota: StorageQuota | None = None,
        expiration_horizon: float | None = None,
    ):
        super().__init__(maxsize)
        if max_subkeys is not None and max_subkeys < 1:
            raise ValueError(f"max_subkeys must be positive or None, got {max_subkeys}")
        if expiration_horizon is not None and not expiration_horizon > 0:
            raise ValueError(f"expiration_horizon must be positive or None: {expiration_horizon}")
        self.max_subkeys = max_subkeys
        self.expiration_horizon = expiration_horizon
        self.ledger: StorageLedger[Hashable] = StorageLedger(quota)

    def store(  # type: ignore[override]
        self,
        key: DHTID,
        value: bytes,
        expiration_time: DHTExpiration,
        now: float,
        subkey: bytes | None = None,
        peer: Hashable | None = None,
    ) -> bool:
        """Store a serialized value (or one serialized subkey of a dictionary value).

        :returns: whether it was stored (see :meth:`store_record` for why not)
        """
        return self.store_record(key, value, expiration_time, now, subkey, peer).stored

    def store_record(
        self,
        key: DHTID,
        value: bytes,
        expiration_time: DHTExpiration,
        now: float,
        subkey: bytes | None = None,
        peer: Hashable | None = None,
    ) -> StoreOutcome:
        """Store a serialized value (or one subkey) on behalf of ``peer`` (None: this node).

        :returns: ``STORED``, or why not; a refusal changes nothing
        """
        if not isinstance(value, bytes):
            raise TypeError(f"serialized values must be bytes, got {type(value).__name__}")
        if expiration_time <= now:
            return StoreOutcome.EXPIRED
        if self.expiration_horizon is not None and expiration_time > now + self.expiration_horizon:
            return StoreOutcome.EXPIRATION_TOO_FAR
        nbytes = len(value) + (len(subkey) if subkey is not None else 0)
        budget = self.ledger.quota.max_total_bytes
        if budget is not None and nbytes > budget:
            return StoreOutcome.TOO_LARGE
        previous = self.get(key, now)
        dictionary = (
            previous.value
            if previous is not None and isinstance(previous.value, DictionaryDHTValue)
            else None
        )
        if subkey is None:
            if dictionary is not None:
                dictionary.purge(now)
                if len(dictionary) > 0:
                    return StoreOutcome.KEY_HOLDS_DICTIONARY
            if dictionary is None and previous is not None:
                if previous.expiration_time >= expiration_time:
                    return StoreOutcome.OUTDATED
        elif dictionary is not None:
            existing = dictionary._data.get(subkey)  # an expired one expires before this
            if existing is not None and existing[0].expiration_time >= expiration_time:
                return StoreOutcome.OUTDATED
        refusal = self.ledger.refusal(peer, (key, subkey), nbytes, now)
        if refusal is not None:
            return refusal

        if subkey is None:
            if dictionary is not None and previous is not None:  # an empty one: all evicted
                self._release(key, previous)
            self._put(key, ValueWithExpiration(value, expiration_time))
        else:
            if dictionary is None:
                if previous is not None:
                    self._release(key, previous)  # a regular value gives way to subkeys
                dictionary = DictionaryDHTValue(
                    self.max_subkeys, on_remove=lambda sub: self.ledger.release((key, sub))
                )
            dictionary.store(subkey, value, expiration_time, now)
            if previous is not None and previous.value is dictionary:
                if expiration_time > previous.expiration_time:
                    self._put(key, ValueWithExpiration(dictionary, expiration_time))
                else:
                    self._touch(key)  # the newest write, for eviction; same expiration
            else:
                self._put(key, ValueWithExpiration(dictionary, expiration_time))
        self.ledger.charge(peer, (key, subkey), nbytes, expiration_time)
        if self.maxsize is not None and len(self._data) > self.maxsize:
            self._purge(now)  # expired entries were purged by get() above
        self._evict_over_budget()
        return StoreOutcome.STORED

    def _release(self, key: DHTID, item: ValueWithExpiration[bytes | DictionaryDHTValue]) -> None:
        if isinstance(item.value, DictionaryDHTValue):
            for subkey in list(item.value._data):
                self.ledger.release((key, subkey))
        else:
            self.ledger.release((key, None))

    def _on_remove(self, key: DHTID, item: ValueWithExpiration[bytes | DictionaryDHTValue]) -> None:
        self._release(key, item)

    def _evict_over_budget(self) -> None:
        """Evict the oldest records while the total byte budget is exceeded."""
        budget = self.ledger.quota.max_total_bytes
        while budget is not None and self.ledger.total_bytes > budget:
            ref = self.ledger.oldest()
            assert ref is not None  # total_bytes > 0
            key_hashable, subkey = ref
            key = cast(DHTID, key_hashable)  # the ledger holds this storage's keys
            self.ledger.release(ref)
            entry = self._data.get(key)
            if entry is None:
                continue
            if subkey is None and not isinstance(entry[0].value, DictionaryDHTValue):
                self.pop(key)
            elif subkey is not None and isinstance(entry[0].value, DictionaryDHTValue):
                entry[0].value.pop(subkey)
                if len(entry[0].value) == 0:
                    self.pop(key)

    def usage(self, peer: Hashable | None, now: float) -> PeerUsage:
        """Records and bytes that ``peer`` (None: this node) holds here at ``now``."""
        return self.ledger.usage(peer, now)

    def statistics(self, now: float) -> StorageStatistics:
        """Keys, records, bytes and storing peers at ``now``."""
        self._purge(now)
        self.ledger.purge(now)
        return StorageStatistics(
            num_keys=len(self),
            num_records=len(self.ledger),
            num_bytes=self.ledger.total_bytes,
            num_peers=self.ledger.num_peers(now),
        )

    def get_copy(
        self, key: DHTID, now: float
    ) -> ValueWithExpiration[bytes | DictionaryDHTValue] | None:
        """Like :meth:`get`, but a dictionary value is a snapshot safe to keep across awaits."""
        found = self.get(key, now)
        if found is not None and isinstance(found.value, DictionaryDHTValue):
            return ValueWithExpiration(found.value.copy(), found.expiration_time)
        return found


class CacheRefreshQueue(TimedStorage[DHTID, None]):
    """Cached keys due for a refresh, ordered by their cached value's expiration."""

    def pop_due(self, now: float, lead_time: float) -> list[DHTID]:
        """Remove and return keys expiring within ``lead_time`` seconds after ``now``."""
        due = []
        while (entry := self.top(now)) is not None and entry[1].expiration_time <= now + lead_time:
            self.pop(entry[0])
            due.append(entry[0])
        return due
