"""Sans-IO core of ``Optimizer``'s epochs: events in, decisions out.

Nothing here reads a clock, touches torch or the network, or imports anyio: every call that
depends on time takes ``now`` (DHT time). The shell (``AsyncOptimizer.on_batch`` and
``swarmtrain.optim._async_epoch_update``) reports what happened (a step began, a batch was checked,
the tracker's progress, a gradient round's outcome, a state download's outcome) and does what
the returned decision says (accumulate, skip the batch, schedule or start a gradient round,
step the optimizer, average the state, load the state, move to an epoch, warn).

One step of a peer, in the order the shell asks::

    is_behind(local, swarm)      -> bool          a peer behind loads the state instead (1)
    catch_up_due(now)            -> bool          ... unless a failed catch-up backs off
    batch_check(has_scaler)      -> BatchCheck    how to check this batch's gradients
    on_batch(check, finite)      -> SkipBatch | AccumulateBatch
    on_progress(local, p, now)   -> StepPlan      schedule the round? end the epoch?
    begin_epoch_end(...)         -> RoundPlan     (the epoch ends) how to run the gradient round
    on_round_result(...)         -> AuxiliaryCatchUp | FinishEpoch
    on_epoch_finished(...)       -> EpochAdvanced publish the new epoch (maybe the group's)
    after_load / after_failed_catch_up / after_failed_auxiliary_catch_up -> EnterEpoch | None

Decisions per mode at an epoch's end (``begin_epoch_end`` then ``on_round_result``; "others":
the tracker sees another peer, an auxiliary peer not counting itself):

=========================== ================================================================
mode                        decisions
=========================== ================================================================
plain (no offload)          round waited here; the optimizer steps here on the averaged
                            gradients (``step_with_averaged_now``), then the state round
offload_optimizer           round waited here; the averaged gradients are loaded into the
                            optimizer's copies; one state-averager step does optimizer step,
                            epoch increment and state round
delay_optimizer_step        first wait until the last round's gradients were consumed; the
                            round is waited here, its gradients consumed in the worker thread
                            (``RoundWait.HERE_CONSUME_IN_WORKER``); the step runs there
delay_grad_averaging        as delay_optimizer_step, but the round too is waited in the worker
                            (``RoundWait.IN_WORKER``): its outcome is not known here
use_local_updates           no gradient round (``RoundWait.NONE``); no optimizer step at the
                            end (each batch stepped); the state round is the averaging
delay_state_averaging       the state round runs in the background; an epoch whose state round
                            is due while the last one still runs skips it (hivemind's rule,
                            ``state_round_skipped``)
average_state_every=k       a state round only when the next epoch is a multiple of k
auxiliary                   weight 0 in gradient and state rounds; never delays; if the swarm
                            already left its epoch it tags along with the next round
                            (``tag_along``) and catches up; a failed round, or one whose group
                            was in another epoch, makes it catch up (``AuxiliaryCatchUp``: load
                            the state after that epoch's step if others are seen, else move on
                            alone; if the load fails while donors exist it stays in its epoch
                            and tries again after the back-off)
client_mode                 as its mode, but never serves state (``serve_state`` False)
alone (no others)           no round (local mean gradient), no state round
GradScaler                  per batch: unscale, skip a non-finite batch; with
                            reuse_grad_buffers: unscale only before the round, weight 0 if
                            non-finite (``unscale_before_round``)
no GradScaler               per batch: a non-finite batch is skipped with a warning; with
                            reuse_grad_buffers the epoch's accumulators are reset too
=========================== ================================================================

(1) Behind (``swarmtrain.optim._epoch_sync``): two or more epochs behind, or one epoch behind in
an epoch the swarm had already left when this peer entered it; an auxiliary peer only when two
or more epochs behind (it catches up by itself when it misses a round). A catch-up that leaves
the peer behind (or an auxiliary peer's that fails while donors exist) is retried after a
back-off (1 s, doubling up to 60 s: ``CatchUpBackoff``); the steps in between skip their batch
(``catch_ups_backed_off``).

The epoch ends when the swarm is ahead of us, reached ``target_batch_size``, or its ETA passed;
the gradient round's matchmaking is scheduled once the ETA is within ``matchmaking_time`` and
another peer is seen (an auxiliary peer whose epoch the swarm already left schedules nothing:
that round is over).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import Union

from swarmtrain.optim._epoch_sync import CatchUpBackoff, EpochSync
from swarmtrain.optim.progress_types import GlobalProgress

__all__ = [
    "AccumulateBatch",
    "AuxiliaryCatchUp",
    "BatchCheck",
    "EnterEpoch",
    "EpochAdvanced",
    "EpochCore",
    "EpochCoreStatistics",
    "EpochModes",
    "FinishEpoch",
    "RoundPlan",
    "RoundWait",
    "SkipBatch",
    "StepPlan",
    "SwarmView",
]


@dataclass(frozen=True)
class EpochModes:
    """The ``Optimizer`` keywords that decide what an epoch does (resolved, validated)."""

    auxiliary: bool = False
    client_mode: bool = False
    use_local_updates: bool = False
    offload_optimizer: bool = False
    delay_optimizer_step: bool = False
    delay_grad_averaging: bool = False
    delay_state_averaging: bool = True
    reuse_grad_buffers: bool = False
    average_state_every: int = 1
    matchmaking_time: float = 5.0

    def __post_init__(self) -> None:
        every = self.average_state_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"average_state_every must be an int >= 1, got {every!r}")
        if not self.matchmaking_time > 0:
            raise ValueError(f"matchmaking_time must be positive, got {self.matchmaking_time}")
        if self.auxiliary and (self.delay_optimizer_step or self.delay_grad_averaging):
            raise ValueError("an auxiliary peer never delays its optimizer step")
        if self.auxiliary and (self.use_local_updates or self.reuse_grad_buffers):
            raise ValueError("an auxiliary peer has no batches")
        if self.use_local_updates and self.delay_grad_averaging:
            raise ValueError("use_local_updates averages no gradients")
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            raise ValueError("delay_grad_averaging needs delay_optimizer_step")
        if self.delay_optimizer_step and not (
            self.offload_optimizer and self.delay_state_averaging
        ):
            raise ValueError("delay_optimizer_step needs offload_optimizer and delayed state")

    @property
    def gradient_rounds(self) -> bool:
        """Whether epochs end with a gradient round (all modes but ``use_local_updates``)."""
        return not self.use_local_updates


@dataclass(frozen=True)
class SwarmView:
    """The tracker's view of the swarm at one moment; a ``GlobalProgress`` works as well (it
    has these fields)."""

    epoch: int
    num_peers: int  #: active peers seen, this one included unless it is auxiliary
    samples_accumulated: int = 0
    target_batch_size: int = 1
    eta_next_epoch: float = float("inf")
    confirming_alone: bool = False  #: alone at the target, a fetch still due (``GlobalProgress``)


#: what the core reads of the swarm: a ``SwarmView`` or the tracker's ``GlobalProgress``
Swarm = Union[SwarmView, GlobalProgress]

# ------------------------------------------------------------------ decisions


class BatchCheck(enum.Enum):
    """How the shell checks a batch's gradients before accumulating it."""

    UNSCALE = "unscale"  #: GradScaler: unscale now; it says whether they are finite
    CHECK_FINITE = "check_finite"  #: no GradScaler: look for NaN/inf
    NONE = "none"  #: GradScaler with reuse_grad_buffers: unscaled before the round


