"""Who steers a peer's progress: the vote rules of :class:`~swarmtrain.optim.ProgressCore`.

Sans-IO like the core: no clock, no network; every method that depends on time takes ``now``.

Votes (the global epoch):

- the global epoch is what a quorum vouches for: the voters are the live non-client peers (one
  vote per peer id), and this peer once it trained (reported samples or changed epoch; a
  newcomer that has not trained yet does not vote, so it follows the swarm it joins, even a
  swarm of one); the quorum is more than ``quorum_fraction`` of the voters (two of two: then a
  lone liar cannot move an established peer); the global epoch is the quorum-th highest voter's
  epoch, never below our own. hivemind takes the largest epoch of any record, so one record
  claiming epoch 1e9 sent every peer into state downloads;
- identities are free, so a vote must cost work: once this peer has *partners* -- peers that
  averaged with it (a gradient or state round; the Optimizer reports each round's members that
  sent their parts and returned our deltas, :meth:`ProgressVotes.on_round_partners`) in a round
  of epoch ``e`` with our epoch now at most ``e + partner_window`` -- and one of them has a live
  non-client record, only those partners (and this peer) vote. Everyone else, however many,
  cannot move our epoch (their records still count as peers; those ahead of us are counted in
  :attr:`ProgressVotes.unvouched`). With no live partner (a newcomer, a peer whose partners all
  left or whose rounds failed for ``partner_window`` epochs) every live non-client peer votes.
  Why partners: a round costs what an honest peer pays (matchmaking, then a correctly shaped
  part of every averaged tensor to each reducer and the averaged part back to each sender; a
  member that failed either is not a partner), and robust aggregation bounds what its data can
  do; a signed record costs one key generation. A peer that fell behind still follows a quorum
  of its partners ahead (they keep their place: the window counts our epochs, not theirs).
- our own vote is what keeps a lone partner (or a minority of them) from moving us; but a
  peer that stalled (a loaded box) while its partners went on is the one that is wrong, and
  with a single partner "two of two" held it back for ``partner_window`` epochs of training
  alone. So when a quorum of our partners (and trusted peers) *without* our vote is two or more
  epochs ahead (:meth:`ProgressVotes.vouched_epoch`, the "behind" rules), we follow it

  * *seconded*: at once, if a peer we know independently of those partners is there too (a
    *witness*: a live non-client record of a known peer that was vouched for by someone
    else -- seen while nobody vouched (our first look), listed by another partner or a trusted
    peer, or a partner of ours in an earlier round; :attr:`ProgressVotes.sources`) and a
    quorum of every live non-client peer, us included, is there; or
  * *stalled*: once we have been that far behind them for the stall bound (``ProgressCore``
    decides: at least ``min_stall_time``; stepping alone meanwhile does not restart it), if a
    quorum of every live non-client peer *but us* is there;

  in both cases at most ``max_lead`` epochs ahead of ours (``ProgressCore`` decides what the
  time since we were last in step makes plausible; the rest when we look again). A peer that
  stepped alone from two epochs behind to one is still behind (the round of the epoch it
  entered is over): the rules go on for a lead of one, on the same clock.

  A lying partner's own Sybils are not witnesses (it vouches for them, nobody else does), and
  a lone partner never outvotes the peers that are with us (both rules need the open quorum);
  free identities alone never move us (both rules need our partners).

Vouched samples (whose samples and speeds count toward the target and the ETA):

- each record lists its owner's round partners (``LocalProgress.partners``, inside the signed
  record; a record without the field, from an older version, vouches for nobody);
- until somebody vouches -- no live partner of ours, and no live trusted or known peer that
  lists a partner: the start of a run, a newcomer's first look -- every record counts, and its
  owner becomes *known*; from then on never again (a peer whose vouchers all left counts
  itself and whoever averages with it, not every record present);
- otherwise only the vouched peers count (:attr:`ProgressVotes.vouched`): us, our live partners,
  live trusted peers (``trusted_peers``: they also vote, see above), the peers that the records
  of our partners and trusted peers list (one step: a peer vouched for this way does not vouch
  in turn, so an identity that averaged with one of our partners buys itself, not those it
  lists), and the known peers: those vouched for at an earlier tally, while their records stay
  live. Known peers keep a swarm larger than its groups whole: a group that keeps to itself (the
  slowest peers, ending each epoch last) shares no round with the others after
  ``partner_window`` epochs, and partner lists alone would split the swarm's target in two.

Plausibility caps (samples):

- a peer's samples count at most what ``max_rate_factor`` times the swarm's reference speed
  allows since it entered the epoch (:class:`Credit`; the reference, :func:`reference_rate`:
  the lower median of the reported samples/s -- of our live partners and us while we have
  partners, so that free identities cannot set it -- or this peer's own measured speed in the
  epoch if faster); its reported samples/s is capped the same way for the ETA;
- a peer one epoch ahead just stepped: the samples it accumulated in the global epoch before it
  stepped still count toward it (:class:`Carry`; so that in a swarm of two, the peer that did
  not step yet sees the target reached as the other one did).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .progress_types import LocalProgress

__all__ = ["Carry", "Credit", "ProgressVotes", "SampleCredits", "quorum_epoch", "reference_rate"]

MAX_LISTED_PARTNERS = 64  #: partner ids a progress record lists at most (most recent first)
MAX_PEER_ID_BYTES = 128  #: longest peer id a record may list (an Ed25519 one has 38 bytes)
MIN_KNOWN_RATE = 1e-9  #: total samples/s below this means "speed unknown" (no ETA to judge)
FOUNDER = b""  #: the source of a peer seen while nobody vouched (no peer id is empty)
MAX_SOURCES = 4  #: vouchers remembered per known peer (enough to find one outside a few)
CREDIT_SLACK = 1.0  #: s of samples at the capped speed a peer may be ahead of its bound


@dataclass
class Credit:
    """How many samples of a peer's epoch may count: ``base`` plus the capped speed times the
    time since ``since`` (our clock)."""

    epoch: int
    base: int
    since: float

    def bound(self, rate: float, until: float) -> float:
        return self.base + rate * (max(0.0, until - self.since) + CREDIT_SLACK)


@dataclass(frozen=True)
class Carry:
    """A peer's samples in the epoch it left for the next one (they still count toward it)."""

    credit: Credit
    samples: float  #: its last report there, extrapolated to the time it stepped
    left_at: float  #: our clock


