"""Per-peer records: under registered keys, each subkey is a peer id only that peer can write.

Keys whose dictionary holds one record per peer (matchmaking declarations, state-sharing
declarations, DiLoCo presence) are registered with a :class:`PeerRecordValidator`, by exact key
or by a regular expression over string keys. Under such a key:

- every record has a subkey (a plain value, which would replace the whole dictionary, is
  rejected);
- the subkey is a peer id (``PeerID.to_bytes()``), and the value carries a signature by the
  libp2p identity key behind that peer id over (key, subkey, value, expiration time). So nobody
  can write, blank or extend another peer's record, replay it under another subkey or key, or
  change its value or expiration.

Signing is transparent: each ``DHTNode`` starts with a ``PeerRecordValidator`` bound to its
host's identity (:class:`~swarmtrain.p2p.PeerSigner`), and validators added later merge their
keys into it (``node.add_validators([PeerRecordValidator([key])])``). A store under a
registered key whose subkey is this host's peer id is signed; one under another peer's id stays
unsigned and is rejected by every node that knows the key. Reads drop unsigned or mis-signed
records, so callers see only records written by their subkey's peer.

Which nodes enforce it: a signed per-peer record (its value ends with the signature trailer)
is verified and stripped by every node, under any key, so every node stores honest records and
refuses forged signatures. Requiring a signature (refusing plain values and unsigned subkeys)
needs the key: a node checks the keys registered on it. Every swarmtrain component that writes
per-peer records registers its key patterns on its own node (all runs' keys of that kind, not
only its own), so in a run of honest swarmtrain peers every replica enforces them. A node that
never registered the key (a plain ``DHT`` with no averager) stores unsigned values under it:
an attacker can wipe or forge records on that node, but readers that know the key drop forged
records and plain values from its answers, and the records on the other replicas survive.
Nodes of versions before this module cannot strip the signature: they refuse signed records as
malformed, and their readers cannot decode them.

Cost: one Ed25519 signature per store, one verification per record a node stores or reads;
verified records are remembered (bounded), so re-reading unchanged declarations costs a lookup.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from typing import Any

from swarmtrain.p2p import PeerSigner, verify_peer_signature

from .serialization import DHTValueError, deserialize, serialize
from .validation import NO_SUBKEY, DHTRecord, RecordValidatorBase

__all__ = ["PeerRecordValidator"]

_SIGNING_DOMAIN = b"swarmtrain.dht.peer-record.v1"
# value || signature || public key || u16 len(signature) || u16 len(public key) || magic
_TRAILER_MAGIC = b"\xff\x00swtPR1"  # 8 bytes: a user value ends so by chance 1 in 2**64
_LENGTHS = struct.Struct(">HH")
_TRAILER_SIZE = _LENGTHS.size + len(_TRAILER_MAGIC)
_MAX_CACHED_KEYS = 4096  #: keys whose "is it registered" answer is remembered
_MAX_VERIFIED = 8192  #: verified records remembered (cleared when full)
_MAX_VERIFIED_VALUE_SIZE = 4096  #: larger records are verified every time, not remembered


def _payload(record: DHTRecord, stripped_value: bytes) -> bytes:
    fields = [
        struct.pack(">I", len(part)) + part for part in (record.key, record.subkey, stripped_value)
    ]
    return b"".join([_SIGNING_DOMAIN, *fields, struct.pack(">d", float(record.expiration_time))])


def _split(value: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(stripped value, signature, public key) of a signed value, or None if it has no trailer."""
    if len(value) < _TRAILER_SIZE or not value.endswith(_TRAILER_MAGIC):
        return None
    end = len(value) - _TRAILER_SIZE
    signature_size, key_size = _LENGTHS.unpack_from(value, end)
    start = end - signature_size - key_size
    if signature_size == 0 or start < 0:
        return None
    return value[:start], value[start : start + signature_size], value[start + signature_size : end]


