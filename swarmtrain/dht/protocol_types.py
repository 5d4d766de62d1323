"""The records and limits of the DHT RPCs (:mod:`swarmtrain.dht.protocol`): size limits, the
errors a malformed request raises, the items stored and found, and how two answers merge."""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.p2p import PeerID

from .identifiers import DHTID
from .serialization import MAX_VALUE_SIZE
from .storage import DictionaryDHTValue, ValueWithExpiration

__all__ = [
    "EXPIRATION_CLOCK_ALLOWANCE",
    "DHTProtocolLimits",
    "FindResult",
    "FoundValue",
    "MalformedRequestError",
    "NodeIdMismatchError",
    "StoreItem",
    "merge_found_values",
    "parse_dht_id",
]

#: seconds a record from a peer may expire beyond now + the horizon: the writer's clock may run
#: ahead of ours (its own store is capped at its now + the horizon)
EXPIRATION_CLOCK_ALLOWANCE = 10.0
#: records with more value bytes than this (a store request, a found value) are validated in a
#: worker thread (``DHTProtocol.validation_limiter``); below it, the bounded decoder
#: (``dht.serialization``) keeps the work on the loop to a few ms (a signed record costs ~0.15
#: ms to check: a dictionary of 2,000 peers' records held the loop 0.3 s per answer)
INLINE_VALIDATION_BYTES = 16 * 1024

FoundValue = ValueWithExpiration[bytes | DictionaryDHTValue]


class MalformedRequestError(ValueError):
    """A DHT request broke a size limit or carried undecodable data; nothing was changed."""


class NodeIdMismatchError(MalformedRequestError):
    """A peer announced a node id that is not ``DHTID.from_peer_id`` of its peer id."""


@dataclass(frozen=True)
class DHTProtocolLimits:
    """Size limits on what a node accepts (and sends); every field must be positive."""

    max_items: int = 256  #: keys per store or find request
    max_key_size: int = 4096  #: bytes of one serialized key
    max_subkey_size: int = 4096  #: bytes of one serialized subkey
    max_value_size: int = MAX_VALUE_SIZE  #: bytes of one serialized value, signatures excluded
    max_signature_size: int = 1024  #: bytes validators may append to a value
    max_maddrs: int = 16  #: addresses per peer
    max_maddr_length: int = 512  #: characters of one address
    max_nearest_peers: int = 64  #: nearest peers per key in a find response
    max_message_size: int = 8 * 1024 * 1024  #: bytes of one request or response

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DHTProtocolLimits.{name} must be a positive integer: {value!r}")

    @property
    def max_signed_value_size(self) -> int:
        return self.max_value_size + self.max_signature_size


@dataclass(frozen=True)
class StoreItem:
    """One record to store: serialized key, subkey (or None) and signed value."""

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration_time: float

    @property
    def key_id(self) -> DHTID:
        return DHTID.from_serialized_key(self.key)


@dataclass(frozen=True)
class FindResult:
    """A peer's answer about one key: what it holds (not yet validated) and nearer peers."""

    value: FoundValue | None
    nearest: dict[DHTID, PeerID]  # nearest first


def merge_found_values(a: FoundValue | None, b: FoundValue | None, now: float) -> FoundValue | None:
    """Combine two answers: dictionaries are merged per subkey, a dictionary wins over a regular
    value (as in :class:`DHTLocalStorage`), and of two regular values the later one wins.

    Neither argument is modified.
    """
    if a is None or b is None:
        return a if b is None else b
    a_value, b_value = a.value, b.value
    a_dict, b_dict = (
        isinstance(a_value, DictionaryDHTValue),
        isinstance(b_value, DictionaryDHTValue),
    )
    if a_dict != b_dict:
        return a if a_dict else b
    if isinstance(a_value, DictionaryDHTValue) and isinstance(b_value, DictionaryDHTValue):
        merged = a_value.copy()
        for subkey, item in b_value.items(now):
            merged.store(subkey, item.value, item.expiration_time, now)
        merged.latest_expiration_time = max(
            merged.latest_expiration_time, b_value.latest_expiration_time
        )
        return ValueWithExpiration(merged, max(a.expiration_time, b.expiration_time))
    return b if b.expiration_time > a.expiration_time else a


def parse_dht_id(raw: bytes, what: str) -> DHTID:
    if len(raw) != DHTID.HASH_NBYTES:
        raise MalformedRequestError(
            f"{what} must be {DHTID.HASH_NBYTES} bytes, got {len(raw)} bytes"
        )
    return DHTID.from_bytes(raw)