class SampleCredits:
    """The :class:`Credit` and :class:`Carry` of each peer whose record we hold."""

    def __init__(self) -> None:
        self.credits: dict[bytes, Credit] = {}
        self.carries: dict[bytes, Carry] = {}

    def track(
        self,
        key: bytes,
        old: LocalProgress | None,
        new: LocalProgress | None,
        now: float,
        *,
        global_epoch: int,
        epoch_started_at: float,
        witnessed: bool,
        target: int,
    ) -> None:
        """Start counting ``key``'s samples afresh when it enters an epoch. ``witnessed``: we
        saw the global epoch (``global_epoch``, begun at ``epoch_started_at``) begin."""
        if new is None:
            self.credits.pop(key, None)
            self.carries.pop(key, None)
            return
        credit = self.credits.get(key)
        if credit is not None and credit.epoch == new.epoch:
            return
        if credit is not None and old is not None and new.epoch == old.epoch + 1:
            # it stepped: what it accumulated in the old epoch still counts toward it (its last
            # report, extrapolated to when it stepped: the report before a step is often not sent)
            stepped_after = max(0.0, min(new.time, now) - old.time)
            samples = old.samples_accumulated + old.samples_per_second * stepped_after
            self.carries[key] = Carry(credit, samples, now)
            self.credits[key] = Credit(new.epoch, 0, now)
            return
        self.carries.pop(key, None)
        if not witnessed:  # we joined this epoch midway: take its samples so far
            self.credits[key] = Credit(new.epoch, min(new.samples_accumulated, target), now)
        elif new.epoch == global_epoch:  # it can have counted since the epoch began
            self.credits[key] = Credit(new.epoch, 0, epoch_started_at)
        else:
            self.credits[key] = Credit(new.epoch, 0, now)

    def keep_only(self, live: Mapping[bytes, object]) -> None:
        """Forget the peers whose records are not live."""
        for tracked in (self.credits, self.carries):
            for key in [key for key in tracked if key not in live]:
                del tracked[key]

    def on_epoch_witnessed(self) -> None:
        """From now on, no peer's samples are taken on trust."""
        for held in self.credits.values():
            held.base = 0


