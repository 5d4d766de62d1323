"""Progress records in the DHT: their pydantic schema, validators and parsing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Any

import pydantic

from swarmtrain.dht import (
    BytesWithPublicKey,
)

from .progress_core import (
    GlobalProgress,
    LocalProgress,
)

logger = logging.getLogger(__name__)
_INVALID = object()  # a record that does not match the schema

_NonNegativeInt = Annotated[int, pydantic.Field(ge=0)]


class LocalProgressSchema(pydantic.BaseModel):
    """One peer's progress record in the DHT (:meth:`LocalProgress.to_dict`)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    peer_id: bytes
    epoch: _NonNegativeInt
    samples_accumulated: _NonNegativeInt
    samples_per_second: Annotated[float, pydantic.Field(ge=0.0, allow_inf_nan=False)]
    time: Annotated[float, pydantic.Field(allow_inf_nan=False)]
    client_mode: bool


class TrainingProgressSchema(pydantic.BaseModel):
    """``{prefix}_progress``: ``{owner marker: record, or None once the peer left}``."""

    progress: dict[BytesWithPublicKey, LocalProgressSchema | None]


@dataclass(frozen=True)
class ProgressTrackerStatistics:
    """A snapshot of a tracker."""

    global_progress: GlobalProgress
    local_progress: LocalProgress
    num_peers_seen: int  #: live records of other peers
    fetches: int
    fetch_failures: int
    stores: int
    store_failures: int
    gossip_sent: int
    gossip_received: int  #: valid gossip records that were news to us
    gossip_rejected: int  #: invalid gossip (bad signature or schema, stale, undecodable)
    unreachable_ignored: int = 0  #: records ignored: their owner could not be dialled


def _parse_progress(value: Any) -> LocalProgress | object | None:
    """A record's value as a ``LocalProgress``, None (the peer left), or ``_INVALID``."""
    if value is None:
        return None
    try:
        checked = LocalProgressSchema.model_validate(value, strict=True)
        return LocalProgress(**checked.model_dump())
    except (pydantic.ValidationError, TypeError, ValueError):
        return _INVALID
