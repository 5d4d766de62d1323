"""Progress records in the DHT: their key, pydantic schema, validators and parsing.

Each peer's record is a per-peer record (:mod:`swarmtrain.dht.peer_records`): its subkey is the
writer's peer id (``PeerID.to_bytes()``) and its value is signed with the libp2p identity key
behind that id, so one identity is one record and nobody writes, blanks or extends another
peer's record. The record's ``peer_id`` field must be its subkey (checked when reading, by
:class:`~swarmtrain.optim.progress_core.ProgressCore`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Any

import pydantic

from swarmtrain.dht import PeerRecordValidator
from swarmtrain.dht.owned_keys import PROGRESS_KEY_PATTERN

from .progress_types import GlobalProgress, LocalProgress
from .progress_votes import MAX_LISTED_PARTNERS, MAX_PEER_ID_BYTES

__all__ = [
    "PROGRESS_KEY_PATTERN",
    "LocalProgressSchema",
    "ProgressTrackerStatistics",
    "TrainingProgressSchema",
    "progress_key",
    "progress_record_validator",
]

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
    partners: Annotated[
        list[Annotated[bytes, pydantic.Field(min_length=1, max_length=MAX_PEER_ID_BYTES)]],
        pydantic.Field(max_length=MAX_LISTED_PARTNERS),
    ] = []


class TrainingProgressSchema(pydantic.BaseModel):
    """``{prefix}_progress``: ``{writer's peer id: record, or None once the peer left}``."""

    progress: dict[bytes, LocalProgressSchema | None]


def progress_key(prefix: str) -> str:
    """The DHT key of a run's progress records."""
    return f"{prefix}_progress"


def progress_record_validator() -> PeerRecordValidator:
    """What a node registers so that it refuses unsigned or foreign progress records (under
    every run's progress key): add it with ``dht.add_validators([...])``."""
    return PeerRecordValidator([PROGRESS_KEY_PATTERN])


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
    unbound_refused: int = 0  #: records whose ``peer_id`` field is not their signed subkey
    live_partners: int = 0  #: peers that averaged with us lately, with a live record
    unvouched_ahead: int = 0  #: records ahead of us whose votes did not count (no partners)
    unvouched_peers: int = 0  #: records whose samples and speed did not count (nobody vouched)
    #: times this peer, 2+ epochs behind its partners, followed them past its own vote: seconded
    #: by a peer known independently of them, or after it stalled behind them
    followed_seconded: int = 0
    followed_stalled: int = 0


def _parse_progress(value: Any) -> LocalProgress | object | None:
    """A record's value as a ``LocalProgress``, None (the peer left), or ``_INVALID``."""
    if value is None:
        return None
    try:
        checked = LocalProgressSchema.model_validate(value, strict=True)
        fields = checked.model_dump()
        return LocalProgress(**{**fields, "partners": tuple(fields["partners"])})
    except (pydantic.ValidationError, TypeError, ValueError):
        return _INVALID
