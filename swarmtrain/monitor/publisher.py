"""``MetricsPublisher``: a trainer's metrics, stored in the DHT at a bounded rate.

::

    async with DHT.create(initial_peers=[...]) as dht:
        async with AsyncMetricsPublisher.create(dht, "my_run", min_interval=5.0) as publisher:
            for step, batch in enumerate(data):
                loss = train_step(batch)
                publisher.report(loss=loss, step=step, epoch=opt.local_epoch)  # never blocks
                publisher.report_failure("data_loader", "a shard was unreadable")  # optional

Plain (blocking) code uses ``MetricsPublisher(dht, "my_run")`` over a blocking
:class:`~swarmtrain.dht.DHT`: the same object on swarmtrain's background trio loop, and its
``report`` is a plain call from the training thread.

Resource handling: ``create`` adds the metrics schema and the owned metrics key pattern to the
DHT node (validators stay registered), then runs one store task in a task group owned by the
publisher. The record's subkey is this host's peer id; the node signs it with the host's
identity key, and other nodes refuse a record under a peer id whose key did not sign it.
With ``pubsub`` each stored record is also gossiped, signed the same way
(:mod:`swarmtrain.monitor.gossip`). With ``capture_warnings`` (the default) it also installs a
:class:`~swarmtrain.monitor.failures.FailureLogHandler`: the run's ``SwarmHealth`` and progress
warnings logged in this process go into the record's recent failures (the newest
:data:`~swarmtrain.monitor.metrics.MAX_FAILURES`). Leaving the ``async with`` stops it; the
last record expires ``expiration`` seconds after it was stored. The DHT stays open.

Error handling: ``report`` raises ``ValueError`` / ``TypeError`` on a bad value (NaN loss, a
negative rate, an oversized map) and keeps the previous values; a failed store is logged and
counted (``statistics().store_failures``) and retried at the next interval.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

import swarmtrain
from swarmtrain.dht import (
    DHT,
    AsyncDHT,
    PeerRecordValidator,
    SchemaValidator,
    get_dht_time,
)
from swarmtrain.dht.node import DHTNode
from swarmtrain.dht.owned_keys import METRICS_KEY_PATTERN
from swarmtrain.p2p import PeerID
from swarmtrain.p2p.pubsub import PubSub
from swarmtrain.utils.background import BackgroundService
from swarmtrain.utils.change_signal import ChangeSignal

from .failures import FailureLogHandler, RecentFailures
from .gossip import encode_metrics_gossip
from .metrics import LocalMetrics, MetricsSchema, PublishSchedule, metrics_key, parse_metrics

__all__ = [
    "AsyncMetricsPublisher",
    "MetricsPublisher",
    "MetricsPublisherStatistics",
    "read_metrics",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MetricsPublisherStatistics:
    reports: int  #: accepted ``report`` calls
    stores: int  #: records stored (at most one per ``min_interval``)
    store_failures: int
    last_stored: LocalMetrics | None
    gossip_sent: int = 0  #: records also pushed by gossip (with ``pubsub=``)


def add_metrics_validators(dht: AsyncDHT, run_id: str | None = None) -> None:
    """Register the owned metrics key pattern (every run's ``{run_id}_metrics``) on ``dht``'s
    node and, with ``run_id``, that run's metrics schema."""
    validators: list = [PeerRecordValidator([METRICS_KEY_PATTERN])]
    if run_id is not None:
        metrics_key(run_id)  # checks run_id
        validators.append(SchemaValidator(MetricsSchema, prefix=run_id))
    dht.add_validators(validators)


def _reachability(dht: AsyncDHT) -> str:
    p2p = dht.p2p
    verdict = p2p.reachability.value
    relay = getattr(p2p, "relay", None)
    if verdict != "public" and relay is not None and relay.circuit_addrs():
        return "relayed"
    return verdict


class AsyncMetricsPublisher:
    """Publishes this peer's :class:`LocalMetrics` under ``{run_id}_metrics`` (module docstring)."""

    def __init__(
        self,
        dht: AsyncDHT,
        run_id: str,
        schedule: PublishSchedule,
        base: LocalMetrics,
        expiration: float,
        pubsub: PubSub | None = None,
    ):
        self.dht, self.run_id, self.key = dht, run_id, metrics_key(run_id)
        self.subkey: bytes = dht.peer_id.to_bytes()  #: this peer's id, its record's subkey
        self.expiration = expiration
        self._schedule, self._current = schedule, base
        self._lock = threading.Lock()
        self._changed = ChangeSignal()
        self._reports = self._stores = self._store_failures = 0
        self._failures = RecentFailures()
        self.pubsub = pubsub  #: where records are also gossiped (None: the DHT only)
        self._gossip_sent = 0

    @classmethod
    @asynccontextmanager
    async def create(
        cls,
        dht: AsyncDHT,
        run_id: str,
        *,
        min_interval: float = 5.0,
        expiration: float | None = None,
        role: str | None = None,
        capture_warnings: bool = True,
        pubsub: PubSub | None = None,
    ) -> AsyncIterator[AsyncMetricsPublisher]:
        """Start publishing. ``min_interval``: at most one store per this many seconds.
        ``expiration`` (default ``max(60, 3 * min_interval)``): how long a record lives; it is
        re-stored every ``expiration / 2`` while the publisher runs. ``role`` defaults to
        ``"client"`` or ``"node"`` from the DHT's mode (pass ``"aux"`` for auxiliary peers).
        ``capture_warnings``: publish the run's ``SwarmHealth`` and progress warnings logged in
        this process as recent failures (see the module docstring). ``pubsub``: also push each
        stored record on gossipsub topic ``{run_id}_metrics`` (share the host's ``PubSub``,
        e.g. ``tracker.pubsub``; a host runs at most one), so a monitor sees it at once."""
        if expiration is None:
            expiration = max(60.0, 3 * min_interval)
        if not (math.isfinite(expiration) and expiration > 0):
            raise ValueError("expiration must be positive")
        schedule = PublishSchedule(min_interval, max(min_interval, expiration / 2))
        add_metrics_validators(dht, run_id)
        if role is None:
            role = "client" if dht.client_mode else "node"
        base = LocalMetrics(
            peer_id=dht.peer_id.to_base58(),
            time=get_dht_time(),
            role=role,
            reachability=_reachability(dht),
            version=swarmtrain.__version__,
        )
        self = cls(dht, run_id, schedule, base, expiration, pubsub)
        handler = FailureLogHandler(run_id, self.report_failure) if capture_warnings else None
        if handler is not None:
            handler.install()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._store_loop)
                try:
                    yield self
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if handler is not None:
                handler.uninstall()

    def report(
        self,
        *,
        loss: float | None = None,
        step: int | None = None,
        epoch: int | None = None,
        samples_per_second: float | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> None:
        """Record new values (those passed; the others keep their last value) for the next
        store. Never blocks; callable from any thread. :raises ValueError, TypeError: a bad
        value (nothing is changed)"""
        changes: dict[str, Any] = {}
        for name, value in (
            ("loss", loss),
            ("step", step),
            ("epoch", epoch),
            ("samples_per_second", samples_per_second),
            ("extra", extra),
        ):
            if value is not None:
                changes[name] = value
        with self._lock:
            updated = dataclasses.replace(self._current, **changes)  # validates
            self._current = updated
            self._schedule.offer(updated)
            self._reports += 1
        self._changed.notify_threadsafe()

    def report_failure(self, kind: str, message: str) -> None:
        """Add a failure or warning (``kind``: lowercase letters, digits, ``_``, e.g. one of
        :data:`~swarmtrain.monitor.metrics.FAILURE_KINDS`) to the next record; only the newest
        :data:`~swarmtrain.monitor.metrics.MAX_FAILURES` are kept, ``message`` is cut to
        :data:`~swarmtrain.monitor.metrics.MAX_FAILURE_MESSAGE` characters. Never blocks;
        callable from any thread. :raises ValueError: a malformed ``kind``"""
        now = get_dht_time()
        with self._lock:
            self._failures.add(kind, message, now)
            updated = dataclasses.replace(self._current, failures=self._failures.items())
            self._current = updated
            self._schedule.offer(updated)
        self._changed.notify_threadsafe()

    def statistics(self) -> MetricsPublisherStatistics:
        with self._lock:
            return MetricsPublisherStatistics(
                reports=self._reports,
                stores=self._stores,
                store_failures=self._store_failures,
                last_stored=self._schedule.last_stored,
                gossip_sent=self._gossip_sent,
            )

    async def _store_loop(self) -> None:
        while True:
            now = get_dht_time()
            with self._lock:
                due = self._schedule.next_store_time()
                record = self._schedule.take(now) if due <= now else None
            if record is None:
                changed = self._changed.current()
                with trio.move_on_after(min(due - now, self.expiration)):
                    await changed.wait()
                continue
            record = dataclasses.replace(record, reachability=_reachability(self.dht))
            stored = False
            try:
                with trio.move_on_after(self.expiration / 2):
                    stored = await self.dht.store(
                        self.key,
                        record.to_dict(),
                        now + self.expiration,
                        subkey=self.subkey,
                    )
            except Exception:
                logger.warning("could not store metrics of %s", self.run_id, exc_info=True)
            with self._lock:
                if stored:
                    self._stores += 1
                else:
                    self._store_failures += 1
            if self.pubsub is not None:
                await self._gossip(record, now + self.expiration)

    async def _gossip(self, record: LocalMetrics, expiration: float) -> None:
        assert self.pubsub is not None
        message = encode_metrics_gossip(
            self.dht.node.record_validator, self.run_id, self.subkey, record.to_dict(), expiration
        )
        try:
            await self.pubsub.publish_protobuf(self.key, message)
        except Exception:
            logger.warning("could not gossip metrics of %s", self.run_id, exc_info=True)
            return
        with self._lock:
            self._gossip_sent += 1


async def read_metrics(dht: AsyncDHT, run_id: str) -> dict[bytes, LocalMetrics]:
    """The latest metrics of each peer of ``run_id``, by peer id (``PeerID.to_bytes()``, the
    record's subkey). Records not signed by their subkey's peer are dropped by this node (this
    registers the owned metrics key on it), and so are records that do not match the schema or
    whose ``peer_id`` names another peer.
    From blocking code: ``dht.run_coroutine(lambda d, _: read_metrics(d, run_id))``."""
    add_metrics_validators(dht)
    found = await dht.get(metrics_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    result: dict[bytes, LocalMetrics] = {}
    for subkey, item in found.value.items():
        if not isinstance(subkey, bytes) or not subkey:
            continue
        parsed = parse_metrics(getattr(item, "value", None))
        if parsed is not None and parsed.peer_id == PeerID(subkey).to_base58():
            result[subkey] = parsed
    return result


class MetricsPublisher(BackgroundService):
    """:class:`AsyncMetricsPublisher` for plain (blocking) code over a blocking ``DHT``:
    ``MetricsPublisher(dht, run_id, min_interval=5.0)``; ``report(...)`` never blocks.
    Call :meth:`shutdown` (or use ``with``) when done."""

    _service_name = "this MetricsPublisher"

    def __init__(self, dht: DHT, run_id: str, *, start: bool = True, **kwargs: Any):
        self.dht, self.run_id, self._kwargs = dht, run_id, kwargs
        if start:
            self.start()

    create = AsyncMetricsPublisher.create  #: the trio way in

    def start(self) -> None:
        async def get_async_dht(async_dht: AsyncDHT, node: DHTNode) -> AsyncDHT:
            return async_dht

        async_dht = self.dht.run_coroutine(get_async_dht)
        self._start_in_background(
            lambda: AsyncMetricsPublisher.create(async_dht, self.run_id, **self._kwargs)
        )

    def report(self, **values: Any) -> None:
        """See :meth:`AsyncMetricsPublisher.report`."""
        self._running()[1].report(**values)

    def report_failure(self, kind: str, message: str) -> None:
        """See :meth:`AsyncMetricsPublisher.report_failure`."""
        self._running()[1].report_failure(kind, message)

    def statistics(self) -> MetricsPublisherStatistics:
        return self._running()[1].statistics()
