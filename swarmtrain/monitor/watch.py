"""The monitor's loop: read the run directory, metrics and progress from the DHT every
``period`` seconds into a :class:`~swarmtrain.monitor.state.MonitorState` and hand the snapshot
to a :class:`~swarmtrain.monitor.http.DashboardServer` (``swarmtrain monitor`` runs both). With
a ``PubSub`` it also follows each run's metrics gossip (:mod:`swarmtrain.monitor.gossip`)."""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import trio

from swarmtrain.dht import AsyncDHT, PeerRecordValidator, get_dht_time
from swarmtrain.dht.owned_keys import PROGRESS_KEY_PATTERN
from swarmtrain.p2p.pubsub import PubSub

from .gossip import MetricsGossip, follow_metrics_gossip
from .http import DashboardServer
from .publisher import read_metrics
from .runs import list_runs
from .sinks import MetricsSink, SwarmPoint
from .state import MonitorState, PeerProgress

__all__ = ["read_progress", "refresh", "watch"]

logger = logging.getLogger(__name__)


async def read_progress(dht: AsyncDHT, run_id: str) -> list[PeerProgress]:
    """The valid progress records of ``run_id`` (see :mod:`swarmtrain.optim.progress_tracker`):
    each signed by the peer its subkey names (this registers the owned progress key on
    ``dht``'s node, which then drops the others)."""
    dht.add_validators([PeerRecordValidator([PROGRESS_KEY_PATTERN])])
    found = await dht.get(f"{run_id}_progress", latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    progress = []
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        # a record counts under the peer id it names (its subkey, signed by that peer's key)
        if not (isinstance(subkey, bytes) and isinstance(value, dict)):
            continue
        if value.get("peer_id") != subkey:
            continue
        parsed = _parse_progress(value)
        if parsed is not None:
            progress.append(parsed)
    return progress


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _parse_progress(value: Any) -> PeerProgress | None:
    """The fields the monitor uses from a progress record (``LocalProgressSchema`` of
    :mod:`swarmtrain.optim.progress_records`; read here without importing torch), or None."""
    if not isinstance(value, dict):
        return None
    epoch, samples, rate = (
        value.get("epoch"),
        value.get("samples_accumulated"),
        value.get("samples_per_second"),
    )
    if not (_count(epoch) and _count(samples) and isinstance(rate, float)):
        return None
    if not (math.isfinite(rate) and 0.0 <= rate <= 1e30):
        return None
    return PeerProgress(epoch, samples, rate)


async def refresh(dht: AsyncDHT, state: MonitorState, run_id: str | None) -> None:
    """One round of reads: the run directory (when following every run), then each run's
    metrics and progress. A failed read is logged and leaves the state as it was."""
    if run_id is not None:
        state.follow(run_id)  # first: announced runs cannot take its place
    try:
        runs = await list_runs(dht)
        state.on_runs(runs if run_id is None else [r for r in runs if r.run_id == run_id])
    except Exception:
        logger.warning("could not read the run directory", exc_info=True)
    for followed in state.run_ids():
        if run_id is not None and followed != run_id:
            continue
        try:
            state.on_metrics(followed, await read_metrics(dht, followed), get_dht_time())
            state.on_progress(followed, await read_progress(dht, followed))
        except Exception:
            logger.warning("could not read the metrics of %s", followed, exc_info=True)


def send_to_sinks(state: MonitorState, sinks: Sequence[MetricsSink], sent: dict[str, int]) -> None:
    """Each run's newest swarm point to every sink, once (``sent``: points sent per run). A
    failing sink is logged and does not stop the others."""
    for run_id in state.run_ids():
        latest = state.latest(run_id)
        if latest is None or sent.get(run_id) == latest[0]:
            continue
        sent[run_id] = latest[0]
        time, mean_loss, rate, alive = latest[1]
        eta = state.eta(run_id)
        point = SwarmPoint(run_id, time, latest[0], mean_loss, rate, alive, eta and eta[0])
        for sink in sinks:
            try:
                sink.log(point)
            except Exception:
                logger.warning("metrics sink %r failed", sink, exc_info=True)


async def watch(
    dht: AsyncDHT,
    state: MonitorState,
    server: DashboardServer | None,
    run_id: str | None = None,
    period: float = 2.0,
    sinks: Sequence[MetricsSink] = (),
    pubsub: PubSub | None = None,
) -> None:
    """Refresh every ``period`` seconds (each round bounded by ``4 * period``), forever; publish
    each snapshot to ``server`` and each new swarm point to ``sinks``. With ``pubsub``, each
    followed run's metrics gossip goes into ``state`` as it arrives (one subscription per run,
    at most ``state.max_runs``)."""
    sent: dict[str, int] = {}
    gossiped: set[str] = set()

    def on_record(followed: str, record: MetricsGossip) -> None:
        state.on_gossip(followed, record.subkey, record.metrics, record.expiration)

    def on_rejected() -> None:
        state.gossip_rejected += 1

    async with trio.open_nursery() as nursery:
        while True:
            with trio.move_on_after(4 * period):
                await refresh(dht, state, run_id)
            for followed in state.run_ids() if pubsub is not None else ():
                if followed not in gossiped and run_id in (None, followed):
                    gossiped.add(followed)
                    nursery.start_soon(
                        follow_metrics_gossip,
                        dht,
                        pubsub,
                        followed,
                        functools.partial(on_record, followed),
                        get_dht_time,
                        on_rejected,
                    )
            if server is not None:
                server.publish(json.dumps(state.snapshot(), separators=(",", ":")).encode())
            send_to_sinks(state, sinks, sent)
            await trio.sleep(period)
