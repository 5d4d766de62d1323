"""Sans-IO core of ``ProgressTracker``: per-peer progress records in, global progress out.

Nothing here reads a clock, touches the network or imports anyio: every method that depends on
time takes ``now`` (DHT time: wall-clock seconds, the clock the records carry). The tracker
(:mod:`swarmtrain.optim.progress_tracker`) feeds this core with what it fetched from the DHT and
what it heard over gossip, asks it when to store, gossip and fetch, and does the I/O.

It composes one part per job: the records it holds (:mod:`swarmtrain.optim.progress_record_book`:
one record and one vote per peer id, versioned by expiration time), the votes and plausibility
caps (:mod:`swarmtrain.optim.progress_votes`), the ETA (:mod:`swarmtrain.optim.progress_eta`),
when to fetch (:mod:`swarmtrain.optim.progress_fetch_schedule`), when to store and gossip our
record (:mod:`swarmtrain.optim.progress_publish`), the owners to dial
(:mod:`swarmtrain.optim.progress_liveness`) and the warnings
(:mod:`swarmtrain.optim.progress_warnings`).

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
  divides what remains of ``target_batch_size`` by the samples/s of those peers (not those
  behind: see :mod:`swarmtrain.optim.progress_eta`). It counts from its first report in the
  current epoch.
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

Warnings are decisions, returned once each by :meth:`ProgressCore.warnings` (see
:mod:`swarmtrain.optim.progress_warnings`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from .progress_eta import estimate_epoch
from .progress_fetch_schedule import MAX_FETCHES_IN_FLIGHT, FetchSchedule, fetch_period
from .progress_liveness import OwnerCandidate, OwnerLiveness, Probe, ProbeOutcome
from .progress_publish import PublishSchedule
from .progress_record_book import RecordBook
from .progress_types import (
    GlobalProgress,
    ImplausibleProgress,
    LocalProgress,
    PerformanceEMA,
    ProgressConfig,
    ProgressWarning,
)
from .progress_votes import (
    MIN_KNOWN_RATE,
    ProgressVotes,
    SampleCredits,
    reference_rate,
)
from .progress_warnings import ProgressWarnings

__all__ = ["MAX_FETCHES_IN_FLIGHT", "ProgressCore"]


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
        self._book = RecordBook(peer_id)
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
        self._last_active_epoch = -math.inf
        self._fetch_schedule = FetchSchedule(now)
        self._fetched_this_epoch = False
        self._alone_at_target_since: float | None = None  # see ``GlobalProgress.confirming_alone``
        self._num_fetches = 0
        self._num_followed = {"seconded": 0, "stalled": 0}
        self._publish = PublishSchedule(config.metadata_expiration / 2, config.gossip_period)
        self._warnings = ProgressWarnings(config)
        self._epoch_started_at = now  # when the global epoch began (our clock)
        self._expected_epoch_duration: float | None = None  # what its first ETA promised
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
        return self._publish.has_published

    @property
    def num_fetches(self) -> int:
        return self._num_fetches

    @property
    def num_merged(self) -> int:
        """Records of other peers that replaced an older one we held (gossip and DHT)."""
        return self._book.num_merged

    @property
    def num_unbound_refused(self) -> int:
        """Records refused because their ``peer_id`` field was not the id they were stored
        under (a peer claiming to be another, or many peers)."""
        return self._book.num_unbound

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
            key: progress
            for key, progress, expiration_time in self._book.records(now)
            if self._liveness.counts(key, expiration_time)
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
            self._trained = True
            self._local_epoch_started_at = now
        self._publish.on_changed(new_epoch=epoch != previous.epoch)
        self._recompute(now)
        return self._local

    def announce(self, now: float) -> None:
        """Count as active in the current epoch without samples: publish the record now."""
        self._last_active_epoch = max(self._global.epoch, self._local.epoch)
        self._publish.on_changed()
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
            self._warnings.on_others_seen()
        else:
            self._warnings.on_nobody_seen(now)
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
            self._warnings.on_others_seen()
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
            self._publish.on_changed()
        self._recompute(now)

    def probes_due(self, now: float) -> list[Probe]:
        """Owners of records ahead of us to dial now (see ``progress_liveness``); report each
        outcome with :meth:`on_probe_result`."""
        candidates = (  # nobody can dial a client; a record not ahead of us does not steer us
            OwnerCandidate(key, key, expiration_time)  # the id the record is bound to
            for key, progress, expiration_time in self._book.records(now)
            if not progress.client_mode and progress.epoch > self._local.epoch
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
        if self._book.refuses(key, progress, expiration_time, now):
            return False
        if progress is not None:
            self._warnings.check_clock(progress, now, gossiped)
        self._credits.track(
            key,
            self._book.held(key),
            progress,
            now,
            global_epoch=self._global.epoch,
            epoch_started_at=self._epoch_started_at,
            witnessed=self._epoch_witnessed,
            target=self.config.target_batch_size,
        )
        self._book.put(key, progress, expiration_time)
        return True

    # ------------------------------------------------------------ publishing

    def next_store_time(self, now: float) -> float:
        """DHT time at which to call :meth:`take_store` (at once after a report)."""
        return self._publish.next_store_time(now)

    def take_store(self, now: float) -> LocalProgress | None:
        """The record to store in the DHT now (None: this peer is not active)."""
        return self._local if self._publish.take_store(now, self.is_active) else None

    def next_gossip_time(self, now: float) -> float | None:
        """DHT time at which to call :meth:`take_gossip`; None if there is nothing to say."""
        return self._publish.next_gossip_time(now)

    def take_gossip(self, now: float) -> LocalProgress | None:
        """The record to gossip now (None: nothing new, or this peer is not active)."""
        return self._local if self._publish.take_gossip(now, self.is_active) else None

    # --------------------------------------------------------------- warnings

    def warnings(self, now: float) -> list[ProgressWarning]:
        """Warnings not returned before (each condition is reported once)."""
        return self._warnings.take(
            now, self._global, self._epoch_started_at, self._expected_epoch_duration
        )

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
        self._book.prune(now)
        self._liveness.prune({key: expiration for key, _, expiration in self._book.records(now)})
        self._votes.prune(self._local.epoch)
        live = self.peers(now)
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
            self._warnings.implausible(
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

        counted_self = active_self and self._local.epoch == epoch
        estimate = estimate_epoch(
            epoch,
            self._local if counted_self else None,
            others,
            self._credits,
            self._votes.vouched,  # None: every record's samples count
            max_rate,
            config.target_batch_size,
            now,
        )
        for key, warning in estimate.implausible:
            self._warnings.implausible(key, warning)
        samples, rate, eta = estimate.samples, estimate.rate, estimate.eta

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
