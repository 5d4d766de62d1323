"""The run directory: runs announce themselves under one well-known DHT key.

Each announcement is a :class:`RunAnnouncement` stored under :data:`RUNS_KEY` with subkey
``[owner:...]<run_id>``, signed by the announcer's key (only it can change or withdraw it) and
checked against :class:`RunsSchema` (bounded strings and lists). Two owners may announce the
same ``run_id``: readers see both, each with its owner marker, and pick by who they trust.

``list_runs(dht)`` reads them (``swarmtrain runs --initial_peers ...`` prints them);
``AsyncRunAnnouncer.create(dht, announcement)`` keeps one announced while it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import pydantic
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmtrain.dht import (
    AsyncDHT,
    BytesWithPublicKey,
    CompositeValidator,
    Ed25519SignatureValidator,
    SchemaValidator,
    generate_private_key,
    get_dht_time,
)

__all__ = [
    "RUNS_KEY",
    "AsyncRunAnnouncer",
    "RunAnnouncement",
    "RunsSchema",
    "add_runs_validators",
    "announce_run",
    "list_runs",
]

logger = logging.getLogger(__name__)

RUNS_KEY = "swarmtrain_runs"  #: the DHT key of the run directory
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


def _text(limit: int) -> Any:
    return Annotated[str, pydantic.Field(max_length=limit)]


class RunAnnouncementSchema(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    run_id: Annotated[str, pydantic.Field(min_length=1, max_length=_LIMITS["run_id"])]
    name: _text(_LIMITS["name"])
    description: _text(_LIMITS["description"])
    model: _text(_LIMITS["model"])
    initial_peers: Annotated[
        list[Annotated[str, pydantic.Field(max_length=MAX_MADDR_LENGTH)]],
        pydantic.Field(max_length=MAX_INITIAL_PEERS),
    ]
    command: _text(_LIMITS["command"])
    requirements: _text(_LIMITS["requirements"])
    private: bool
    time: Annotated[float, pydantic.Field(allow_inf_nan=False)]


class RunsSchema(pydantic.BaseModel):
    """``swarmtrain_runs``: ``{owner marker + run_id: announcement}``."""

    swarmtrain_runs: dict[BytesWithPublicKey, RunAnnouncementSchema]


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
    owner: bytes = b""  #: the announcer's ``[owner:...]`` marker (set when read)

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        try:
            RunAnnouncementSchema.model_validate(self.to_dict() | {"time": float(self.time)})
        except pydantic.ValidationError as e:
            raise ValueError(f"invalid run announcement: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The DHT value (without ``owner``, which is the record's subkey)."""
        value = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del value["owner"]
        value["initial_peers"] = list(self.initial_peers)
        return value


def add_runs_validators(
    dht: AsyncDHT, private_key: Ed25519PrivateKey | None = None
) -> Ed25519SignatureValidator:
    """Register the run directory's schema and a signature validator on ``dht``'s node; return
    the signature validator the node signs with."""
    validator = dht.node.record_validator
    if not isinstance(validator, CompositeValidator):
        raise TypeError("the DHT node's record_validator must be a CompositeValidator")
    validator.extend(
        [
            SchemaValidator(RunsSchema),
            Ed25519SignatureValidator(
                generate_private_key() if private_key is None else private_key
            ),
        ]
    )
    return next(v for v in validator.validators if isinstance(v, Ed25519SignatureValidator))


async def announce_run(
    dht: AsyncDHT,
    announcement: RunAnnouncement,
    expiration: float = 300.0,
    private_key: Ed25519PrivateKey | None = None,
) -> bool:
    """Store ``announcement`` (stamped with the current time) for ``expiration`` seconds;
    whether any node stored it."""
    signer = add_runs_validators(dht, private_key)
    now = get_dht_time()
    value = dataclasses.replace(announcement, time=now).to_dict()
    subkey = signer.local_public_key + announcement.run_id.encode()
    return await dht.store(RUNS_KEY, value, now + expiration, subkey=subkey)


def _parse(subkey: Any, value: Any) -> RunAnnouncement | None:
    if not isinstance(subkey, bytes) or not subkey.startswith(b"[owner:"):
        return None
    try:
        checked = RunAnnouncementSchema.model_validate(value, strict=True)
    except pydantic.ValidationError:
        return None
    owner, _, run_id = subkey.partition(b"]")
    if run_id != checked.run_id.encode():
        return None  # an announcement copied under another run's subkey
    return RunAnnouncement(**checked.model_dump(), owner=owner + b"]")


async def list_runs(dht: AsyncDHT) -> list[RunAnnouncement]:
    """The announced runs, most recent first (at most :data:`MAX_RUNS_LISTED`)."""
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

    def __init__(self, dht: AsyncDHT, announcement: RunAnnouncement, expiration: float):
        self.dht, self.announcement, self.expiration = dht, announcement, expiration
        self.announcements = 0  #: successful stores

    @classmethod
    @asynccontextmanager
    async def create(
        cls,
        dht: AsyncDHT,
        announcement: RunAnnouncement,
        *,
        expiration: float = 300.0,
        private_key: Ed25519PrivateKey | None = None,
    ) -> AsyncIterator[AsyncRunAnnouncer]:
        if not (math.isfinite(expiration) and expiration > 0):
            raise ValueError("expiration must be positive")
        self = cls(dht, announcement, expiration)
        add_runs_validators(dht, private_key)
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
                    if await announce_run(self.dht, self.announcement, self.expiration):
                        self.announcements += 1
            except Exception:
                logger.warning("could not announce run %s", self.announcement.run_id, exc_info=True)
            await trio.sleep(self.expiration / 3)
