"""What the monitor knows about the runs it follows, in bounded memory (no I/O, no clock).

:class:`MonitorState` takes what the DHT returned (``on_runs``, ``on_metrics``,
``on_progress``) with the time it was read, and metrics records that arrived by gossip
(``on_gossip``: each peer's newest record wins, from either path), and gives a JSON-ready
:meth:`snapshot`. Memory is bounded: at most ``max_runs`` runs, ``max_peers`` peers per run
(the most recently heard; as many gossiped records), ``history`` points per run and
``peer_history`` per peer. A run's snapshot lists the newest
``max_failures`` failures and warnings of its alive peers (each peer's record carries at most
:data:`~swarmtrain.monitor.metrics.MAX_FAILURES`, checked by the schema).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .metrics import LocalMetrics
from .run_trust import OWNER, UNSIGNED, RunTrust
from .runs import RunAnnouncement

__all__ = ["MonitorState", "PeerProgress"]

MAX_OTHER_ANNOUNCERS = 8  #: other announcers of a run_id listed in a snapshot


@dataclass(frozen=True)
class PeerProgress:
    """The part of a peer's progress record the monitor uses."""

    epoch: int
    samples_accumulated: int
    samples_per_second: float


@dataclass
class _Run:
    history: deque  # (time, mean loss or None, total samples/s, alive peers)
    peers: dict[bytes, LocalMetrics] = field(default_factory=dict)
    peer_history: dict[bytes, deque] = field(default_factory=dict)  # (time, loss, samples/s)
    gossip: dict[bytes, tuple[LocalMetrics, float]] = field(default_factory=dict)  # + expiration
    progress: list[PeerProgress] = field(default_factory=list)
    announcement: RunAnnouncement | None = None
    trust: str = UNSIGNED  # the shown announcement's verdict (``run_trust``)
    others: list = field(default_factory=list)  # (announcement, verdict) of the other announcers
    last_update: float = -math.inf
    points: int = 0  # points ever appended to history


