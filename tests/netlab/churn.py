"""A churn soak (issue 18.4): training peers (``train_peer.py``) on a lab's public segment;
every ``period`` seconds one is SIGKILLed and a fresh one joins in its namespace and loads
the swarm's state. Used by ``tests/test_netlab_churn.py`` and ``benchmarks/benchmark_churn.py``.

``ChurnSoak(lab, mode="optimizer", peers=8, ...).run(duration)`` returns a ``SoakReport``:
per status poll the swarm's epoch and its peers' eval losses, every fault injected, status
answers that took longer than the round deadline (a hung round), peers with non-finite
parameters, and after the churn: the agreed last epoch, each survivor's rounds averaged /
alone, one synchronous state round (``train_peer.final_sync``) and the largest parameter
gap between survivors after it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .nat_swarm import LISTEN_ALL, TRAIN_SCRIPT
from .process import PeerProcess
from .topology import Host, Lab


@dataclass
class Member:
    """One peer process and where it is in its life: starting -> joining -> training."""

    name: str
    host: Host
    process: PeerProcess
    shard: int = 0  #: which of the ``peers`` data shards it trains on
    state: str = "starting"
    info: dict = field(default_factory=dict)
    joined_at: float = 0.0
    join_loaded: bool | None = None


@dataclass
class SoakReport:
    mode: str
    peers: int
    duration: float
    startup_seconds: float = 0.0
    polls: list[dict] = field(default_factory=list)  # {"t", "epoch", "losses", "finite"}
    faults: list[dict] = field(default_factory=list)  # {"t", "killed", "epoch", "joined"}
    joins: list[dict] = field(default_factory=list)  # {"name", "loaded", "epoch", "seconds"}
    postponed: int = 0  # seconds kills waited for newcomers to start
    slow_answers: list[dict] = field(default_factory=list)  # status later than the deadline
    non_finite: list[str] = field(default_factory=list)
    final_epoch: int = -1
    done: dict[str, dict] = field(default_factory=dict)  # survivor -> its "done" line
    synced: dict[str, object] = field(default_factory=dict)
    max_parameter_gap: float = float("nan")

    def summary(self) -> dict:
        first, last = self.polls[0], self.polls[-1]
        return {
            "mode": self.mode,
            "peers": self.peers,
            "duration": self.duration,
            "startup_seconds": round(self.startup_seconds, 1),
            "kills": len(self.faults),
            "kill_postponed_seconds": self.postponed,
            "joins_loaded_state": sum(bool(j["loaded"]) for j in self.joins),
            "joins": len(self.joins),
            "epochs": [first["epoch"], last["epoch"], self.final_epoch],
            "eval_loss_median_first_last": [
                round(statistics.median(first["losses"]), 4),
                round(statistics.median(last["losses"]), 4),
            ],
            "slow_answers": len(self.slow_answers),
            "non_finite": self.non_finite,
            "averaged_alone": {n: (d["averaged"], d["alone"]) for n, d in self.done.items()},
            "synced": self.synced,
            "max_parameter_gap": self.max_parameter_gap,
        }


class ChurnSoak:
    def __init__(
        self,
        lab: Lab,
        *,
        mode: str = "optimizer",
        peers: int = 8,
        period: float = 10.0,
        poll_every: float = 5.0,
        averaging_timeout: float = 30.0,
        train: dict | None = None,
        seed: int = 0,
        start_timeout: float = 180.0,
        on_event: Callable[[dict], None] | None = None,
        min_training: int | None = None,
    ):
        """``train``: extra keywords of ``train_peer``'s ``train`` command (``matchmaking_time``,
        ``target_batch_size``, ``inner_steps``); ``on_event``: called with each poll, fault and
        join as it happens (``{"poll": ...}``, ``{"fault": ...}``, ``{"join": ...}``);
        ``min_training``: kill only while at least this many peers train (default
        ``peers - 2``; a kill is postponed by a second while newcomers are still starting, so
        the swarm does not shrink on a machine where a newcomer takes longer than ``period``
        to start)."""
        self.lab, self.mode, self.peers = lab, mode, peers
        self.period, self.poll_every = period, poll_every
        self.averaging_timeout = averaging_timeout
        self.deadline = averaging_timeout + 15.0  # a status answer later than this: a hang
        self.train = dict(train or {})
        self.rng = random.Random(seed)
        self.start_timeout = start_timeout
        self.run_id = f"churn{os.getpid()}"
        self.hosts = [lab.add_public_host(f"c{i}") for i in range(peers)]
        self.members: list[Member] = []
        self._count = 0
        self._on_event = on_event or (lambda event: None)
        self.min_training = peers - 2 if min_training is None else min_training

    # ------------------------------------------------------------- members

    def _spawn(self, host: Host) -> Member:
        bootstrap = [m.info["boot"] for m in self.members if m.info.get("boot")]
        # a newcomer takes the shard its killed predecessor left (the lowest no member holds),
        # so every shard keeps one trainer: ``index % peers`` trained some shards twice and
        # left others untrained for the rest of the soak
        held = {m.shard for m in self.members}
        shard = min(s for s in range(self.peers) if s not in held)
        options = {
            "dht": {"host_maddrs": LISTEN_ALL, "initial_peers": bootstrap[:4]},
            "mode": self.mode,
            "index": shard,
            "peers": self.peers,
        }
        self._count += 1
        process = self.lab.spawn(host, TRAIN_SCRIPT, json.dumps(options))
        member = Member(f"p{self._count - 1}", host, process, shard=shard)
        self.members.append(member)
        return member

    def _ready(self, member: Member, timeout: float) -> None:
        info = member.process.recv(timeout)
        ip = member.host.ip
        info["boot"] = next(a for a in info["maddrs"] if f"/ip4/{ip}/" in a)
        member.info = info

    def _train_command(self, join: bool) -> dict:
        return {
            "op": "train",
            "seconds": 1e9,  # no "trained" line: the soak polls "status"
            "peers": self.peers,
            "run_id": self.run_id,
            "averaging_timeout": self.averaging_timeout,
            "join": join,
            **self.train,
        }

    def _kill(self, member: Member) -> None:
        os.kill(member.process.pid, signal.SIGKILL)
        member.process.close(timeout=10)
        self.members.remove(member)
        self.lab.processes.remove(member.process)

    def _advance_newcomers(self, report: SoakReport, now: float) -> None:
        for member in self.members:
            if member.state == "starting":
                try:
                    self._ready(member, 0.01)
                except TimeoutError:
                    continue
                member.process.send(self._train_command(join=True))
                member.state = "joining"
            elif member.state == "joining":
                try:
                    answer = member.process.recv(0.01)
                except TimeoutError:
                    continue
                member.state = "training"
                report.joins.append(
                    {
                        "name": member.name,
                        "loaded": answer["joined"],
                        "epoch": answer["epoch"],
                        "seconds": round(now - member.joined_at, 1),
                    }
                )
                self._on_event({"join": report.joins[-1]})

    def _ask_status(self) -> None:
        """Send ``status`` to every training peer; ``_collect_status`` gathers the answers (a
        peer answers between two of its steps, so a round in progress delays its answer)."""
        self._asked_at = time.monotonic()
        self._asked = [m for m in self.members if m.state == "training"]
        self._answers: dict[str, dict] = {}
        for member in self._asked:
            member.process.send({"op": "status"})

    def _collect_status(self, report: SoakReport, started: float, wait: bool = False) -> bool:
        """Read the answers that arrived (``wait``: all of them); True once the poll is
        complete (peers killed meanwhile are left out) and recorded in ``report.polls``."""
        for member in self._asked:
            if member not in self.members or member.name in self._answers:
                continue
            waited = time.monotonic() - self._asked_at
            if waited > self.deadline + 30:
                raise TimeoutError(f"{member.name} did not answer a status in {waited:.0f} s")
            try:
                answer = member.process.recv(self.deadline + 30 - waited if wait else 0.01)
            except TimeoutError:
                if wait:
                    raise
                continue
            late = time.monotonic() - self._asked_at
            if late > self.deadline:
                report.slow_answers.append({"name": member.name, "seconds": round(late, 1)})
            if not answer["finite"]:
                report.non_finite.append(member.name)
            self._answers[member.name] = answer
        alive = [m for m in self._asked if m in self.members]
        if any(m.name not in self._answers for m in alive):
            return False
        if not alive:  # every peer asked was killed meanwhile
            return True
        answers = [self._answers[m.name] for m in alive]
        report.polls.append(
            {
                "t": round(self._asked_at - started, 1),
                "answered_in": round(time.monotonic() - self._asked_at, 1),
                "epoch": max(a["epoch"] for a in answers),
                "epochs": [a["epoch"] for a in answers],
                "losses": [round(a["status"], 4) for a in answers],
                "finite": all(a["finite"] for a in answers),
            }
        )
        self._on_event({"poll": report.polls[-1]})
        return True

    # ------------------------------------------------------------- the soak

    def run(self, duration: float) -> SoakReport:
        report = SoakReport(self.mode, self.peers, duration)
        started = time.monotonic()
        first = self._spawn(self.hosts[0])
        self._ready(first, self.start_timeout)
        for host in self.hosts[1:]:
            self._spawn(host)
        for member in self.members[1:]:
            self._ready(member, self.start_timeout)
        for member in self.members:
            member.process.send({**self._train_command(join=False), "say_started": True})
        for member in self.members:
            member.process.recv(self.start_timeout)  # {"started": ...}: its first step is next
            member.state = "training"
        report.startup_seconds = time.monotonic() - started
        started = time.monotonic()
        next_kill, next_poll = started + self.period, started + self.poll_every
        self._ask_status()
        polling = True
        while time.monotonic() - started < duration or polling:
            now = time.monotonic()
            self._advance_newcomers(report, now)
            if polling and self._collect_status(report, started):
                polling = False
            if not polling and now >= next_poll and now - started < duration:
                self._ask_status()
                polling = True
                next_poll = now + self.poll_every
            victims = [m for m in self.members if m.state == "training"]
            if now >= next_kill and len(victims) < self.min_training:
                next_kill = now + 1.0  # newcomers are still starting: postpone the kill
                report.postponed += 1
            elif now >= next_kill and now - started < duration:
                victim = self.rng.choice(victims)
                epoch = report.polls[-1]["epoch"] if report.polls else None
                self._kill(victim)
                newcomer = self._spawn(victim.host)
                newcomer.joined_at = time.monotonic()
                report.faults.append(
                    {
                        "t": round(now - started, 1),
                        "killed": victim.name,
                        "epoch": epoch,
                        "joined": newcomer.name,
                    }
                )
                self._on_event({"fault": report.faults[-1]})
                next_kill += self.period
            time.sleep(0.02)
        self._finish(report, started)
        return report

    def _finish(self, report: SoakReport, started: float) -> None:
        wait_until = time.monotonic() + self.start_timeout
        while any(m.state != "training" for m in self.members):
            if time.monotonic() > wait_until:
                raise TimeoutError("a newcomer did not start training")
            self._advance_newcomers(report, time.monotonic())
            time.sleep(0.05)
        self._ask_status()
        self._collect_status(report, started, wait=True)
        report.final_epoch = report.polls[-1]["epoch"] + 1
        for member in self.members:
            member.process.send({"op": "finish", "epoch": report.final_epoch})
        until = time.monotonic() + self.deadline * 4 + 60  # one deadline for all of them
        for member in self.members:
            wait = max(until - time.monotonic(), 0.1)
            report.done[member.name] = member.process.recv(wait)
        donor = self.members[0].info["peer_id"]
        for member in self.members:
            member.process.send({"op": "sync", "donor": donor, "timeout": 60})
        params = {}
        for member in self.members:
            answer = member.process.recv(120)
            report.synced[member.name] = answer["synced"]
            params[member.name] = answer["params"]
        reference = params[self.members[0].name]
        report.max_parameter_gap = max(
            max(abs(a - b) for a, b in zip(reference, values, strict=True))
            for values in params.values()
        )
        for done in report.done.values():
            done.pop("params", None)
