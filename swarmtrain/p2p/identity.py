"""Persistent Ed25519 peer identity, and signatures by it (``PeerSigner``,
``verify_peer_signature``: records only the peer behind a peer id can write).

The identity file holds the libp2p protobuf serialization of an Ed25519 private key (the same
format go-libp2p and hivemind's daemon use), written with mode 0600. The peer id is derived from
the public key, so the same file always gives the same peer id.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key, deserialize_public_key
from libp2p.peer.id import ID

from swarmtrain.p2p.errors import P2PError


class IdentityError(P2PError):
    """The identity file is unreadable, malformed, not Ed25519, or readable by others."""


def generate_identity() -> KeyPair:
    """A fresh random Ed25519 key pair."""
    return create_new_key_pair()


def save_identity(key_pair: KeyPair, path: str | os.PathLike) -> None:
    """Write ``key_pair``'s private key to ``path`` atomically with mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key_pair.private_key.serialize())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_identity(path: str | os.PathLike) -> KeyPair:
    """Read a key pair written by ``save_identity`` (or any libp2p Ed25519 key file)."""
    path = Path(path)
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"identity file {path} is accessible by other users (mode {stat.filemode(mode)}); "
            f"run `chmod 600 {path}`"
        )
    try:
        private_key = deserialize_private_key(path.read_bytes())
    except Exception as e:
        raise IdentityError(f"identity file {path} is not a libp2p private key: {e}") from e
    if private_key.get_type() != KeyType.Ed25519:
        raise IdentityError(f"identity file {path} holds a {private_key.get_type().name} key")
    return KeyPair(private_key, private_key.get_public_key())


def load_or_create_identity(path: str | os.PathLike | None) -> KeyPair:
    """Load the identity at ``path``, creating it first if missing; random if path is None."""
    if path is None:
        return generate_identity()
    if Path(path).exists():
        return load_identity(path)
    key_pair = generate_identity()
    save_identity(key_pair, path)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


# ---------------------------------------------------------------------------------- signatures
# An Ed25519 peer id is the identity multihash of the protobuf-serialized public key: code 0x00,
# length 36, then PublicKey{Type: Ed25519 (field 1 = 1), Data (field 2, 32 bytes)}.
_ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
_ED25519_PEER_ID_SIZE = len(_ED25519_PEER_ID_PREFIX) + 32
MAX_SIGNING_PUBLIC_KEY_SIZE = 600  #: bytes of a carried public key (RSA up to 4096 bits)


class PeerSigner:
    """Signs bytes with a host's libp2p identity key: the key behind its peer id.

    ``public_key`` is what a verifier needs besides the peer id: empty for Ed25519 (the peer id
    embeds the key), the protobuf-serialized public key for other key types (their peer id is
    its hash). Check a signature with :func:`verify_peer_signature`.
    """

    def __init__(self, key_pair: KeyPair):
        self.peer_id: bytes = ID.from_pubkey(key_pair.public_key).to_bytes()
        self._key = key_pair.private_key
        self._ed25519: Ed25519PrivateKey | None = None
        if key_pair.private_key.get_type() == KeyType.Ed25519 and _is_ed25519_peer_id(self.peer_id):
            # OpenSSL's Ed25519 signs several times faster than PyNaCl's through libp2p
            self._ed25519 = Ed25519PrivateKey.from_private_bytes(key_pair.private_key.to_bytes())
            self.public_key = b""
        else:
            self.public_key = key_pair.public_key.serialize()

    def sign(self, data: bytes) -> bytes:
        """The signature of ``data`` by this peer's identity key."""
        if self._ed25519 is not None:
            return self._ed25519.sign(data)
        return self._key.sign(data)


def _is_ed25519_peer_id(peer_id: bytes) -> bool:
    return len(peer_id) == _ED25519_PEER_ID_SIZE and peer_id.startswith(_ED25519_PEER_ID_PREFIX)


@functools.lru_cache(maxsize=4096)
def _ed25519_key_of(peer_id: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(peer_id[len(_ED25519_PEER_ID_PREFIX) :])


def verify_peer_signature(
    peer_id: bytes, data: bytes, signature: bytes, public_key: bytes = b""
) -> bool:
    """Whether ``signature`` is a signature of ``data`` by the identity key behind ``peer_id``.

    ``public_key``: empty for an Ed25519 peer id (the key is read from the id itself);
    otherwise the protobuf-serialized public key (``PeerSigner.public_key``), which must hash
    to ``peer_id``. Never raises on malformed input: it is just not a valid signature.
    """
    if _is_ed25519_peer_id(peer_id):
        if public_key:
            return False  # one encoding per signature: the key is in the peer id
        try:
            _ed25519_key_of(peer_id).verify(signature, data)
        except (ValueError, InvalidSignature):
            return False
        return True
    if not public_key or len(public_key) > MAX_SIGNING_PUBLIC_KEY_SIZE:
        return False
    try:
        key = deserialize_public_key(public_key)
        if ID.from_pubkey(key).to_bytes() != peer_id:
            return False
        return bool(key.verify(data, signature))
    except Exception:  # malformed key or signature from a peer: not valid
        return False
