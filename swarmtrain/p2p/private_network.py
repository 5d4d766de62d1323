"""Private runs: a swarm key that peers must share to complete the libp2p handshake.

The key is mixed into the Noise XX handshake as its *prologue* (``PrivateNoiseTransport``): both
sides hash the prologue into the handshake transcript, and every encrypted handshake message is
authenticated against that transcript. A peer with another key (or none, e.g. a stock libp2p
host) fails to decrypt the responder's second handshake message, so no connection, stream, DHT
record or averaging group is ever opened with it. Relayed connections, AutoNAT dial-backs and
every other connection of the host go through the same transport, so the same check applies.

The key never leaves the process. It must be random (``generate_swarm_key``): an outsider who
dials a keyed peer can test guesses of the key offline against the handshake it received, so a
short or guessable key is refused.

Key files hold the key as hex (what ``swarmtrain keygen`` writes), optionally after the two
header lines of an IPFS ``swarm.key`` file; a file that is not hex is read as raw bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import string
from pathlib import Path

from cryptography.exceptions import InvalidTag
from libp2p.peer.id import ID
from libp2p.security.noise.exceptions import NoiseFailure
from libp2p.security.noise.patterns import IPattern, PatternXX
from libp2p.security.noise.transport import Transport as NoiseTransport

from swarmtrain.p2p._io_tuning import adopt_raw_connection, adopt_secured_connection
from swarmtrain.p2p.errors import P2PError

SWARM_KEY_SIZE = 32  # bytes; the minimum we accept
_PROLOGUE_LABEL = b"/swarmtrain/swarm-key/1"
_IPFS_HEADER = ("/key/swarm/psk/1.0.0/", "/base16/")
MAX_REMEMBERED_REJECTIONS = 4096
KEY_MISMATCH_HINT = "the peer rejected the handshake: different swarm key?"


class SwarmKeyError(P2PError):
    """A swarm key (or key file) is missing, unreadable, too short, or readable by others."""


class SwarmKeyMismatch(NoiseFailure):
    """The Noise handshake failed where a different swarm key makes it fail (raised inside
    py-libp2p's upgrader, which wraps it; ``dialling`` turns it into ``SwarmKeyMismatchError``)."""


def generate_swarm_key() -> bytes:
    """A fresh random swarm key (32 bytes). Save it with ``save_swarm_key``."""
    return os.urandom(SWARM_KEY_SIZE)


def save_swarm_key(key: bytes, path: str | os.PathLike) -> None:
    """Write ``key`` as hex to ``path`` (mode 0600); refuses to overwrite an existing file."""
    _check_key(key)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{path} exists; refusing to overwrite a swarm key") from None
    try:
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """Read a key file written by ``save_swarm_key`` (or an IPFS-style base16 swarm.key)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise SwarmKeyError(f"cannot read swarm key file {path}: {e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SwarmKeyError(
            f"swarm key file {path} is accessible by other users (mode {stat.filemode(mode)}); "
            f"run `chmod 600 {path}`"
        )
    key = _decode_key_file(data)
    try:
        _check_key(key)
    except SwarmKeyError as e:
        raise SwarmKeyError(f"swarm key file {path}: {e}") from None
    return key


def _decode_key_file(data: bytes) -> bytes:
    try:
        lines = [line.strip() for line in data.decode("ascii").splitlines() if line.strip()]
    except UnicodeDecodeError:
        return data
    if lines[:2] == list(_IPFS_HEADER):
        lines = lines[2:]
    if len(lines) == 1 and lines[0] and set(lines[0]) <= set(string.hexdigits):
        if len(lines[0]) % 2 == 0:
            return bytes.fromhex(lines[0])
    return data


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray):
        raise TypeError(f"a swarm key must be bytes, got {type(key).__name__}")
    if len(key) < SWARM_KEY_SIZE:
        raise SwarmKeyError(
            f"a swarm key must have at least {SWARM_KEY_SIZE} random bytes, got {len(key)}; "
            "make one with `swarmtrain keygen` or swarmtrain.p2p.generate_swarm_key()"
        )


def resolve_swarm_key(swarm_key: bytes | str | os.PathLike | None) -> bytes | None:
    """``swarm_key`` as given to ``P2P.create``: key bytes, a key file path, or None (public)."""
    if swarm_key is None:
        return None
    if isinstance(swarm_key, str | os.PathLike):
        return load_swarm_key(swarm_key)
    _check_key(swarm_key)
    return bytes(swarm_key)


def swarm_prologue(key: bytes) -> bytes:
    """The Noise prologue for ``key``: a keyed hash, so the key itself is never used directly."""
    return _PROLOGUE_LABEL + hmac.new(key, _PROLOGUE_LABEL, hashlib.sha256).digest()


class PrivateNoiseTransport(NoiseTransport):
    """py-libp2p's Noise transport with a swarm-key prologue (an instance passed in ``sec_opt``).

    A dial whose handshake fails the way a key mismatch makes it fail raises
    ``SwarmKeyMismatch``. The connections it secures read and write through
    ``_io_tuning``'s buffered TCP stream and batching Noise read-writer."""

    def __init__(self, *args, swarm_key: bytes | None, **kwargs):
        super().__init__(*args, **kwargs)
        # no key: the empty prologue of every public libp2p peer (a mismatch is still reported)
        self._prologue = swarm_prologue(swarm_key) if swarm_key is not None else None
        # peers whose last outbound handshake failed as a mismatch (py-libp2p then caches the
        # failed dial and later dials fail without a handshake, so we remember the reason)
        self._rejected_by: dict[ID, None] = {}

    def rejected_by(self, peer_id: ID) -> bool:
        """Whether our last handshake with ``peer_id`` failed as a swarm-key mismatch."""
        return peer_id in self._rejected_by

    def get_pattern(self) -> IPattern:
        return PatternXX(
            self.local_peer,
            self.libp2p_privkey,
            self.noise_privkey,
            self.early_data,
            prologue=self._prologue,
        )

    async def secure_inbound(self, conn):
        adopt_raw_connection(conn)
        secured = await super().secure_inbound(conn)
        adopt_secured_connection(secured)
        return secured

    async def secure_outbound(self, conn, peer_id):
        adopt_raw_connection(conn)
        try:
            secured = await super().secure_outbound(conn, peer_id)
        except Exception as e:
            if _is_transcript_mismatch(e):
                if len(self._rejected_by) >= MAX_REMEMBERED_REJECTIONS:
                    self._rejected_by.pop(next(iter(self._rejected_by)))
                self._rejected_by[peer_id] = None
                raise SwarmKeyMismatch(KEY_MISMATCH_HINT) from e
            raise
        self._rejected_by.pop(peer_id, None)
        adopt_secured_connection(secured)
        return secured


def _is_transcript_mismatch(error: BaseException) -> bool:
    """An AEAD tag failure inside the handshake: the transcripts (prologues) differ."""
    return any(isinstance(e, InvalidTag) for e in _causes(error))


def is_swarm_key_mismatch(error: BaseException) -> bool:
    """Whether a dial error (as py-libp2p wraps it) comes from a swarm-key mismatch."""
    return any(isinstance(e, SwarmKeyMismatch) for e in _causes(error))


def _causes(error: BaseException | None):
    """``error`` and everything it wraps: causes, contexts, and libp2p/trio error lists."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen or len(seen) > 256:
            continue
        seen.add(id(e))
        yield e
        pending += [e.__cause__, e.__context__]
        for name in ("errors", "exceptions"):  # libp2p's MultiError, ExceptionGroup
            inner = getattr(e, name, None)
            if isinstance(inner, list | tuple):
                pending += [x for x in inner if isinstance(x, BaseException)]
