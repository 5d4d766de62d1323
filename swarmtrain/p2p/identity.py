"""Persistent Ed25519 peer identity.

The identity file holds the libp2p protobuf serialization of an Ed25519 private key (the same
format go-libp2p and hivemind's daemon use), written with mode 0600. The peer id is derived from
the public key, so the same file always gives the same peer id.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
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