@dataclass(frozen=True)
class SkipBatch:
    """Drop this batch (non-finite gradients)."""

    reset_accumulators: bool  #: the epoch's accumulators too (they held the bad sum)
    clear_grads: bool  #: set every ``param.grad`` to None
    warn: bool  #: a warning (no GradScaler); else a debug line (the scaler backs off)


@dataclass(frozen=True)
class AccumulateBatch:
    """Take this batch: a local optimizer step (``use_local_updates``) or accumulate it."""

    local_step: bool
    delay_optimizer_step: bool


@dataclass(frozen=True)
class StepPlan:
    """What the rest of a step does after the batch was taken."""

    schedule_round: bool  #: pre-schedule the gradient round's matchmaking now
    seconds_left: float  #: until the swarm's ETA (for the log line)
    others_seen: bool
    num_peers_present: int  #: counting this peer
    end_epoch: bool  #: the swarm is ahead, reached the target, or the ETA passed


class RoundWait(enum.Enum):
    """Where the gradient round is waited for."""

    NONE = "none"  #: no round (use_local_updates, or an auxiliary peer tagging along)
    HERE = "here"  #: here, then its gradients are consumed here
    HERE_CONSUME_IN_WORKER = "here_consume_in_worker"  #: delay_optimizer_step
    IN_WORKER = "in_worker"  #: delay_grad_averaging: the outcome is not known here


