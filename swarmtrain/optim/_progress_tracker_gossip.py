"""The gossip channel of ``AsyncProgressTracker`` (a mixin): publishing this peer's signed
progress record on the run's gossipsub topic and taking in the others', checked with the DHT's
validators. The attributes used here are set by ``AsyncProgressTracker``; its log records go
to the tracker's logger.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from swarmtrain.dht import (
    NO_SUBKEY,
    DHTRecord,
    DHTValueError,
    RecordValidatorBase,
    deserialize,
    get_dht_time,
    serialize,
)
from swarmtrain.p2p.pubsub import PubSub
from swarmtrain.proto.progress_pb2 import ProgressRecord

from ._progress_tracker_arrivals import ProgressArrivals
from .progress_records import _INVALID, _parse_progress
from .progress_types import LocalProgress

__all__ = ["ProgressGossipChannel"]

logger = logging.getLogger("swarmtrain.optim.progress_tracker")


class ProgressGossipChannel(ProgressArrivals):
    """``AsyncProgressTracker``'s gossip tasks: the publisher and the receiver."""

    # set by AsyncProgressTracker.__init__
    _key_bytes: bytes
    _subkey_bytes: bytes
    _validator: RecordValidatorBase
    _pubsub: PubSub | None
    _gossip_sent: int
    _gossip_received: int
    _gossip_rejected: int

    async def _gossip_loop(self) -> None:
        while True:
            now = get_dht_time()
            with self._lock:
                due = self._core.next_gossip_time(now)
                ready = due is not None and due <= now
                record = self._core.take_gossip(now) if ready else None
            if not ready:
                with trio.move_on_after(math.inf if due is None else due - now):
                    await self._changed.wait()
                continue
            if record is not None:
                await self._publish(record, now + self.config.metadata_expiration)

    async def _publish(self, record: LocalProgress | None, expiration: float) -> None:
        assert self._pubsub is not None
        value = serialize(None if record is None else record.to_dict())
        signed = self._validator.sign_value(
            DHTRecord(self._key_bytes, self._subkey_bytes, value, expiration)
        )
        message = ProgressRecord(
            subkey=self._subkey_bytes, value=signed, expiration_time=expiration
        )
        try:
            await self._pubsub.publish_protobuf(self.training_progress_key, message)
        except Exception:
            logger.warning("could not gossip progress of %s", self.prefix, exc_info=True)
            return
        self._gossip_sent += 1
        if record is not None and record.samples_accumulated == 0:
            logger.debug(
                "%s: gossiped epoch %d, %.2f s after its report",
                self.prefix,
                record.epoch,
                get_dht_time() - record.time,
            )

    async def _receive_loop(self, subscription: Any) -> None:
        async for message in subscription:
            self._on_gossip(message.message)

    def _on_gossip(self, message: ProgressRecord) -> None:
        now = get_dht_time()
        expiration = message.expiration_time
        if message.subkey == NO_SUBKEY or not math.isfinite(expiration) or expiration <= now:
            self._gossip_rejected += 1
            return
        record = DHTRecord(self._key_bytes, message.subkey, message.value, expiration)
        try:
            if not self._validator.validate(record):
                raise ValueError("rejected by the record validators")
            subkey = deserialize(message.subkey)
            value = deserialize(self._validator.strip_value(record), max_size=None)
        except (DHTValueError, ValueError, TypeError):
            self._gossip_rejected += 1
            logger.debug("invalid progress gossip on %s", self.prefix, exc_info=True)
            return
        parsed = _parse_progress(value)
        if parsed is _INVALID or not isinstance(subkey, bytes):
            self._gossip_rejected += 1
            return
        with self._lock:
            changed = self._core.on_gossip(subkey, parsed, expiration, now)  # type: ignore[arg-type]
        if changed:
            self._gossip_received += 1
            self._note_epoch(subkey, parsed, now, "gossip")  # type: ignore[arg-type]
            self._log_warnings(now)
            self._changed.notify()
