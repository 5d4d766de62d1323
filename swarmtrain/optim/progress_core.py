"""Sans-IO core of ``ProgressTracker``: per-peer progress records in, global progress out.

Nothing here reads a clock, touches the network or imports anyio: every method that depends on
time takes ``now`` (DHT time: wall-clock seconds, the clock the records carry). The tracker
(:mod:`swarmtrain.optim.progress_tracker`) feeds this core with what it fetched from the DHT and
what it heard over gossip, asks it when to store, gossip and fetch, and does the I/O.

Records. Every peer publishes a :class:`LocalProgress` under its own peer id (the subkey of a
per-peer record, signed with the identity key behind that id: the tracker passes this core
only records whose signature it verified, keyed by that peer id). One peer id is one record and
one vote: a record whose ``peer_id`` field is not the id it is stored under is refused (counted
in :attr:`ProgressCore.num_unbound_refused`), so claims made under many keys for one peer count
once at most, and never for another peer. A record is versioned by its DHT expiration time: it
replaces what we hold for its owner only if it does not expire earlier. A record whose
expiration passed is stale and forgotten; a ``None`` record says its owner left the run. Our own
record is never taken from the network: the local state is always newer.

Global progress (hivemind's semantics, made robust to a minority of lying peers):

- the global epoch is what a quorum vouches for: one vote per peer id, and once this peer has
  *round partners* (peers that averaged with it lately, :meth:`ProgressCore.on_round_partners`)
  only they vote (the rules: :mod:`swarmtrain.optim.progress_votes`). hivemind takes the
  largest epoch of any record, so one record claiming epoch 1e9 sent every peer into state
  downloads. A peer two or more epochs behind a quorum of its partners follows them past its
  own vote when a peer known independently of them agrees, or once it has been that far
  behind for :meth:`ProgressCore.stall_bound` (it stalled) and a quorum of everyone else
  agrees, at most as far as the time since it was in step makes plausible
  (:meth:`ProgressCore.plausible_lead`); its ``Optimizer`` then catches up (``_epoch_sync``:
  it loads the state);
- a record claiming an epoch more than one ahead of the global epoch is ignored (not counted
  at all) and reported once by :class:`ImplausibleProgress`; a peer one epoch ahead just
  stepped: it counts as a peer, its samples toward the next epoch, and the samples it
  accumulated in the global epoch before it stepped still count toward it (so that in a swarm
  of two, the peer that did not step yet sees the target reached as the other one did);
- a peer's samples count at most what ``max_rate_factor`` times the swarm's reference speed
  allows since it entered the epoch (see :mod:`swarmtrain.optim.progress_votes`); its reported
  samples/s is capped the same way for the ETA. A record whose samples exceed twice that bound
  is reported once;
- ``samples_accumulated`` sums those samples of the peers at the global epoch whose samples
  count: once this peer has partners, only the *vouched* peers' (its partners, trusted peers,
  the partners their records list, peers known from before; see
  :mod:`swarmtrain.optim.progress_votes`), so free identities claiming samples end no epoch;
- the ETA extrapolates each such peer's samples from its report time at its samples/s, and
  divides what remains of ``target_batch_size`` by the samples/s of those peers. (hivemind
  counts peers behind for speed too, "they will catch up"; but a peer behind is usually still
  averaging the last epoch, and counting its speed ended epochs at ~55-80% of the target on
  a loaded box. It counts from its first report in the current epoch.)
- the next DHT fetch comes after ``default_refresh_period`` when we see no other peer, else
  sooner the more peers may join before the epoch ends, and a slow read does not hold the next
  one back (up to ``MAX_FETCHES_IN_FLIGHT`` run at once; the schedule and its rules:
  :mod:`swarmtrain.optim.progress_fetch_schedule`, :meth:`ProgressCore.fetch_due`,
  :meth:`ProgressCore.on_fetch_started`, :meth:`ProgressCore.fetch_running`).

Records of dead peers (a killed run's, which never said goodbye): the owner of each non-client
record ahead of this peer (the peer id the record is bound to) is dialled once
(:meth:`ProgressCore.probes_due`, done by the tracker); a record whose owner cannot be reached
is ignored until its owner stores a newer one (see :mod:`swarmtrain.optim.progress_liveness`).

A peer publishes only while it is active: it reported samples during the global epoch or the
one before (hivemind's rule, so auxiliary peers that never accumulate samples stay out of the
counts). ``ready_to_update_epoch`` holds when the swarm is ahead of us, the target was reached,
or the ETA passed. A peer that sees nobody else and reaches the target first fetches once more
(at once): peers that start together publish their first records only with their first steps,
and a peer that ended epochs alone before seeing them would run ahead of its swarm.

Warnings are decisions, returned once each by :meth:`ProgressCore.warnings`:
:class:`ImplausibleProgress` (a peer's record was ignored or its samples capped, once per peer),
:class:`ClockSkewDetected` (a record's report time is far in our future, or a gossiped one,
which travels in milliseconds, far in our past), :class:`LonePeer` (no other peer for
``lone_peer_timeout`` seconds), :class:`TargetNotReached` (an epoch lasted ``stall_factor``
times the duration its first ETA promised, without reaching the target).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .progress_fetch_schedule import MAX_FETCHES_IN_FLIGHT, FetchSchedule, fetch_period
from .progress_liveness import OwnerCandidate, OwnerLiveness, Probe, ProbeOutcome
from .progress_types import (
    EPS,
    ClockSkewDetected,
    GlobalProgress,
    ImplausibleProgress,
    LocalProgress,
    LonePeer,
    PerformanceEMA,
    ProgressConfig,
    ProgressWarning,
    TargetNotReached,
)
from .progress_votes import (
    MIN_KNOWN_RATE,
    ProgressVotes,
    SampleCredits,
    reference_rate,
)

__all__ = ["MAX_FETCHES_IN_FLIGHT", "ProgressCore"]


@dataclass(frozen=True)
class _Record:
    progress: LocalProgress | None  # None: the peer left
    expiration_time: float


class ProgressCore:
    """The progress state machine (see the module docstring).

    :param peer_id: this peer's id, as bytes: the key of its record (records of others under it
      are ignored) and the ``peer_id`` field in it
    :param now: DHT time of creation; the first fetch is due at once
    """

    def __init__(
        self,
        config: ProgressConfig,
        *,
        peer_id: bytes,
        client_mode: bool,
        now: float,
    ):
        if not isinstance(peer_id, bytes) or not peer_id:
            raise ValueError("peer_id must be non-empty bytes")
        self.config = config
        self.local_key = peer_id  #: the key of this peer's record: its peer id
        self._ema = PerformanceEMA(config.performance_ema_alpha, now=now)
        self._local = LocalProgress(peer_id, 0, 0, self._ema.samples_per_second, now, client_mode)
        self._records: dict[bytes, _Record] = {}
        self._liveness = OwnerLiveness(config.probe_retry_period)
        self._credits = SampleCredits()
        self._trained = False  # this peer votes on the epoch once it trained
        self._epoch_witnessed = False  # we saw the global epoch begin (not joined it midway)
        self._local_epoch_started_at = now
        self._last_epoch_took: float | None = None  # our last epoch in step that ended with a step
        self._in_step_at = now  # the last recompute that did not find us behind our partners
        self._ignored: set[bytes] = set()  # keys whose records the last recompute ignored
        self._votes = ProgressVotes(
            peer_id,
            quorum_fraction=config.quorum_fraction,
            partner_window=config.partner_window,
            trusted_peers=config.trusted_peers,
        )
        self._implausible_warned: set[bytes] = set()
        self._last_active_epoch = -math.inf
        self._fetch_schedule = FetchSchedule(now)
        self._fetched_this_epoch = False
        self._alone_at_target_since: float | None = None  # see ``GlobalProgress.confirming_alone``
        self._num_fetches = self._num_merged = self._num_unbound = 0
        self._num_followed = {"seconded": 0, "stalled": 0}
        # publishing
        self._store_pending = self._gossip_pending = self._epoch_changed = False
        self._last_store_time = self._last_gossip_time = -math.inf
        self._has_published = False
        # warnings
        self._pending_warnings: list[ProgressWarning] = []
        self._skew_warned: set[bytes] = set()
        self._alone_since: float | None = None
        self._lone_warned = False
        self._epoch_started_at = now
        self._expected_epoch_duration: float | None = None
        self._stall_warned_epoch = -1
        self._global = GlobalProgress(0, 0, config.target_batch_size, 0, 0, math.inf, now)
        self._recompute(now, next_fetch_time=now)

    # ------------------------------------------------------------------ state

    @property
    def performance_ema(self) -> PerformanceEMA:
        """This peer's samples/s average (hivemind's ``ProgressTracker.performance_ema``)."""
        return self._ema

    @property
    def local_progress(self) -> LocalProgress:
        return self._local

    @property
    def global_progress(self) -> GlobalProgress:
        return self._global

    @property
    def last_fetch_time(self) -> float | None:
        """When the last DHT fetch (or failed attempt) ended; None before the first."""
        return self._fetch_schedule.last_end

    @property
    def fetches_in_flight(self) -> int:
        """DHT fetches started (:meth:`on_fetch_started`) and not ended yet."""
        return self._fetch_schedule.in_flight

    def fetch_running(self, fetch: int) -> bool:
        """Whether fetch ``fetch`` (from :meth:`on_fetch_started`) still counts. False once it
        ended, or once a fetch begun after it ended first (it is obsolete then: stop it)."""
        return self._fetch_schedule.running(fetch)

    def fetch_due(self, now: float) -> bool:
        """Whether to start a DHT fetch now: its time came and fewer than
        ``MAX_FETCHES_IN_FLIGHT`` are running. Report the start with :meth:`on_fetch_started`."""
        return self._fetch_schedule.due(now)

    def next_fetch_start(self, now: float) -> float:
        """DHT time at which the next fetch may start (inf while ``MAX_FETCHES_IN_FLIGHT`` run:
        then the end of one of them comes first)."""
        return self._fetch_schedule.next_start(now)

    @property
    def fetched_this_epoch(self) -> bool:
        """Whether the DHT was fetched since the last :meth:`update_epoch`."""
        return self._fetched_this_epoch

    @property
    def is_active(self) -> bool:
        """Whether this peer publishes its progress (see the module docstring)."""
        return self._last_active_epoch >= self._global.epoch - 1

    @property
    def has_published(self) -> bool:
        """Whether a record of ours was handed out for storing or gossip (then say goodbye)."""
        return self._has_published

    @property
    def num_fetches(self) -> int:
        return self._num_fetches

    @property
    def num_merged(self) -> int:
        """Records of other peers that replaced an older one we held (gossip and DHT)."""
        return self._num_merged

    @property
    def num_unbound_refused(self) -> int:
        """Records refused because their ``peer_id`` field was not the id they were stored
        under (a peer claiming to be another, or many peers)."""
        return self._num_unbound

    @property
    def num_live_partners(self) -> int:
        """Partners (see :meth:`on_round_partners`) with a live non-client record: while there
        is one, only partners vote on the epoch."""
        return len(self._votes.live_partners)

    @property
    def num_unvouched_ahead(self) -> int:
        """Live records ahead of this peer whose votes did not count at the last recompute:
        their owners are not partners of this peer, and it has partners."""
        return len(self._votes.unvouched)

    @property
    def num_followed_seconded(self) -> int:
        """Times this peer, two or more epochs behind a quorum of its partners, followed them
        past its own vote because a peer known independently of them was there too."""
        return self._num_followed["seconded"]

    @property
    def num_followed_stalled(self) -> int:
        """Times this peer followed its partners past its own vote after it had been behind
        them for the stall bound (:meth:`stall_bound`)."""
        return self._num_followed["stalled"]

    def epoch_duration(self) -> float:
        """How long an epoch lasts, as this peer saw: its last epoch that ended with a step to
        the next one while it was in step with its partners, else the duration the first ETA of
        the swarm's epoch promised (at least ``min_refresh_period``)."""
        took = self._last_epoch_took
        if took is None:
            took = self._expected_epoch_duration or 0.0
        return max(took, self.config.min_refresh_period)

    def stall_bound(self) -> float:
        """Seconds after which a peer that is two or more epochs behind its partners counts as
        stalled (and follows them without a witness; its own steps meanwhile do not restart
        the clock): ``stall_factor`` times :meth:`epoch_duration`, and at least
        ``min_stall_time`` (a floor that holds whatever samples and speeds peers claim)."""
        config = self.config
        return max(config.min_stall_time, config.stall_factor * self.epoch_duration())

    def plausible_lead(self, out_of_step: float) -> int:
        """How many epochs the swarm can have gone past ours ``out_of_step`` seconds after we
        entered our epoch (or last were in step with our partners, if earlier): one, plus one
        per ``1 / max_rate_factor`` of :meth:`epoch_duration` (a swarm that grew meanwhile is
        faster). A peer behind follows its partners at most this far (the rest when it looks
        again)."""
        rate = self.config.max_rate_factor / self.epoch_duration()
        return 1 + int(min(out_of_step * rate, 2**31))

    @property
    def num_unvouched_peers(self) -> int:
        """Live records whose samples and speed did not count at the last recompute: nobody
        this peer trusts vouches for their owners (see ``progress_votes``)."""
        return len(self._votes.unvouched_samples)

    def peers(self, now: float) -> dict[bytes, LocalProgress]:
        """Live records of the other peers, by peer id."""
        return {
            key: record.progress
            for key, record in self._records.items()
            if record.progress is not None
            and record.expiration_time > now
            and self._liveness.counts(key, record.expiration_time)
        }

    def ready_to_update_epoch(self, now: float) -> bool:
        """The swarm is ahead of us, reached the target, or its ETA passed (alone: confirmed by
        a fetch, ``GlobalProgress.confirming_alone``)."""
        progress = self._global
        return not progress.confirming_alone and (
            progress.epoch > self._local.epoch
            or progress.samples_accumulated >= self.config.target_batch_size
            or now >= progress.eta_next_epoch
        )

    def estimated_next_update_time(self, now: float) -> float:
        """DHT time at which this peer should move to the next epoch (``now`` if ready)."""
        return now if self.ready_to_update_epoch(now) else self._global.eta_next_epoch

    # ----------------------------------------------------------- local events

    def report_local_progress(
        self, epoch: int, samples_accumulated: int, now: float
    ) -> LocalProgress:
        """This peer is at ``epoch`` with ``samples_accumulated`` samples toward its target."""
        previous = self._local
        extra = samples_accumulated - (
            previous.samples_accumulated if epoch == previous.epoch else 0
        )
        if extra > 0:
            self._ema.update(extra, now)
        else:
            self._ema.reset_timer(now)  # progress was reset: the next interval starts now
        self._votes.prune(epoch)
        self._local = LocalProgress(
            previous.peer_id,
            epoch,
            samples_accumulated,
            self._ema.samples_per_second,
            now,
            previous.client_mode,
            self._votes.listed_partners(),
        )  # validates epoch and samples
        if samples_accumulated > 0:
            self._last_active_epoch = max(self._global.epoch, epoch)
            self._trained = True
        if epoch == previous.epoch + 1 and not self._votes.behind:  # not stepping alone behind
            self._last_epoch_took = now - self._local_epoch_started_at
        if epoch != previous.epoch:
            self._epoch_changed = True
            self._trained = True
            self._local_epoch_started_at = now
        self._store_pending = self._gossip_pending = True
        self._recompute(now)
        return self._local

    def announce(self, now: float) -> None:
        """Count as active in the current epoch without samples: publish the record now."""
        self._last_active_epoch = max(self._global.epoch, self._local.epoch)
        self._store_pending = self._gossip_pending = True
        self._recompute(now)

    def update_epoch(self, new_epoch: int | None, now: float) -> int:
        """Move to ``new_epoch`` (default: the next one) with no samples; returns it."""
        if new_epoch is None:
            new_epoch = self._local.epoch + 1
        self.report_local_progress(new_epoch, 0, now)
        self._fetched_this_epoch = False
        return new_epoch

    def pause(self, now: float) -> None:
        """Stop counting time for this peer's samples/s (while it averages, for example)."""
        self._ema.pause(now)

    def resume(self, now: float) -> None:
        self._ema.resume(now)

    # -------------------------------------------------------- network events

    def on_fetch_started(self, now: float) -> int:
        """A DHT fetch starts now; returns its number, for :meth:`on_fetch` or
        :meth:`on_fetch_failed` when it ends. The next one is due a period after this start if
        this one is still out then (else a period after it ended)."""
        number = self._fetch_schedule.start(now)
        self._recompute(now, started=True)
        return number

    def on_fetch(
        self,
        entries: Mapping[bytes, tuple[LocalProgress | None, float]],
        now: float,
        fetch: int | None = None,
    ) -> GlobalProgress:
        """A DHT fetch returned ``{peer id: (record or None, expiration_time)}``: the subkeys
        whose signatures the DHT verified; ``fetch``: its number from :meth:`on_fetch_started`.
        It and the fetches begun before it stop running (:meth:`fetch_running`)."""
        self._fetch_schedule.end(fetch, now)
        for key, (progress, expiration_time) in entries.items():
            self._merge(key, progress, expiration_time, now, gossiped=False)
        self._fetched_this_epoch = True
        self._num_fetches += 1
        self._recompute(now, fetched=True)
        if self.peers(now):
            self._alone_since, self._lone_warned = None, False
        elif self._alone_since is None:
            self._alone_since = now
        return self._global

    def on_fetch_failed(self, now: float, fetch: int | None = None) -> GlobalProgress:
        """A DHT fetch (number ``fetch``) failed: try again after ``default_refresh_period``."""
        # an attempt: gossip must not bring the retry forward (and, as before, it ends a
        # confirmation alone: the Optimizer would not wait for a DHT that fails)
        self._fetch_schedule.fail(fetch, now)
        self._recompute(now, next_fetch_time=now + self.config.default_refresh_period)
        return self._global

    def on_gossip(
        self, key: bytes, progress: LocalProgress | None, expiration_time: float, now: float
    ) -> bool:
        """A record signed by ``key`` (a peer id) arrived over gossip; returns whether it
        changed anything."""
        if not self._merge(key, progress, expiration_time, now, gossiped=True):
            return False
        self._recompute(now)
        if self.peers(now):
            self._alone_since, self._lone_warned = None, False
        return True

    def on_round_partners(self, peer_ids: Iterable[bytes], epoch: int, now: float) -> None:
        """This peer averaged with ``peer_ids`` in a round of ``epoch`` (gradients or state;
        the members that sent their parts and returned our deltas, by peer id): they become
        partners, whose votes for epochs ahead of ours count while our epoch is at most
        ``epoch + partner_window`` (see the module docstring)."""
        self._votes.on_round_partners(peer_ids, epoch)
        self._votes.prune(self._local.epoch)
        listed = self._votes.listed_partners()
        if listed != self._local.partners:  # publish whom we vouch for
            self._local = dataclasses.replace(self._local, partners=listed)
            self._store_pending = self._gossip_pending = True
        self._recompute(now)

    def probes_due(self, now: float) -> list[Probe]:
        """Owners of records ahead of us to dial now (see ``progress_liveness``); report each
        outcome with :meth:`on_probe_result`."""
        candidates = (  # nobody can dial a client; a record not ahead of us does not steer us
            OwnerCandidate(key, key, record.expiration_time)  # the id the record is bound to
            for key, record in self._records.items()
            if record.progress is not None
            and record.expiration_time > now
            and not record.progress.client_mode
            and record.progress.epoch > self._local.epoch
        )
        return self._liveness.due(candidates, now)

    def on_probe_result(self, probe: Probe, outcome: ProbeOutcome, now: float) -> bool:
        """A probe ended; returns whether the global progress was recomputed."""
        if not self._liveness.on_result(probe, outcome, now):
            return False
        self._recompute(now)
        return True

    @property
    def num_unreachable_ignored(self) -> int:
        """Records ignored now because their owner could not be dialled."""
        return self._liveness.ignored()

    def _merge(
        self,
        key: bytes,
        progress: LocalProgress | None,
        expiration_time: float,
        now: float,
        *,
        gossiped: bool,
    ) -> bool:
        if key == self.local_key or not math.isfinite(expiration_time):
            return False
        if progress is not None and progress.peer_id != key:
            self._num_unbound += 1  # it claims to be another peer than the one that signed it
            return False
        if expiration_time <= now:
            return False  # stale
        held = self._records.get(key)
        if held is not None and held.expiration_time > expiration_time:
            return False  # older than what we hold
        if held is not None and held == _Record(progress, expiration_time):
            return False
        if progress is not None:
            self._check_clock(progress, now, gossiped)
        self._credits.track(
            key,
            held.progress if held is not None else None,
            progress,
            now,
            global_epoch=self._global.epoch,
            epoch_started_at=self._epoch_started_at,
            witnessed=self._epoch_witnessed,
            target=self.config.target_batch_size,
        )
        self._records[key] = _Record(progress, expiration_time)
        self._num_merged += 1
        return True

    def _warn_implausible(self, key: bytes, warning: ImplausibleProgress) -> None:
        if key not in self._implausible_warned:
            self._implausible_warned.add(key)
            self._pending_warnings.append(warning)

    def _check_clock(self, progress: LocalProgress, now: float, gossiped: bool) -> None:
        offset = progress.time - now
        # a gossiped record left its owner at most gossip_period after its report time
        if gossiped and offset < 0:
            offset = min(0.0, offset + self.config.gossip_period)
        elif offset < 0:
            return  # a record from the DHT may be old: its age says nothing about clocks
        if abs(offset) <= self.config.max_clock_skew:
            return
        if progress.peer_id not in self._skew_warned:
            self._skew_warned.add(progress.peer_id)
            self._pending_warnings.append(ClockSkewDetected(progress.peer_id, offset))

    # ------------------------------------------------------------ publishing

    def next_store_time(self, now: float) -> float:
        """DHT time at which to call :meth:`take_store` (at once after a report)."""
        if self._store_pending:
            return now
        return self._last_store_time + self.config.metadata_expiration / 2

    def take_store(self, now: float) -> LocalProgress | None:
        """The record to store in the DHT now (None: this peer is not active)."""
        self._store_pending = False
        self._last_store_time = now
        if not self.is_active:
            return None
        self._has_published = True
        return self._local

    def next_gossip_time(self, now: float) -> float | None:
        """DHT time at which to call :meth:`take_gossip`; None if there is nothing to say."""
        if not self._gossip_pending:
            return None
        if self._epoch_changed:
            return now
        return max(now, self._last_gossip_time + self.config.gossip_period)

    def take_gossip(self, now: float) -> LocalProgress | None:
        """The record to gossip now (None: nothing new, or this peer is not active)."""
        pending = self._gossip_pending
        self._gossip_pending = self._epoch_changed = False
        self._last_gossip_time = now
        if not (pending and self.is_active):
            return None
        self._has_published = True
        return self._local

    # --------------------------------------------------------------- warnings

    def warnings(self, now: float) -> list[ProgressWarning]:
        """Warnings not returned before (each condition is reported once)."""
        found, self._pending_warnings = self._pending_warnings, []
        alone_since = self._alone_since
        if (
            alone_since is not None
            and not self._lone_warned
            and now - alone_since >= self.config.lone_peer_timeout
        ):
            self._lone_warned = True
            found.append(LonePeer(self._global.epoch, now - alone_since))
        progress, expected = self._global, self._expected_epoch_duration
        waited = now - self._epoch_started_at
        if (
            expected is not None
            and self._stall_warned_epoch != progress.epoch
            and progress.samples_accumulated < progress.target_batch_size
            and waited > self.config.stall_factor * max(expected, self.config.min_refresh_period)
            and waited > self.config.min_stall_time
        ):
            self._stall_warned_epoch = progress.epoch
            found.append(
                TargetNotReached(
                    progress.epoch,
                    progress.samples_accumulated,
                    progress.target_batch_size,
                    waited,
                    expected,
                )
            )
        return found

    # ------------------------------------------------------------------ math

    def _recompute(
        self,
        now: float,
        *,
        fetched: bool = False,
        started: bool = False,
        next_fetch_time: float | None = None,
    ) -> None:
        config = self.config
        self._records = {
            key: record for key, record in self._records.items() if record.expiration_time > now
        }
        self._liveness.prune(
            {k: r.expiration_time for k, r in self._records.items() if r.progress is not None}
        )
        self._votes.prune(self._local.epoch)
        live = {
            key: record.progress
            for key, record in self._records.items()
            if record.progress is not None and self._liveness.counts(key, record.expiration_time)
        }
        self._credits.keep_only(live)
        # if our partners are 2+ epochs ahead now, we have been behind since the last recompute
        # that found us in step (a stalled box recomputes nothing: the stall counts)
        behind_for = max(0.0, now - self._in_step_at)
        epoch = self._votes.tally(
            live,
            self._local.epoch,
            trained=self._trained,
            stalled=behind_for >= self.stall_bound(),
            max_lead=self.plausible_lead(max(now - self._local_epoch_started_at, behind_for)),
        )
        if not self._votes.behind:
            self._in_step_at = now
        if epoch != self._global.epoch and self._votes.followed is not None:
            self._num_followed[self._votes.followed] += 1
        self._ignored = {key for key, peer in live.items() if peer.epoch > epoch + 1}
        for key in self._ignored:
            peer = live[key]
            self._warn_implausible(
                key,
                ImplausibleProgress(peer.peer_id, key, peer.epoch, peer.samples_accumulated, epoch),
            )
        others = {key: peer for key, peer in live.items() if key not in self._ignored}
        active_self = self._last_active_epoch >= epoch - 1
        participants = [*others.values(), self._local] if active_self else list(others.values())
        if epoch == self._global.epoch + 1 and not self._epoch_witnessed:
            self._epoch_witnessed = True  # from now on, no peer's samples are taken on trust
            self._credits.on_epoch_witnessed()
        # with partners, they set the reference speed: a majority of free identities would
        # otherwise set the median, and with it the cap on their own claims
        reference = [p for k, p in others.items() if k in self._votes.live_partners]
        max_rate = config.max_rate_factor * reference_rate(
            reference or list(others.values()),
            self._local,
            trained=self._trained,
            local_epoch_took=max(0.0, now - self._local_epoch_started_at),
        )

        samples, estimated, rate = 0.0, 0.0, 0.0
        if active_self and self._local.epoch == epoch:  # our own samples are not in doubt
            local = self._local
            rate += local.samples_per_second
            samples += local.samples_accumulated
            elapsed = max(0.0, now - local.time)
            estimated += local.samples_accumulated + elapsed * local.samples_per_second
        vouched = self._votes.vouched  # None: every record's samples count
        for key, peer in others.items():
            counts = vouched is None or key in vouched
            carry = self._credits.carries.get(key)
            if peer.epoch == epoch + 1 and carry is not None and carry.credit.epoch == epoch:
                if not counts:
                    continue
                bound = carry.credit.bound(max_rate, carry.left_at)
                samples += min(carry.samples, bound)
                estimated += min(carry.samples, bound)
                continue
            if peer.epoch != epoch:
                continue
            credit = self._credits.credits.get(key)
            bound = math.inf if credit is None else credit.bound(max_rate, now)
            if peer.samples_accumulated > 2 * bound:
                allowed = int(bound)
                self._warn_implausible(
                    key,
                    ImplausibleProgress(
                        peer.peer_id, key, peer.epoch, peer.samples_accumulated, epoch, allowed
                    ),
                )  # reported even when nobody vouches for it: the claim is a lie either way
            if not counts:
                continue
            peer_rate = min(peer.samples_per_second, max_rate)
            rate += peer_rate
            samples += min(peer.samples_accumulated, bound)
            elapsed = max(0.0, now - peer.time)
            estimated += min(peer.samples_accumulated + elapsed * peer_rate, bound)
        samples = int(samples)
        eta = max(0.0, config.target_batch_size - estimated) / (rate + EPS)

        num_peers = len(participants)
        # alone at the target: confirm with a fetch begun after we got there (a peer that
        # started with the others has not seen their first reports yet, and would otherwise
        # run epochs alone ahead of them)
        at_target = not others and (samples >= config.target_batch_size or eta <= 0)
        if not at_target or epoch != self._global.epoch:
            self._alone_at_target_since = None
        if at_target and self._alone_at_target_since is None:
            self._alone_at_target_since = now
        alone_since = self._alone_at_target_since or now
        # a fetch begun before we got there does not confirm
        confirming_alone = at_target and self._fetch_schedule.no_result_since(alone_since)
        next_fetch_time = self._fetch_schedule.reschedule(
            now,
            fetch_period(config, eta, num_peers, alone=not others),
            fetched=fetched,
            started=started,
            at=next_fetch_time,
            confirm_since=alone_since if confirming_alone else None,
        )

        if epoch != self._global.epoch:
            self._epoch_started_at, self._expected_epoch_duration = now, None
        if self._expected_epoch_duration is None and rate >= MIN_KNOWN_RATE:
            self._expected_epoch_duration = now + eta - self._epoch_started_at

        self._global = GlobalProgress(
            epoch=epoch,
            samples_accumulated=samples,
            target_batch_size=config.target_batch_size,
            num_peers=num_peers,
            num_clients=sum(peer.client_mode for peer in participants),
            eta_next_epoch=now + eta,
            next_fetch_time=next_fetch_time,
            samples_per_second=rate,
            confirming_alone=confirming_alone,
        )
