"""The run directory: runs announce themselves under one well-known DHT key.

Each announcement is a :class:`RunAnnouncement` stored under :data:`RUNS_KEY` with subkey =
the announcing peer's id, signed with that peer's libp2p identity key
(:class:`~swarmtrain.dht.PeerRecordValidator`: nobody else can change or withdraw it) and
checked against :class:`RunsSchema` (bounded strings and lists). A peer announces one run at a
time: announcing another replaces it. Two peers may announce the same ``run_id``: readers see
both, each with its announcer's peer id (:attr:`RunAnnouncement.announcer`), and pick by whom
they trust; :attr:`RunAnnouncement.announced_by_initial_peer` says whether the announcer is one
of the bootstrap peers it lists.

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
    "list_runs",
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
    announcer: str = ""  #: base58 peer id of the peer that announced it (set when read)

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        try:
            RunAnnouncementSchema.model_validate(self.to_dict() | {"time": float(self.time)})
        except pydantic.ValidationError as e:
            raise ValueError(f"invalid run announcement: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The DHT value (without ``announcer``, which is the record's subkey)."""
        value = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del value["announcer"]
        value["initial_peers"] = list(self.initial_peers)
        return value

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


async def announce_run(
    dht: AsyncDHT, announcement: RunAnnouncement, expiration: float = 300.0
) -> bool:
    """Store ``announcement`` (stamped with the current time) for ``expiration`` seconds under
    this peer's id (replacing this peer's earlier announcement); whether any node stored it."""
    add_runs_validators(dht)
    now = get_dht_time()
    value = dataclasses.replace(announcement, time=now).to_dict()
    return await dht.store(RUNS_KEY, value, now + expiration, subkey=dht.peer_id.to_bytes())


def _parse(subkey: Any, value: Any) -> RunAnnouncement | None:
    if not isinstance(subkey, bytes) or not 0 < len(subkey) <= MAX_PEER_ID_BYTES:
        return None
    try:
        checked = RunAnnouncementSchema.model_validate(value, strict=True)
    except pydantic.ValidationError:
        return None
    return RunAnnouncement(**checked.model_dump(), announcer=PeerID(subkey).to_base58())


async def list_runs(dht: AsyncDHT) -> list[RunAnnouncement]:
    """The announced runs, most recent first (at most :data:`MAX_RUNS_LISTED`). Records not
    signed by their subkey's peer are dropped (this registers the run directory on ``dht``)."""
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
    ) -> AsyncIterator[AsyncRunAnnouncer]:
        if not (math.isfinite(expiration) and expiration > 0):
            raise ValueError("expiration must be positive")
        self = cls(dht, announcement, expiration)
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
                    if await announce_run(self.dht, self.announcement, self.expiration):
                        self.announcements += 1
            except Exception:
                logger.warning("could not announce run %s", self.announcement.run_id, exc_info=True)
            await trio.sleep(self.expiration / 3)
