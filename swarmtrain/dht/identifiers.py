"""160-bit Kademlia identifiers for DHT nodes and keys."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .serialization import serialize

__all__ = ["DHTID", "MAX_PEER_ID_BYTES"]

#: longest peer id (bytes) a node id is derived from: libp2p peer ids are a sha256 multihash
#: (34 bytes) or an identity multihash of a public key of at most 42 bytes (44 bytes)
MAX_PEER_ID_BYTES = 64
#: blake2b personalisation of node ids, so that no key id and no other use of the hash collides
#: with a node id by construction
_NODE_ID_PERSON = b"swarmtrain/node"
_NODE_ID_CACHE_SIZE = 8192


class _HasBytes(Protocol):
    def to_bytes(self) -> bytes: ...


class DHTID(int):
    """A node or key identifier: an integer in ``[DHTID.MIN, DHTID.MAX)``, compared by XOR distance.

    Key ids are the hash of the msgpack-serialized key (:meth:`generate`), so every peer derives
    the same id from the same key. A node's id is the hash of its libp2p peer id
    (:meth:`from_peer_id`): receivers check it, so a node cannot choose where it sits.
    """

    HASH_NBYTES = 20  # 160 bits
    NBITS = HASH_NBYTES * 8
    MIN, MAX = 0, 2**NBITS  # inclusive min, exclusive max

    def __new__(cls, value: int) -> DHTID:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"DHTID must be an int, got {type(value).__name__}")
        if not cls.MIN <= value < cls.MAX:
            raise ValueError(f"DHTID must be in [0, 2**{cls.NBITS}), got {value}")
        return super().__new__(cls, value)

    @classmethod
    def generate(cls, source: Any = None) -> DHTID:
        """Id of a key: the hash of ``serialize(source)``; a random id if ``source`` is None."""
        if source is None:
            return cls.from_bytes(os.urandom(cls.HASH_NBYTES))
        return cls.from_serialized_key(serialize(source))

    @classmethod
    def from_serialized_key(cls, serialized_key: bytes) -> DHTID:
        """Id of an already serialized key: ``from_serialized_key(serialize(k)) == generate(k)``."""
        digest = hashlib.blake2b(serialized_key, digest_size=cls.HASH_NBYTES).digest()
        return cls.from_bytes(digest)

    @classmethod
    def from_peer_id(cls, peer_id: bytes | _HasBytes) -> DHTID:
        """The node id of a peer: blake2b-160 (personalised ``swarmtrain/node``) of its peer id
        bytes. Results are cached (a few thousand peers), so checking a known peer costs a
        dictionary lookup.

        :raises ValueError: the peer id is empty or longer than :data:`MAX_PEER_ID_BYTES`
        """
        raw = peer_id if isinstance(peer_id, bytes) else peer_id.to_bytes()
        node_id = _NODE_IDS.get(raw)
        if node_id is None:
            if not 0 < len(raw) <= MAX_PEER_ID_BYTES:
                raise ValueError(
                    f"a peer id must be 1 to {MAX_PEER_ID_BYTES} bytes, got {len(raw)}"
                )
            node_id = _derive_node_id(raw)
        return node_id

    def is_node_id_of(self, peer_id: bytes | _HasBytes) -> bool:
        """Whether this is the node id of ``peer_id`` (False for a malformed peer id)."""
        raw = peer_id if isinstance(peer_id, bytes) else peer_id.to_bytes()
        node_id = _NODE_IDS.get(raw)
        if node_id is None:
            if not 0 < len(raw) <= MAX_PEER_ID_BYTES:
                return False
            node_id = _derive_node_id(raw)
        return self == node_id

    @classmethod
    def from_bytes(cls, raw: bytes) -> DHTID:  # type: ignore[override]
        """Parse the big-endian :meth:`to_bytes` form (exactly :attr:`HASH_NBYTES` bytes)."""
        if len(raw) != cls.HASH_NBYTES:
            raise ValueError(f"DHTID must be {cls.HASH_NBYTES} bytes long, got {len(raw)}")
        return cls(int.from_bytes(raw, "big"))

    def to_bytes(self) -> bytes:  # type: ignore[override]
        """Big-endian encoding, :attr:`HASH_NBYTES` bytes long."""
        return int.to_bytes(self, self.HASH_NBYTES, "big")

    def xor_distance(self, other: int | Sequence[int]) -> int | list[int]:
        """Kademlia distance between this id and ``other``; a list of distances if ``other`` is a
        sequence of ids (as in hivemind)."""
        if isinstance(other, int):
            return int(self) ^ int(other)
        return self.xor_distances(other)

    def xor_distances(self, others: Iterable[int]) -> list[int]:
        """Distances from this id to each of ``others``."""
        me = int(self)
        return [me ^ int(other) for other in others]

    def bucket_index(self, other: int) -> int:
        """Index of the highest differing bit: ``NBITS - 1 - common_prefix_length``; -1 if equal."""
        return (int(self) ^ int(other)).bit_length() - 1

    @classmethod
    def common_prefix_length(cls, *ids: int) -> int:
        """Number of leading bits (out of :attr:`NBITS`) shared by all ``ids``."""
        if not ids:
            raise ValueError("common_prefix_length needs at least one id")
        differing = 0
        for other in ids[1:]:
            differing |= int(ids[0]) ^ int(other)
        return cls.NBITS - differing.bit_length()

    #: hivemind's name of :meth:`common_prefix_length`
    longest_common_prefix_length = common_prefix_length

    def __bytes__(self) -> bytes:
        """``bytes(node_id) == node_id.to_bytes()`` (an int's ``bytes()`` would be zero bytes)."""
        return self.to_bytes()

    def __repr__(self) -> str:
        return f"DHTID({int(self):#0{self.HASH_NBYTES * 2 + 2}x})"


#: node ids of recently seen peer ids (a check of a known peer is one dict lookup); bounded:
#: cleared when full, as only peer ids of at most MAX_PEER_ID_BYTES enter it
_NODE_IDS: dict[bytes, DHTID] = {}


def _derive_node_id(raw: bytes) -> DHTID:
    digest = hashlib.blake2b(raw, digest_size=DHTID.HASH_NBYTES, person=_NODE_ID_PERSON).digest()
    node_id = DHTID.from_bytes(digest)
    if len(_NODE_IDS) >= _NODE_ID_CACHE_SIZE:
        _NODE_IDS.clear()
    _NODE_IDS[raw] = node_id
    return node_id