class MonitorState:
    """A snapshot lists each alive peer's latest record; per-peer curves stay here (bounded by
    ``peer_history``, see :meth:`peer_history_of`) so that each event stays small."""

    def __init__(
        self,
        *,
        max_runs: int = 16,
        max_peers: int = 512,
        history: int = 720,
        peer_history: int = 30,
        target_batch_size: int | None = None,
        max_failures: int = 32,
        trust: RunTrust | None = None,
    ):
        if min(max_runs, max_peers, history, peer_history, max_failures) < 1:
            raise ValueError(
                "max_runs, max_peers, history, peer_history and max_failures must be positive"
            )
        if target_batch_size is not None and target_batch_size < 1:
            raise ValueError("target_batch_size must be positive")
        self.max_runs, self.max_peers, self.history = max_runs, max_peers, history
        self.peer_history, self.max_failures = peer_history, max_failures
        self.target_batch_size = target_batch_size
        self._runs: dict[str, _Run] = {}
        self.trust = RunTrust() if trust is None else trust  #: owner keys pinned so far
        self.gossip_received = 0  #: gossiped records that were news
        self.gossip_rejected = 0  #: gossiped records that failed a check (counted by the caller)

    def run_ids(self) -> list[str]:
        return list(self._runs)

    def follow(self, run_id: str) -> bool:
        """Start following ``run_id``; False if ``max_runs`` runs are followed already."""
        if run_id in self._runs:
            return True
        if len(self._runs) >= self.max_runs:
            return False
        self._runs[run_id] = _Run(history=deque(maxlen=self.history))
        return True

    def on_runs(self, announcements: Iterable[RunAnnouncement]) -> None:
        """The run directory as read: follow new runs (up to ``max_runs``), keep their details.

        Trust (:class:`~swarmtrain.monitor.run_trust.RunTrust`): a ``run_id`` whose owner key
        is pinned shows its newest announcement signed by that key, and lists every other
        announcer of it as an impostor. Without a pin, a run's details come from the first peer
        seen announcing it, as long as that peer still announces it: another peer announcing
        the same ``run_id`` later does not replace them; among several new announcers, one
        that is among the run's own initial peers is preferred."""
        classified = self.trust.classify(announcements)
        classified.sort(key=lambda item: not item[0].announced_by_initial_peer)
        still_announced = {(a.run_id, a.announcer) for a, _ in classified}
        by_run: dict[str, list[tuple[RunAnnouncement, str]]] = {}
        for announcement, verdict in classified:
            by_run.setdefault(announcement.run_id, []).append((announcement, verdict))
        for run_id, listed in by_run.items():
            if not self.follow(run_id):
                continue
            run = self._runs[run_id]
            owned = [a for a, verdict in listed if verdict == OWNER]
            if owned:
                shown, run.trust = max(owned, key=lambda a: a.time), OWNER
            elif self.trust.pinned(run_id) is not None:
                shown, run.trust = None, OWNER  # only impostors announce it now
            else:
                current = run.announcement
                shown = current
                for announcement, _ in listed:
                    if (
                        shown is None
                        or (run_id, shown.announcer) not in still_announced
                        or (
                            announcement.announcer == shown.announcer
                            and announcement.time >= shown.time
                        )
                    ):
                        shown = announcement
                run.trust = dict((a.announcer, v) for a, v in listed).get(
                    shown.announcer if shown else "", UNSIGNED
                )
            run.announcement = shown
            run.others = [
                (a, verdict)
                for a, verdict in listed
                if shown is None or a.announcer != shown.announcer
            ][:MAX_OTHER_ANNOUNCERS]

    def on_gossip(self, run_id: str, owner: bytes, record: LocalMetrics, expiration: float) -> bool:
        """A record of ``owner`` (a peer id, checked by the caller) that arrived by gossip,
        valid until ``expiration``; whether it was news. It shows at once if it is newer than
        what the monitor has of that peer, and counts as alive at the next :meth:`on_metrics`
        until ``expiration``. At most ``max_peers`` gossiped records per run (the oldest go)."""
        if run_id not in self._runs:
            return False
        run = self._runs[run_id]
        gossiped = run.gossip.get(owner)
        for known in (gossiped and gossiped[0], run.peers.get(owner)):
            if known is not None and known.time >= record.time:
                return False
        if owner not in run.gossip and len(run.gossip) >= self.max_peers:
            oldest = min(run.gossip, key=lambda key: run.gossip[key][0].time)
            if run.gossip[oldest][0].time >= record.time:
                return False
            del run.gossip[oldest]
        run.gossip[owner] = (record, expiration)
        if owner in run.peers or len(run.peers) < self.max_peers:
            run.peers[owner] = record
        self.gossip_received += 1
        return True

    def on_metrics(self, run_id: str, metrics: Mapping[bytes, LocalMetrics], now: float) -> None:
        """A run's metrics as read at ``now`` (merged with live gossiped records, the newest
        record of each peer wins): the peers in it are the alive ones."""
        if not self.follow(run_id):
            return
        run = self._runs[run_id]
        merged = dict(metrics)
        for owner, (record, expiration) in list(run.gossip.items()):
            if expiration <= now:
                del run.gossip[owner]
            elif owner not in merged or merged[owner].time < record.time:
                merged[owner] = record
        newest = sorted(merged.items(), key=lambda item: item[1].time, reverse=True)
        run.peers = dict(newest[: self.max_peers])
        for owner in list(run.peer_history):
            if owner not in run.peers:
                del run.peer_history[owner]
        for owner, record in run.peers.items():
            points = run.peer_history.setdefault(owner, deque(maxlen=self.peer_history))
            if not points or points[-1][0] != record.time:
                points.append((record.time, record.loss, record.samples_per_second))
        losses = [m.loss for m in run.peers.values() if m.loss is not None]
        run.history.append(
            (
                now,
                sum(losses) / len(losses) if losses else None,
                sum(m.samples_per_second for m in run.peers.values()),
                len(run.peers),
            )
        )
        run.last_update = now
        run.points += 1

    def on_progress(self, run_id: str, progress: Iterable[PeerProgress]) -> None:
        if run_id in self._runs:
            self._runs[run_id].progress = list(progress)[: self.max_peers]

    def peer_history_of(self, run_id: str, peer: bytes) -> list[tuple]:
        """(time, loss, samples/s) of one peer's last ``peer_history`` records."""
        run = self._runs.get(run_id)
        return [] if run is None else list(run.peer_history.get(peer, ()))

    def latest(self, run_id: str) -> tuple[int, tuple] | None:
        """(number of points recorded so far, the last one) of a run's swarm curve, or None."""
        run = self._runs.get(run_id)
        if run is None or not run.history:
            return None
        return run.points, run.history[-1]

    def eta(self, run_id: str) -> tuple[int, int, float | None] | None:
        """(epoch, samples toward it, seconds to the next epoch or None) from the progress
        records, or None without them; the seconds need ``target_batch_size``."""
        run = self._runs.get(run_id)
        if run is None or not run.progress:
            return None
        epoch = max(p.epoch for p in run.progress)
        current = [p for p in run.progress if p.epoch == epoch]
        samples = sum(p.samples_accumulated for p in current)
        rate = sum(p.samples_per_second for p in run.progress)
        if self.target_batch_size is None or rate <= 0:
            return epoch, samples, None
        return epoch, samples, max(0.0, self.target_batch_size - samples) / rate

    def failures_of(self, run_id: str) -> list[dict[str, Any]]:
        """The newest ``max_failures`` failures and warnings of a run's alive peers, newest
        first: ``{"peer_id", "kind", "message", "time"}`` (plain text: escape it to show it)."""
        run = self._runs.get(run_id)
        if run is None:
            return []
        found = [
            (failure, record.peer_id)
            for record in run.peers.values()
            for failure in record.failures
        ]
        found.sort(key=lambda item: item[0].time, reverse=True)
        return [
            {"peer_id": peer_id} | failure.to_dict()
            for failure, peer_id in found[: self.max_failures]
        ]

    def snapshot(self) -> dict[str, Any]:
        """Everything the dashboard shows, as JSON-ready data."""
        runs = {}
        for run_id, run in self._runs.items():
            eta = self.eta(run_id)
            runs[run_id] = {
                "announcement": _announcement(run.announcement, run.trust),
                "other_announcers": [_announcement(a, verdict) for a, verdict in run.others],
                "history": [list(point) for point in run.history],
                "peers": [  # their failures are listed once, under "failures"
                    record.to_dict() | {"failures": len(record.failures)}
                    for record in sorted(run.peers.values(), key=lambda r: r.peer_id)
                ],
                "progress": None
                if eta is None
                else {
                    "epoch": eta[0],
                    "samples": eta[1],
                    "target_batch_size": self.target_batch_size,
                    "eta_seconds": eta[2],
                },
                "failures": self.failures_of(run_id),
                "last_update": None if math.isinf(run.last_update) else run.last_update,
            }
        gossip = {"received": self.gossip_received, "rejected": self.gossip_rejected}
        return {"runs": runs, "gossip": gossip}


def _announcement(run: RunAnnouncement | None, trust: str) -> dict[str, Any] | None:
    if run is None:
        return None
    return run.to_dict() | {
        "announcer": run.announcer,
        "announced_by_initial_peer": run.announced_by_initial_peer,
        "owner_key": run.owner_key,
        "trust": trust,
    }
