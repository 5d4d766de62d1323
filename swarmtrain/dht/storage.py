"""Expiring local storage of DHT records (sans-IO: every method takes ``now`` explicitly).

Expiration times are absolute DHT times (:func:`get_dht_time`, seconds since the epoch). A
record is live while ``now < expiration_time``. Clock skew: peers compare expirations made on
different clocks, so a peer whose clock runs ``d`` seconds ahead drops records ``d`` seconds
early and the "newer" of two writes is decided by the writers' clocks. Keep clocks in sync (NTP,
well under a second in practice) and choose expirations much longer than the expected skew.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgpack

from .identifiers import DHTID
from .serialization import MAX_VALUE_ELEMENTS, deserialize

__all__ = [
    "CacheRefreshQueue",
    "DHTExpiration",
    "DHTLocalStorage",
    "DictionaryDHTValue",
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
    """A dict whose entries expire; at most ``maxsize`` entries, evicting the soonest-expiring.

    Expired entries are purged lazily (on access) using a heap of expirations.
    """

    def __init__(self, maxsize: int | None = None):
        if maxsize is not None and maxsize < 1:
            raise ValueError(f"maxsize must be positive or None, got {maxsize}")
        self.maxsize = maxsize
        self._data: dict[KeyT, tuple[ValueWithExpiration[ValueT], int]] = {}
        self._heap: list[tuple[DHTExpiration, int, KeyT]] = []  # (expiration, seq, key)
        self._seq = 0

    def store(self, key: KeyT, value: ValueT, expiration_time: DHTExpiration, now: float) -> bool:
        """Store unless expired or an entry with the same or later expiration exists.

        :returns: whether ``value`` is stored after the call (it may be evicted at once if the
          storage is full and it expires soonest)
        """
        if expiration_time <= now:
            return False
        previous = self._data.get(key)
        if previous is not None and previous[0].expiration_time >= expiration_time:
            return False
        self._put(key, ValueWithExpiration(value, expiration_time))
        self._purge(now)
        return key in self._data

    def _put(self, key: KeyT, item: ValueWithExpiration[ValueT]) -> None:
        self._seq += 1
        self._data[key] = (item, self._seq)
        heapq.heappush(self._heap, (item.expiration_time, self._seq, key))
        if len(self._heap) > 2 * len(self._data) + 16:  # drop stale heap entries
            self._heap = [(it.expiration_time, seq, k) for k, (it, seq) in self._data.items()]
            heapq.heapify(self._heap)

    def _purge(self, now: float) -> None:
        while self._heap:
            expiration_time, seq, key = self._heap[0]
            entry = self._data.get(key)
            if entry is None or entry[1] != seq:
                heapq.heappop(self._heap)  # stale: overwritten or deleted
            elif expiration_time <= now or (
                self.maxsize is not None and len(self._data) > self.maxsize
            ):
                heapq.heappop(self._heap)
                del self._data[key]
            else:
                break

    def get(self, key: KeyT, now: float) -> ValueWithExpiration[ValueT] | None:
        """The live entry for ``key``, or None."""
        self._purge(now)
        entry = self._data.get(key)
        return entry[0] if entry is not None else None

    def items(self, now: float) -> list[tuple[KeyT, ValueWithExpiration[ValueT]]]:
        """A snapshot of all live entries, in insertion order."""
        self._purge(now)
        return [(key, item) for key, (item, _) in self._data.items()]

    def top(self, now: float) -> tuple[KeyT, ValueWithExpiration[ValueT]] | None:
        """The live entry that expires first, or None if empty."""
        self._purge(now)
        if not self._data:
            return None
        _, _, key = self._heap[0]
        return key, self._data[key][0]

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
    """

    def __init__(self, maxsize: int | None = None):
        super().__init__(maxsize)
        self.latest_expiration_time: DHTExpiration = float("-inf")

    def store(self, key: bytes, value: bytes, expiration_time: DHTExpiration, now: float) -> bool:
        """Store one subkey; the later expiration wins (see :meth:`TimedStorage.store`)."""
        stored = super().store(key, value, expiration_time, now)
        if stored:
            self.latest_expiration_time = max(self.latest_expiration_time, expiration_time)
        return stored

    def copy(self) -> DictionaryDHTValue:
        """A shallow copy with the same entries and expiration."""
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


class DHTLocalStorage(TimedStorage[DHTID, bytes | DictionaryDHTValue]):
    """Records this node holds: key id -> serialized value, or a :class:`DictionaryDHTValue`.

    A regular value replaces whatever is stored if its expiration is later. A subkey write merges
    into the key's dictionary (each subkey keeps the later of its expirations) and replaces a
    regular value only if the subkey expires later than it. :meth:`get` returns dictionaries
    live (they change with later writes); use :meth:`get_copy` to keep one across awaits.

    :param maxsize: at most this many keys (the soonest-expiring are evicted)
    :param max_subkeys: at most this many subkeys per dictionary value (same eviction rule)
    """

    def __init__(self, maxsize: int | None = None, max_subkeys: int | None = None):
        super().__init__(maxsize)
        if max_subkeys is not None and max_subkeys < 1:
            raise ValueError(f"max_subkeys must be positive or None, got {max_subkeys}")
        self.max_subkeys = max_subkeys

    def store(  # type: ignore[override]
        self,
        key: DHTID,
        value: bytes,
        expiration_time: DHTExpiration,
        now: float,
        subkey: bytes | None = None,
    ) -> bool:
        """Store a serialized value (or one serialized subkey of a dictionary value).

        :returns: True if the value was stored, False if it was rejected (expired or older)
        """
        if not isinstance(value, bytes):
            raise TypeError(f"serialized values must be bytes, got {type(value).__name__}")
        if subkey is None:
            return super().store(key, value, expiration_time, now)
        if expiration_time <= now:
            return False
        previous = self.get(key, now)
        if previous is not None and isinstance(previous.value, DictionaryDHTValue):
            dictionary = previous.value
            if not dictionary.store(subkey, value, expiration_time, now):
                return False
            if dictionary.latest_expiration_time > previous.expiration_time:
                self._put(key, ValueWithExpiration(dictionary, dictionary.latest_expiration_time))
                self._purge(now)
            return key in self._data
        if previous is not None and previous.expiration_time >= expiration_time:
            return False  # a regular value that outlives this subkey
        dictionary = DictionaryDHTValue(self.max_subkeys)
        dictionary.store(subkey, value, expiration_time, now)
        return super().store(key, dictionary, expiration_time, now)

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
