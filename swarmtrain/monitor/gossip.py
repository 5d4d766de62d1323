"""Metrics by gossip: the signed DHT record, pushed on gossipsub topic ``{run_id}_metrics``.

The same envelope and checks as the progress tracker's gossip: a
:class:`~swarmtrain.proto.progress_pb2.ProgressRecord` (subkey, signed value, expiration time)
carrying exactly what the publisher stores in the DHT, signed by the node's validators with the
host's identity key (:class:`~swarmtrain.dht.PeerRecordValidator`). A receiver checks it with its
DHT node's validators, as if it were a DHT record under ``{run_id}_metrics`` (the owned metrics
key pattern is registered first, so a record not signed by its subkey's peer is refused), then
with the metrics schema (:func:`~swarmtrain.monitor.metrics.parse_metrics`) and the record's
``peer_id`` against its subkey. Expired records and expirations beyond
:data:`MAX_GOSSIP_HORIZON` are refused too. The DHT stays the record: a lost message costs only
latency.

:func:`encode_metrics_gossip` / :func:`decode_metrics_gossip` are plain functions (no I/O);
:func:`follow_metrics_gossip` subscribes and hands each checked record to a callback (the
monitor's :class:`~swarmtrain.monitor.state.MonitorState`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import trio

from swarmtrain.dht import (
    NO_SUBKEY,
    AsyncDHT,
    DHTRecord,
    DHTValueError,
    RecordValidatorBase,
    deserialize,
    serialize,
)
from swarmtrain.p2p import PeerID
from swarmtrain.p2p.pubsub import PubSub
from swarmtrain.proto.progress_pb2 import ProgressRecord

from .metrics import LocalMetrics, metrics_key, parse_metrics

__all__ = [
    "MAX_GOSSIP_HORIZON",
    "MetricsGossip",
    "decode_metrics_gossip",
    "encode_metrics_gossip",
    "follow_metrics_gossip",
]

logger = logging.getLogger(__name__)

MAX_GOSSIP_HORIZON = 600.0  #: a gossiped record may expire at most this many seconds from now
MAX_GOSSIP_VALUE = 16384  #: bytes of a gossiped metrics value (a full record is ~3 KiB)
#: messages buffered per followed run before the oldest are dropped (times the pubsub's
#: ``max_message_size``, 256 KiB, bounds the memory a flood can take)
GOSSIP_BUFFER = 64


@dataclasses.dataclass(frozen=True)
class MetricsGossip:
    """A checked gossiped record: the peer id it is bound to, its metrics, its expiration."""

    subkey: bytes
    metrics: LocalMetrics
    expiration: float


def encode_metrics_gossip(
    validator: RecordValidatorBase, run_id: str, subkey: bytes, value: dict, expiration: float
) -> ProgressRecord:
    """The message for ``value`` (a metrics record's DHT value) under ``subkey`` (the
    publisher's peer id), signed by ``validator`` (the node's) like a DHT store."""
    key_bytes, subkey_bytes = serialize(metrics_key(run_id)), serialize(subkey)
    signed = validator.sign_value(DHTRecord(key_bytes, subkey_bytes, serialize(value), expiration))
    return ProgressRecord(subkey=subkey_bytes, value=signed, expiration_time=expiration)


def decode_metrics_gossip(
    validator: RecordValidatorBase, run_id: str, message: ProgressRecord, now: float
) -> MetricsGossip | None:
    """The checked record of ``message`` (see the module docstring), or None if any check
    fails. ``validator`` must know the owned metrics key pattern
    (:func:`~swarmtrain.monitor.publisher.add_metrics_validators`)."""
    expiration = message.expiration_time
    if message.subkey == NO_SUBKEY or not math.isfinite(expiration):
        return None
    if not now < expiration <= now + MAX_GOSSIP_HORIZON:
        return None
    if len(message.value) > MAX_GOSSIP_VALUE or len(message.subkey) > 128:
        return None
    record = DHTRecord(serialize(metrics_key(run_id)), message.subkey, message.value, expiration)
    try:
        if not validator.validate(record):
            return None
        subkey = deserialize(message.subkey)
        value = deserialize(validator.strip_value(record))
    except (DHTValueError, ValueError, TypeError):
        return None
    if not isinstance(subkey, bytes):
        return None
    metrics = parse_metrics(value)
    if metrics is None:
        return None
    try:
        if metrics.peer_id != PeerID(subkey).to_base58():
            return None
    except Exception:  # not a peer id
        return None
    return MetricsGossip(subkey, metrics, expiration)


async def follow_metrics_gossip(
    dht: AsyncDHT,
    pubsub: PubSub,
    run_id: str,
    on_record: Callable[[MetricsGossip], None],
    now: Callable[[], float],
    on_rejected: Callable[[], None] = lambda: None,
) -> None:
    """Receive ``run_id``'s metrics gossip until cancelled or the ``PubSub`` closes: each valid
    record goes to ``on_record``, each invalid one is dropped (``on_rejected``)."""
    from .publisher import add_metrics_validators

    add_metrics_validators(dht)
    validator = dht.node.record_validator
    subscription = await pubsub.subscribe(
        metrics_key(run_id), protobuf_type=ProgressRecord, buffer_size=GOSSIP_BUFFER
    )
    async with subscription:
        try:
            async for message in subscription:
                checked = (
                    None
                    if message.message is None
                    else decode_metrics_gossip(validator, run_id, message.message, now())
                )
                if checked is None:
                    on_rejected()
                else:
                    on_record(checked)
        except trio.EndOfChannel:
            pass