@dataclass(frozen=True)
class RoundPlan:
    """How the gradient round that ends ``epoch`` runs."""

    epoch: int
    others_seen: bool
    num_peers_present: int  #: counting this peer
    tag_along: bool  #: auxiliary, the swarm left this epoch: tag along with the next round
    wait_gradients_consumed: bool  #: first wait until the last round's gradients were used
    unscale_before_round: bool  #: GradScaler with reuse_grad_buffers: weight 0 if non-finite
    weight: float | None  #: None: the samples accumulated
    wait: RoundWait

    @property
    def begin_round(self) -> bool:
        return self.wait is not RoundWait.NONE


@dataclass(frozen=True)
class AuxiliaryCatchUp:
    """An auxiliary peer missed this epoch's gradients: load the state (if ``load_state``),
    else (or if that fails) move to the next epoch on its own."""

    load_state: bool


@dataclass(frozen=True)
class FinishEpoch:
    """End the epoch: the optimizer step and the state round, then move to ``next_epoch``."""

    next_epoch: int
    optimizer_step: bool  #: on the averaged gradients (False with use_local_updates)
    step_with_averaged_now: bool  #: no offload: step here on the averager's buffers first
    delay_optimizer_step: bool
    average_state: bool
    state_round_skipped: bool  #: due, but the last (delayed) state round still runs
    state_round_weight: float | None  #: 0.0 for an auxiliary peer (receive, do not pull)
    delay_state_averaging: bool

    @property
    def increment_in_state_step(self) -> bool:
        """Whether the state averager's (second) step increments the epoch."""
        return not self.step_with_averaged_now


@dataclass(frozen=True)
class EpochAdvanced:
    """Publish ``epoch`` (tracker) and serve the state at that priority if ``serve_state``."""

    epoch: int
    adopted_from: int | None  #: the epoch we left for the state group's later one
    serve_state: bool


@dataclass(frozen=True)
class EnterEpoch:
    """Start ``epoch`` afresh (accumulators dropped), e.g. after loading the state."""

    epoch: int
    own_state: bool  #: no peer served a state: this peer keeps its own parameters


@dataclass(frozen=True)
class EpochCoreStatistics:
    """Counts of the decisions an ``EpochCore`` took."""

    batches_accumulated: int
    batches_skipped: int
    epochs_ended: int
    rounds_tagged_along: int
    state_rounds: int
    state_rounds_skipped: int
    auxiliary_catch_ups: int
    epochs_adopted: int
    epochs_entered: int
    epochs_entered_without_state: int
    catch_ups_failed: int = 0  #: catch-ups that left this peer behind
    catch_ups_backed_off: int = 0  #: steps behind that waited for the back-off, no attempt


EpochEndDecision = Union[AuxiliaryCatchUp, FinishEpoch]