class PeerRecordValidator(RecordValidatorBase):
    """Owned per-peer subkeys under ``keys`` (see the module docstring).

    :param keys: exact keys (any DHT key) and compiled regular expressions, matched in full
      against string keys (``re.compile(r"[^.]+\\.0b[01]*")``)
    :param signer: signs this host's records; a node's own validator has it, validators added
      to a node merge into that one and need none
    """

    def __init__(
        self, keys: Iterable[Any | re.Pattern[str]] = (), *, signer: PeerSigner | None = None
    ):
        self._exact: set[bytes] = set()
        self._patterns: dict[str, re.Pattern[str]] = {}
        self._signer = signer
        self._registered_cache: dict[bytes, bool] = {}
        self._verified: set[tuple[bytes, bytes, bytes, float]] = set()
        self.add_keys(keys)

    def add_keys(self, keys: Iterable[Any | re.Pattern[str]]) -> None:
        """Register more keys (exact keys or compiled patterns over string keys)."""
        for key in keys:
            if isinstance(key, re.Pattern):
                if not isinstance(key.pattern, str):
                    raise TypeError("key patterns must be str patterns (keys are strings)")
                self._patterns[key.pattern] = key
            else:
                self._exact.add(serialize(key))
        self._registered_cache = {}

    @property
    def peer_id(self) -> bytes | None:
        """The peer id this validator signs for (None: it only verifies)."""
        return None if self._signer is None else self._signer.peer_id

    def is_registered(self, serialized_key: bytes) -> bool:
        """Whether records under ``serialized_key`` must be owned, signed per-peer subkeys."""
        known = self._registered_cache.get(serialized_key)
        if known is not None:
            return known
        registered = serialized_key in self._exact
        if not registered and self._patterns:
            try:
                key = deserialize(serialized_key)
            except DHTValueError:
                key = None
            registered = isinstance(key, str) and any(
                pattern.fullmatch(key) for pattern in self._patterns.values()
            )
        cache = self._registered_cache
        if len(cache) >= _MAX_CACHED_KEYS:
            cache.clear()
        cache[serialized_key] = registered
        return registered

    @staticmethod
    def _subkey_peer_id(record: DHTRecord) -> bytes | None:
        if record.subkey == NO_SUBKEY:
            return None
        try:
            peer_id = deserialize(record.subkey)
        except DHTValueError:
            return None
        return peer_id if isinstance(peer_id, bytes) and peer_id else None

    def validate(self, record: DHTRecord) -> bool:
        parts = _split(record.value)
        if parts is None:
            # unsigned: fine, unless the key is registered (then it is a plain value, a forged
            # subkey, or an older peer's record)
            return not self.is_registered(record.key)
        # a signed per-peer record is checked under any key, so nodes that do not know the key
        # still store honest records and refuse forged ones
        peer_id = self._subkey_peer_id(record)
        if peer_id is None:
            return False  # signed, but not under a peer id
        remembered = len(record.value) <= _MAX_VERIFIED_VALUE_SIZE
        fingerprint = (record.key, record.subkey, record.value, float(record.expiration_time))
        if remembered and fingerprint in self._verified:
            return True
        stripped, signature, public_key = parts
        if not verify_peer_signature(peer_id, _payload(record, stripped), signature, public_key):
            return False
        if remembered:
            if len(self._verified) >= _MAX_VERIFIED:
                self._verified = set()
            self._verified.add(fingerprint)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        """Sign records of this host's own subkey under a registered key; leave others as they
        are (unsigned records under a registered key are then rejected everywhere)."""
        signer = self._signer
        if signer is None or not self.is_registered(record.key):
            return record.value
        if self._subkey_peer_id(record) != signer.peer_id:
            return record.value
        signature = signer.sign(_payload(record, record.value))
        public_key = signer.public_key
        lengths = _LENGTHS.pack(len(signature), len(public_key))
        return record.value + signature + public_key + lengths + _TRAILER_MAGIC

    def strip_value(self, record: DHTRecord) -> bytes:
        parts = _split(record.value)
        return record.value if parts is None else parts[0]

    @property
    def priority(self) -> int:
        return 20  # outermost: signs after, and checks before, every other validator

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Absorb another ``PeerRecordValidator``'s keys (and its signer if this has none)."""
        if not isinstance(other, PeerRecordValidator):
            return False
        new_exact = other._exact - self._exact
        new_patterns = {k: v for k, v in other._patterns.items() if k not in self._patterns}
        if new_exact or new_patterns:  # (readers re-register each call: usually nothing new)
            self._exact |= new_exact
            self._patterns.update(new_patterns)
            self._registered_cache = {}
        if self._signer is None:
            self._signer = other._signer
        return True

    def __getstate__(self) -> dict[str, Any]:
        """Picklable without the signer: a copy in another process verifies, and signs with
        that process's node key once added to its node."""
        return {"exact": self._exact, "patterns": list(self._patterns.values())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        PeerRecordValidator.__init__(self, state["patterns"])
        self._exact = set(state["exact"])
