"""The run directory: runs announce themselves under one well-known DHT key.

Each announcement is a :class:`RunAnnouncement` stored under :data:`RUNS_KEY` with subkey =
the announcing peer's id, signed with that peer's libp2p identity key
(:class:`~swarmtrain.dht.PeerRecordValidator`: nobody else can change or withdraw it) and
checked against :class:`RunsSchema` (bounded strings and lists). A peer announces one run at a
time: announcing another replaces it. Two peers may announce the same ``run_id``: readers see
both, each with its announcer's peer id (:attr:`RunAnnouncement.announcer`), and pick by whom
they trust; :attr:`RunAnnouncement.announced_by_initial_peer` says whether the announcer is one
of the bootstrap peers it lists.

A run can have an owner key (Ed25519, :func:`generate_owner_key`, ``swarmtrain keygen
--run_owner PATH``): an announcement signed with it carries ``owner_key`` (the public key, hex)
and ``owner_signature`` over all its other fields (:meth:`RunAnnouncement.sign`). Records with
an owner key and a bad signature are dropped when read. Readers pin the first owner key they
see for a ``run_id`` (:mod:`swarmtrain.monitor.run_trust`) and flag later announcements of that
``run_id`` that are not signed by it. Any peer may re-announce a signed announcement (it cannot
change it), so the organisers may announce from several peers with one key.

``list_runs(dht)`` reads them (``swarmtrain runs --initial_peers ...`` prints them);
``AsyncRunAnnouncer.create(dht, announcement, owner_key=key)`` keeps one announced (signed)
while it runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import pydantic
import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarmtrain.dht import (
    MAX_PEER_ID_BYTES,
    AsyncDHT,
    PeerRecordValidator,
    SchemaValidator,
    get_dht_time,
)
from swarmtrain.dht.owned_keys import RUNS_KEY, RUNS_KEY_PATTERN
from swarmtrain.p2p import PeerID

__all__ = [
    "RUNS_KEY",
    "AsyncRunAnnouncer",
    "RunAnnouncement",
    "RunsSchema",
    "add_runs_validators",
    "announce_run",
    "generate_owner_key",
    "list_runs",
    "load_owner_key",
    "owner_public_key",
    "save_owner_key",
]

logger = logging.getLogger(__name__)

MAX_RUNS_LISTED = 100  #: ``list_runs`` returns at most this many (the most recent)
_LIMITS = {
    "run_id": 64,
    "name": 128,
    "description": 1024,
    "model": 256,
    "command": 1024,
    "requirements": 512,
}
MAX_INITIAL_PEERS = 8
MAX_MADDR_LENGTH = 512
_OWNER_SIGNING_DOMAIN = b"swarmtrain.monitor.run-announcement.v1\n"
_OWNER_KEY_PATTERN = r"^([0-9a-f]{64})?$"  # 32-byte Ed25519 public key, hex, or ""
_OWNER_SIGNATURE_PATTERN = r"^([0-9a-f]{128})?$"  # 64-byte Ed25519 signature, hex, or ""


_Name = Annotated[str, pydantic.Field(max_length=_LIMITS["name"])]
_Description = Annotated[str, pydantic.Field(max_length=_LIMITS["description"])]
_Model = Annotated[str, pydantic.Field(max_length=_LIMITS["model"])]
_Command = Annotated[str, pydantic.Field(max_length=_LIMITS["command"])]
_Requirements = Annotated[str, pydantic.Field(max_length=_LIMITS["requirements"])]


class RunAnnouncementSchema(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    run_id: Annotated[str, pydantic.Field(min_length=1, max_length=_LIMITS["run_id"])]
    name: _Name
    description: _Description
    model: _Model
    initial_peers: Annotated[
        list[Annotated[str, pydantic.Field(max_length=MAX_MADDR_LENGTH)]],
        pydantic.Field(max_length=MAX_INITIAL_PEERS),
    ]
    command: _Command
    requirements: _Requirements
    private: bool
    time: Annotated[float, pydantic.Field(allow_inf_nan=False)]
    #: absent in announcements of versions before owner keys
    owner_key: Annotated[str, pydantic.Field(pattern=_OWNER_KEY_PATTERN)] = ""
    owner_signature: Annotated[str, pydantic.Field(pattern=_OWNER_SIGNATURE_PATTERN)] = ""


class RunsSchema(pydantic.BaseModel):
    """``swarmtrain_runs``: ``{announcer's peer id: announcement}``."""

    swarmtrain_runs: dict[
        Annotated[bytes, pydantic.Field(min_length=1, max_length=MAX_PEER_ID_BYTES)],
        RunAnnouncementSchema,
    ]


@dataclasses.dataclass(frozen=True)
class RunAnnouncement:
    """What a run tells people who want to watch or join it (validated on construction)."""

    run_id: str
    name: str = ""
    description: str = ""
    model: str = ""
    initial_peers: tuple[str, ...] = ()  #: multiaddrs to pass as ``--initial_peers``
    command: str = ""  #: the command a volunteer runs to join
    requirements: str = ""  #: e.g. "1 GPU with 16 GB, torch>=2.2"
    private: bool = False  #: a swarm key is needed to join (ask the organisers)
    time: float = 0.0  #: DHT time of the announcement (set by ``announce_run``)
    owner_key: str = ""  #: hex Ed25519 public key of the run's owner ("" : unsigned)
    owner_signature: str = ""  #: hex signature by ``owner_key`` over the other fields
    announcer: str = ""  #: base58 peer id of the peer that announced it (set when read)

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        try:
            RunAnnouncementSchema.model_validate(self.to_dict() | {"time": float(self.time)})
        except pydantic.ValidationError as e:
            raise ValueError(f"invalid run announcement: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The DHT value (without ``announcer``, which is the record's subkey; without the
        owner fields when unsigned)."""
        value = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del value["announcer"]
        value["initial_peers"] = list(self.initial_peers)
        if not (self.owner_key or self.owner_signature):
            del value["owner_key"], value["owner_signature"]  # as versions before owner keys
        return value

    def _signed_payload(self) -> bytes:
        fields = self.to_dict()
        fields.pop("owner_signature", None)
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return _OWNER_SIGNING_DOMAIN + canonical.encode()

    def sign(self, owner_key: Ed25519PrivateKey) -> RunAnnouncement:
        """This announcement with ``owner_key`` (its public part) and a signature over every
        other field (``time`` included: set it first)."""
        unsigned = dataclasses.replace(
            self, owner_key=owner_public_key(owner_key), owner_signature=""
        )
        signature = owner_key.sign(unsigned._signed_payload()).hex()
        return dataclasses.replace(unsigned, owner_signature=signature)

    @property
    def signed(self) -> bool:
        """Whether it carries an owner key and a valid signature by it."""
        if not (self.owner_key and self.owner_signature):
            return False
        try:
            public_key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.owner_key))
            public_key.verify(bytes.fromhex(self.owner_signature), self._signed_payload())
        except (InvalidSignature, ValueError):
            return False
        return True

    @property
    def announced_by_initial_peer(self) -> bool:
        """Whether the announcer is one of the ``initial_peers`` it lists (``.../p2p/<id>``):
        the bootstrap peer vouches for the run itself."""
        suffix = f"/p2p/{self.announcer}"
        return bool(self.announcer) and any(a.endswith(suffix) for a in self.initial_peers)


def add_runs_validators(dht: AsyncDHT) -> None:
    """Register the run directory's schema and its owned key on ``dht``'s node (records under
    :data:`RUNS_KEY` are then signed by, and checked against, their subkey's peer)."""
    dht.add_validators([SchemaValidator(RunsSchema), PeerRecordValidator([RUNS_KEY_PATTERN])])


def generate_owner_key() -> Ed25519PrivateKey:
    """A new random owner key for a run (keep it secret; publish its :func:`owner_public_key`)."""
    return Ed25519PrivateKey.generate()


def owner_public_key(owner_key: Ed25519PrivateKey) -> str:
    """The hex public key that announcements signed with ``owner_key`` carry."""
    raw = owner_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return raw.hex()


def save_owner_key(owner_key: Ed25519PrivateKey, path: str) -> None:
    """Write ``owner_key`` to a new file (PEM, mode 0600); refuses to overwrite one."""
    pem = owner_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(pem)


def load_owner_key(path: str) -> Ed25519PrivateKey:
    """The owner key saved by :func:`save_owner_key`; ``ValueError`` if it is not one."""
    with open(path, "rb") as file:
        data = file.read(16384)
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} does not hold an Ed25519 private key")
    return key


async def announce_run(
    dht: AsyncDHT,
    announcement: RunAnnouncement,
    expiration: float = 300.0,
    owner_key: Ed25519PrivateKey | None = None,
) -> bool:
    """Store ``announcement`` (stamped with the current time, and signed with ``owner_key`` if
    given) for ``expiration`` seconds under this peer's id (replacing this peer's earlier
    announcement); whether any node stored it."""
    add_runs_validators(dht)
    now = get_dht_time()
    stamped = dataclasses.replace(announcement, time=now)
    if owner_key is not None:
        stamped = stamped.sign(owner_key)
    value = stamped.to_dict()
    return await dht.store(RUNS_KEY, value, now + expiration, subkey=dht.peer_id.to_bytes())


def _parse(subkey: Any, value: Any) -> RunAnnouncement | None:
    if not isinstance(subkey, bytes) or not 0 < len(subkey) <= MAX_PEER_ID_BYTES:
        return None
    try:
        checked = RunAnnouncementSchema.model_validate(value, strict=True)
    except pydantic.ValidationError:
        return None
    parsed = RunAnnouncement(**checked.model_dump(), announcer=PeerID(subkey).to_base58())
    if (parsed.owner_key or parsed.owner_signature) and not parsed.signed:
        return None  # a forged or broken owner signature
    return parsed


async def list_runs(dht: AsyncDHT) -> list[RunAnnouncement]:
    """The announced runs, most recent first (at most :data:`MAX_RUNS_LISTED`). Records not
    signed by their subkey's peer, or with an owner key whose signature does not verify, are
    dropped (this registers the run directory on ``dht``)."""
    add_runs_validators(dht)
    found = await dht.get(RUNS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    runs = [
        parsed
        for subkey, item in found.value.items()
        if (parsed := _parse(subkey, getattr(item, "value", None))) is not None
    ]
    runs.sort(key=lambda run: run.time, reverse=True)
    return runs[:MAX_RUNS_LISTED]


class AsyncRunAnnouncer:
    """Keeps one run announced: re-announces every ``expiration / 3`` seconds while open."""

    def __init__(
        self,
        dht: AsyncDHT,
        announcement: RunAnnouncement,
        expiration: float,
        owner_key: Ed25519PrivateKey | None = None,
    ):
        self.dht, self.announcement, self.expiration = dht, announcement, expiration
        self.owner_key = owner_key
        self.announcements = 0  #: successful stores

    @classmethod
    @asynccontextmanager
    async def create(
        cls,
        dht: AsyncDHT,
        announcement: RunAnnouncement,
        *,
        expiration: float = 300.0,
        owner_key: Ed25519PrivateKey | None = None,
    ) -> AsyncIterator[AsyncRunAnnouncer]:
        """Announce ``announcement`` every ``expiration / 3`` seconds, signed with the run's
        ``owner_key`` if given (see the module docstring)."""
        if not (math.isfinite(expiration) and expiration > 0):
            raise ValueError("expiration must be positive")
        self = cls(dht, announcement, expiration, owner_key)
        add_runs_validators(dht)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._loop)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def _loop(self) -> None:
        while True:
            try:
                with trio.move_on_after(self.expiration / 3):
                    if await announce_run(
                        self.dht, self.announcement, self.expiration, self.owner_key
                    ):
                        self.announcements += 1
            except Exception:
                logger.warning("could not announce run %s", self.announcement.run_id, exc_info=True)
            await trio.sleep(self.expiration / 3)