class EpochCore:
    """The epoch decisions of one ``Optimizer`` (see the module docstring)."""

    def __init__(self, modes: EpochModes):
        self.modes = modes
        self._sync = EpochSync()
        self._backoff = CatchUpBackoff()
        self._retry_in = 0.0
        self._plan: RoundPlan | None = None  # the epoch end in progress
        self._counts = dict.fromkeys(EpochCoreStatistics.__dataclass_fields__, 0)

    def statistics(self) -> EpochCoreStatistics:
        return EpochCoreStatistics(**self._counts)

    # ------------------------------------------------------------------ a step

    def others_seen(self, swarm: Swarm) -> bool:
        """Whether the tracker sees another peer (an auxiliary peer does not count itself)."""
        return swarm.num_peers > (0 if self.modes.auxiliary else 1)

    def peers_present(self, swarm: Swarm) -> int:
        """Peers the tracker counts, plus this one if it is auxiliary (it is not counted)."""
        return swarm.num_peers + (1 if self.modes.auxiliary else 0)

    def is_behind(self, local_epoch: int, swarm_epoch: int) -> bool:
        """Whether this peer must catch up (load the state) before this step's batch; call it
        at every step (the first call in an epoch is remembered, ``_epoch_sync``)."""
        if self.modes.auxiliary:
            return local_epoch < swarm_epoch - 1
        return self._sync.must_catch_up(local_epoch, swarm_epoch)

    def catch_up_due(self, now: float) -> bool:
        """Whether a peer behind tries to catch up now (False: a failed catch-up backs off;
        skip this step's batch without trying or warning). ``now``: a monotonic clock."""
        if self._backoff.due(now):
            return True
        self._counts["catch_ups_backed_off"] += 1
        return False

    def batch_check(self, has_scaler: bool) -> BatchCheck:
        if not has_scaler:
            return BatchCheck.CHECK_FINITE
        return BatchCheck.NONE if self.modes.reuse_grad_buffers else BatchCheck.UNSCALE

    def on_batch(self, check: BatchCheck, finite: bool) -> SkipBatch | AccumulateBatch:
        """The batch was checked (``finite``: what the check found; True for ``NONE``)."""
        modes = self.modes
        if not finite and check is not BatchCheck.NONE:
            self._counts["batches_skipped"] += 1
            if check is BatchCheck.UNSCALE:  # the scaler backs off and skips on its own
                return SkipBatch(reset_accumulators=False, clear_grads=False, warn=False)
            reset = modes.reuse_grad_buffers and modes.gradient_rounds
            clear = not reset and (modes.reuse_grad_buffers or modes.use_local_updates)
            return SkipBatch(reset_accumulators=reset, clear_grads=clear, warn=True)
        self._counts["batches_accumulated"] += 1
        return AccumulateBatch(modes.use_local_updates, modes.delay_optimizer_step)

    def on_progress(self, local_epoch: int, swarm: Swarm, now: float) -> StepPlan:
        """The tracker's progress after this step's report: schedule the round, end the epoch?"""
        others = self.others_seen(swarm)
        seconds_left = swarm.eta_next_epoch - now
        round_over = self.modes.auxiliary and swarm.epoch > local_epoch  # aux: do not disrupt
        schedule = (
            self.modes.gradient_rounds
            and not round_over
            and others
            and seconds_left <= self.modes.matchmaking_time
        )
        end_epoch = not swarm.confirming_alone and (
            swarm.epoch > local_epoch
            or swarm.samples_accumulated >= swarm.target_batch_size
            or now >= swarm.eta_next_epoch
        )
        return StepPlan(schedule, seconds_left, others, self.peers_present(swarm), end_epoch)

    # ------------------------------------------------------------------ an epoch's end

    def begin_epoch_end(self, local_epoch: int, swarm: Swarm, has_scaler: bool) -> RoundPlan:
        """The epoch ends (``on_progress`` said so): how the gradient round runs."""
        modes = self.modes
        others = self.others_seen(swarm)
        tag_along = modes.gradient_rounds and modes.auxiliary and swarm.epoch > local_epoch
        if tag_along:
            self._counts["rounds_tagged_along"] += 1
        begin = modes.gradient_rounds and not tag_along
        if not begin:
            wait = RoundWait.NONE
        elif modes.delay_grad_averaging:
            wait = RoundWait.IN_WORKER
        elif modes.delay_optimizer_step:
            wait = RoundWait.HERE_CONSUME_IN_WORKER
        else:
            wait = RoundWait.HERE
        plan = RoundPlan(
            epoch=local_epoch,
            others_seen=others,
            num_peers_present=self.peers_present(swarm),
            tag_along=tag_along,
            wait_gradients_consumed=begin and modes.delay_optimizer_step,
            unscale_before_round=begin and has_scaler and modes.reuse_grad_buffers,
            weight=0.0 if modes.auxiliary else None,
            wait=wait,
        )
        self._plan = plan
        return plan

    def round_averaged(self, epoch: int, group_epochs: Collection[int] | None) -> bool:
        """Whether the gradient round for ``epoch`` counts as averaged (``group_epochs``: the
        members' epochs, None if it failed): an auxiliary peer needs this epoch's gradients, so
        a group in another epoch does not count. Pure (safe from the worker thread)."""
        if group_epochs is None:
            return False
        return not (self.modes.auxiliary and any(e != epoch for e in group_epochs))

    def on_round_result(self, averaged: bool | None, state_round_running: bool) -> EpochEndDecision:
        """The gradient round's outcome (None: none ran, or the worker waits for it) and
        whether the last (delayed) state round still runs: finish the epoch, or catch up."""
        plan, self._plan = self._plan, None
        if plan is None:
            raise RuntimeError("on_round_result before begin_epoch_end")
        modes = self.modes
        round_ok = not plan.tag_along and averaged is not False
        if modes.auxiliary and not round_ok:
            self._counts["auxiliary_catch_ups"] += 1
            return AuxiliaryCatchUp(load_state=plan.others_seen)
        next_epoch = plan.epoch + 1
        average_state = plan.others_seen and next_epoch % modes.average_state_every == 0
        skipped = average_state and modes.delay_state_averaging and state_round_running
        average_state = average_state and not skipped
        self._counts["state_rounds"] += average_state
        self._counts["state_rounds_skipped"] += skipped
        optimizer_step = modes.gradient_rounds
        return FinishEpoch(
            next_epoch=next_epoch,
            optimizer_step=optimizer_step,
            step_with_averaged_now=optimizer_step and not modes.offload_optimizer,
            delay_optimizer_step=optimizer_step and modes.delay_optimizer_step,
            average_state=average_state,
            state_round_skipped=skipped,
            state_round_weight=0.0 if average_state and modes.auxiliary else None,
            delay_state_averaging=modes.delay_state_averaging,
        )

    def on_epoch_finished(
        self,
        local_epoch: int,
        group_epochs: Collection[int] | None = None,
        swarm_epoch: int | None = None,
    ) -> EpochAdvanced:
        """The optimizer and state steps ran; ``local_epoch``: the state averager's epoch now;
        ``group_epochs``: the epochs of a state round's group that averaged here. A group in a
        later epoch (this peer's gradient round failed because the swarm moved on) takes us
        there: else a peer whose epoch ends with the swarm's state round stays behind. With
        ``swarm_epoch`` (the epoch the tracker's quorum vouches for), a member's epoch counts
        only up to ``max(local_epoch + 1, swarm_epoch)``: one member is not a quorum."""
        self._counts["epochs_ended"] += 1
        self._backoff.reset()  # a later catch-up (if any) tries at once
        epochs = [e for e in group_epochs or () if isinstance(e, int) and not isinstance(e, bool)]
        if swarm_epoch is not None:
            epochs = [e for e in epochs if e <= max(local_epoch + 1, swarm_epoch)]
        adopted_from = None
        if epochs and max(epochs) > local_epoch:
            adopted_from, local_epoch = local_epoch, max(epochs)
            self._counts["epochs_adopted"] += 1
        return EpochAdvanced(local_epoch, adopted_from, not self.modes.client_mode)

    # ------------------------------------------------------------------ loading the state

    def after_load(self, loaded_epoch: int, swarm_epoch: int) -> EnterEpoch:
        """A state was loaded at ``loaded_epoch``: the epoch to enter (the swarm's, if the
        donor was one epoch behind it: it was about to move on)."""
        self._backoff.reset()
        self._counts["epochs_entered"] += 1
        epoch = swarm_epoch if swarm_epoch - 1 <= loaded_epoch < swarm_epoch else loaded_epoch
        return EnterEpoch(epoch, own_state=False)

    @property
    def retry_in(self) -> float:
        """Seconds the last failed catch-up backs off before the next attempt."""
        return self._retry_in

    def after_failed_catch_up(
        self, local_epoch: int, swarm_epoch: int, no_donor: bool, *, now: float
    ) -> EnterEpoch | None:
        """A peer behind could not load the state (``no_donor``: no peer shares one at all):
        take the swarm's epoch with our own state when the swarm is one epoch ahead or nobody
        can serve, rather than stay behind and never average gradients again. None: it stays
        behind, and its next attempt waits for the back-off (:meth:`retry_in` says how long;
        ``now``: the monotonic clock of :meth:`catch_up_due`)."""
        if (
            self.modes.auxiliary
            or not (swarm_epoch == local_epoch + 1 or no_donor)
            or swarm_epoch <= local_epoch
        ):
            self._catch_up_failed(now)
            return None
        return self._enter_with_own_state(swarm_epoch)

    def auxiliary_catch_up_epoch(self, local_epoch: int, swarm_epoch: int) -> int:
        """The oldest state an auxiliary peer's catch-up (``AuxiliaryCatchUp``) may load: once
        the swarm is past ``local_epoch``, the state after that epoch's step (a donor's state of
        ``local_epoch`` predates its step, and entering the next epoch with it would leave this
        peer a step behind for good); else any state from ``local_epoch`` on."""
        return local_epoch + 1 if swarm_epoch > local_epoch else local_epoch

    def after_failed_auxiliary_catch_up(
        self, local_epoch: int, no_donor: bool, *, now: float
    ) -> EnterEpoch | None:
        """An auxiliary peer missed its epoch's gradients (``AuxiliaryCatchUp``) and loaded no
        state: move to the next epoch with its own state only when no peer can serve one
        (``no_donor``: nobody else is seen, or nobody shares a state); else stay in this epoch,
        whose next step catches up again after the back-off, rather than advance with a state
        that missed the epoch's optimizer step (it would stay out of sync with the swarm)."""
        if not no_donor:
            self._catch_up_failed(now)
            return None
        return self._enter_with_own_state(local_epoch + 1)

    def _catch_up_failed(self, now: float) -> None:
        """Stay in this epoch; the next catch-up comes after the back-off."""
        self._counts["catch_ups_failed"] += 1
        self._retry_in = self._backoff.failed(now)

    def _enter_with_own_state(self, epoch: int) -> EnterEpoch:
        self._backoff.reset()
        self._counts["epochs_entered"] += 1
        self._counts["epochs_entered_without_state"] += 1
        return EnterEpoch(epoch, own_state=True)