def reference_rate(
    others: Iterable[LocalProgress],
    local: LocalProgress,
    *,
    trained: bool,
    local_epoch_took: float,
) -> float:
    """The speed a typical peer reports: the lower median of the known samples/s (``local``'s
    included once it ``trained``), or our own measured speed in this epoch (``local``'s samples
    over ``local_epoch_took`` seconds) if faster (0: nobody knows)."""
    rates = sorted(
        rate
        for rate in (
            *(peer.samples_per_second for peer in others),
            local.samples_per_second if trained else 0.0,
        )
        if rate >= MIN_KNOWN_RATE
    )
    median = rates[(len(rates) - 1) // 2] if rates else 0.0
    return max(median, local.samples_accumulated / (local_epoch_took + CREDIT_SLACK))


def quorum_epoch(epochs: Iterable[int], quorum_fraction: float) -> int | None:
    """The highest epoch that more than ``quorum_fraction`` of ``epochs`` (one per voter) is at
    or beyond (at least two voters when there are two or more); None without voters."""
    votes = sorted(epochs, reverse=True)
    if not votes:
        return None
    quorum = min(len(votes), math.floor(len(votes) * quorum_fraction) + 1)
    if len(votes) >= 2:
        quorum = max(quorum, 2)
    return votes[quorum - 1]


class ProgressVotes:
    """Round partners, the quorum and the vouched set (see the module docstring).

    :param local_key: this peer's id (never its own partner)
    :param quorum_fraction: see :class:`~swarmtrain.optim.ProgressConfig`
    :param partner_window: see :class:`~swarmtrain.optim.ProgressConfig`
    :param trusted_peers: peer ids whose records vote and vouch like partners' (the organisers')
    """

    def __init__(
        self,
        local_key: bytes,
        *,
        quorum_fraction: float,
        partner_window: int,
        trusted_peers: Iterable[bytes] = (),
    ):
        self.local_key = local_key
        self.quorum_fraction, self.partner_window = quorum_fraction, partner_window
        self.trusted = frozenset(trusted_peers) - {local_key}
        self.partners: dict[bytes, int] = {}  #: peer id -> epoch of our last round with it
        self.live_partners: set[bytes] = set()  #: partners with a live non-client record
        self.unvouched: set[bytes] = set()  #: keys ahead of us whose votes did not count
        #: peers vouched for at an earlier tally (or seen while nobody vouched): they count, and
        #: vouch for the partners they list, while their records stay live
        self.known: set[bytes] = set()
        #: the peers whose samples and speed count (None: every record's)
        self.vouched: frozenset[bytes] | None = None
        self.unvouched_samples: set[bytes] = set()  #: live records outside ``vouched``
        #: known peer -> who vouched for it (voucher ids, the peer itself as a partner or
        #: trusted peer, ``FOUNDER``; at most ``MAX_SOURCES``): a witness must have a source
        #: other than the partners it seconds
        self.sources: dict[bytes, set[bytes]] = {}
        #: how the last tally's epoch was reached past our own vote: "seconded", "stalled", None
        self.followed: str | None = None
        #: at the last tally a quorum of our partners (without our vote) was 2+ epochs ahead
        self.behind = False
        self._vouching = False  # someone vouched once: never again count every record

    def on_round_partners(self, peer_ids: Iterable[bytes], epoch: int) -> None:
        """This peer averaged with ``peer_ids`` in a round of ``epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        for peer_id in peer_ids:
            if not isinstance(peer_id, bytes) or not peer_id:
                raise TypeError(f"peer ids must be non-empty bytes, got {peer_id!r}")
            if peer_id != self.local_key and self.partners.get(peer_id, -1) < epoch:
                self.partners[peer_id] = epoch

    def listed_partners(self) -> tuple[bytes, ...]:
        """The partners our record lists: the most recent rounds' first, at most
        ``MAX_LISTED_PARTNERS``, only those of peer ids a record may list."""
        ranked = sorted(self.partners.items(), key=lambda item: (-item[1], item[0]))
        listed = (key for key, _ in ranked if len(key) <= MAX_PEER_ID_BYTES)
        return tuple(listed)[:MAX_LISTED_PARTNERS]

    def prune(self, local_epoch: int) -> None:
        """Forget the partners of rounds more than ``partner_window`` epochs before ours."""
        oldest = local_epoch - self.partner_window
        if any(epoch < oldest for epoch in self.partners.values()):
            self.partners = {k: e for k, e in self.partners.items() if e >= oldest}

    def tally(
        self,
        live: Mapping[bytes, LocalProgress],
        local_epoch: int,
        *,
        trained: bool,
        stalled: bool = False,
        max_lead: int | None = None,
    ) -> int:
        """The global epoch (:meth:`vouched_epoch`), and who counts (:attr:`vouched`)."""
        epoch = self.vouched_epoch(
            live, local_epoch, trained=trained, stalled=stalled, max_lead=max_lead
        )
        self.known.intersection_update(live)
        self.vouched = self._vouched_set(live)
        if self.vouched is None:  # every record counts: they are known from now on
            founders = [key for key, peer in live.items() if peer.epoch <= epoch + 1]
            self.known.update(founders)
            for key in founders:
                self._add_source(key, FOUNDER)
            self.unvouched_samples = set()
        else:
            self.known.update(self.vouched - {self.local_key})
            for voucher in self._vouchers(live):
                self._add_source(voucher, voucher)
                for key in live[voucher].partners:
                    if key in self.vouched and key != self.local_key:
                        self._add_source(key, voucher)
            self.unvouched_samples = {key for key in live if key not in self.vouched}
        self.sources = {key: found for key, found in self.sources.items() if key in self.known}
        return epoch

    def _add_source(self, key: bytes, source: bytes) -> None:
        found = self.sources.setdefault(key, set())
        if len(found) < MAX_SOURCES:
            found.add(source)

    def _vouchers(self, live: Mapping[bytes, LocalProgress]) -> set[bytes]:
        """Our live partners and trusted peers: the records whose partner lists we take."""
        return {key for key in (*self.partners, *self.trusted) if key in live}

    def _vouched_set(self, live: Mapping[bytes, LocalProgress]) -> frozenset[bytes] | None:
        """Us, our live partners, trusted and known peers, and the partners that the records of
        our live partners and trusted peers list (one step: a peer vouched for this way does
        not vouch in turn). None until somebody vouches: a partner of ours is live, or a live
        trusted or known peer lists a partner (then for good)."""
        vouchers = self._vouchers(live)
        roots = vouchers | self.known
        if not self._vouching:
            if not any(key in self.partners or live[key].partners for key in roots):
                return None
            self._vouching = True  # for good: a peer whose vouchers all left trusts nobody new
        vouched = {self.local_key, *roots}
        for voucher in vouchers:
            vouched.update(key for key in live[voucher].partners if key in live)
        return frozenset(vouched)

    def vouched_epoch(
        self,
        live: Mapping[bytes, LocalProgress],
        local_epoch: int,
        *,
        trained: bool,
        stalled: bool = False,
        max_lead: int | None = None,
    ) -> int:
        """The highest epoch that a quorum of the voters is at or beyond, never below ours.
        The voters: our live partners and trusted peers if there is any, else every live
        non-client peer. Two or more epochs behind a quorum of our partners, we may follow
        them past our own vote (the "behind" rules in the module docstring; ``stalled``: we
        have been behind them (:attr:`behind`) for the stall bound; ``max_lead``: those rules
        take us at most this many epochs ahead of ours, what the time since we were last in
        step allows; None: no cap)."""
        voters = {key: peer for key, peer in live.items() if not peer.client_mode}
        partners = {key: voters[key] for key in self.partners if key in voters}
        self.live_partners = set(partners)
        trusted = {key: voters[key] for key in self.trusted if key in voters}
        was_behind, self.unvouched, self.followed, self.behind = self.behind, set(), None, False
        own = [local_epoch] if trained else []
        if not (partners or trusted):
            epoch = quorum_epoch([*(p.epoch for p in voters.values()), *own], self.quorum_fraction)
            return local_epoch if epoch is None else max(local_epoch, epoch)
        chosen = {**partners, **trusted}
        self.unvouched = {
            key for key, peer in voters.items() if key not in chosen and peer.epoch > local_epoch
        }
        epoch = quorum_epoch([*(p.epoch for p in chosen.values()), *own], self.quorum_fraction)
        epoch = local_epoch if epoch is None else max(local_epoch, epoch)
        if trained:  # without our vote the chosen alone decide: nothing to set aside
            # two epochs behind, or still one after stepping alone from there (the round of
            # the epoch we entered was over: following ends it at once, or loads the state)
            lead = 1 if was_behind else 2
            behind = self._follow_when_behind(voters, chosen, local_epoch, lead, stalled, max_lead)
            if behind is not None and behind > epoch:
                epoch = behind
            else:
                self.followed = None
        return epoch

    def _follow_when_behind(
        self,
        voters: Mapping[bytes, LocalProgress],
        chosen: Mapping[bytes, LocalProgress],
        local_epoch: int,
        min_lead: int,
        stalled: bool,
        max_lead: int | None,
    ) -> int | None:
        """The epoch ``min_lead`` or more ahead of ours (at most ``max_lead``) that a quorum of
        ``chosen`` (partners and trusted peers) vouches for without our vote, seconded by a
        witness, or ``stalled``; None if no rule applies (sets :attr:`followed`)."""
        ahead = quorum_epoch((peer.epoch for peer in chosen.values()), self.quorum_fraction)
        if ahead is None:
            return None
        self.behind = ahead >= local_epoch + min_lead
        if max_lead is not None:
            ahead = min(ahead, local_epoch + max_lead)
        if ahead < local_epoch + min_lead:
            return None
        everyone = [peer.epoch for peer in voters.values()]  # chosen among them: not empty
        reach = min(ahead, quorum_epoch([*everyone, local_epoch], self.quorum_fraction) or 0)
        # a witness seconds the highest epoch it is at (up to ``reach``): the higher the epoch,
        # the fewer partners there, so the likelier it is known through someone else
        best: int | None = None
        for key, peer in voters.items():
            epoch = min(peer.epoch, reach)
            floor = local_epoch + min_lead if best is None else best + 1
            if key in chosen or key not in self.known or epoch < floor:
                continue
            if self._witness(key, {k for k, p in chosen.items() if p.epoch >= epoch}):
                best = epoch
        if best is not None:
            self.followed = "seconded"
            return best
        if stalled:
            without_us = quorum_epoch(everyone, self.quorum_fraction) or 0
            epoch = min(ahead, without_us)
            if epoch >= local_epoch + min_lead:
                self.followed = "stalled"
                return epoch
        return None

    def _witness(self, key: bytes, seconded: Collection[bytes]) -> bool:
        """Whether the known peer ``key`` is known through someone other than ``seconded``."""
        return any(source not in seconded for source in self.sources.get(key, ()))
