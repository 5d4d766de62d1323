"""The rounds of a DiLoCo optimizer: start a fragment's round (its pseudo-gradient), launch
its all-reduce, wait for it (bounded), apply the average or our own pseudo-gradient alone, and
then the repairs of :mod:`~swarmtrain.optim.diloco_sync`. A mixin of
:class:`~swarmtrain.optim.async_diloco.AsyncDiLoCoOptimizer`; the members it uses are declared
below. Runs on the optimizer's loop; tensor work runs there for small CPU parameters, else in
``trio.to_thread``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import trio

from swarmtrain.averaging import DecentralizedAverager, StepControl
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
from swarmtrain.averaging.finite import first_non_finite
from swarmtrain.optim.diloco_core import (
    ApplyOuter,
    Fragments,
    OuterState,
    StartSync,
    StreamingSchedule,
)
from swarmtrain.optim.diloco_peers import RunPresence
from swarmtrain.optim.diloco_records import PendingRound, RoundStatistics, round_statistics
from swarmtrain.optim.diloco_state import shared_fingerprint
from swarmtrain.optim.diloco_sync import (
    adopt_reference_state,
    catch_up,
    check_lockstep,
    everyone_done,
)

__all__ = ["ROUND_BITS", "ROUND_GRACE", "ROUND_KEYS", "DiLoCoRounds"]

logger = logging.getLogger("swarmtrain.optim.diloco")

#: rounds are told apart in the DHT key by their number modulo ``2 ** ROUND_BITS``
ROUND_BITS = 16
ROUND_KEYS = 1 << ROUND_BITS
#: how much longer than its matchmaking and all-reduce deadlines a round is awaited before it
#: is cancelled (a round always ends by itself; this only bounds a hung one)
ROUND_GRACE = 10.0
#: while a round waits for its group, how often the presence records are read to see whether
#: every other peer finished that round without us (then nobody is coming: give up at once)
ROUND_WATCH_INTERVAL = 2.0


class DiLoCoRounds:
    """The round half of ``AsyncDiLoCoOptimizer`` (see the module docstring)."""

    # members of AsyncDiLoCoOptimizer that the rounds use
    run_id: str
    verbose: bool
    inner_steps: int
    load_state_timeout: float
    schedule: StreamingSchedule
    _states_caught_up: int
    averaging_timeout: float
    target_group_size: int | None
    fragments: Fragments
    fragment_averagers: Sequence[DecentralizedAverager]
    averagers: list[AsyncDecentralizedAverager]
    _params: list[torch.Tensor]
    _outer: OuterState
    _lock: threading.Condition
    _pending: dict[int, PendingRound]
    _samples: list[float]
    _inner_step: int
    _tensors_on_loop: bool
    _allreduce_timeout: float
    _seconds_waiting: float
    _bytes_as_sender: int
    _bytes_as_reducer: int
    _failed_as_sender: int
    _failed_as_reducer: int
    _attempts: int
    _failed_attempts: int
    _rounds_averaged: int
    _rounds_alone: int
    _last_group_size: int
    _last_round: RoundStatistics | None

    @property
    def presence(self) -> RunPresence:
        raise NotImplementedError

    async def _load_state_from_peers(self, seconds: float, donors=None) -> bool:
        raise NotImplementedError

    async def _tensor_work(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop for small CPU parameters, else in a worker thread."""
        if self._tensors_on_loop:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args)

    def _start_round_locked(self, action: StartSync) -> PendingRound:
        fragment = action.fragment
        if fragment in self._pending:  # cannot happen with delay < inner_steps
            raise RuntimeError(f"fragment {fragment}'s round started while its last is in flight")
        indices = self.fragments[fragment]
        pseudo_gradient = self._outer.pseudo_gradient(
            self.fragments.select(self._params, fragment), indices
        )
        pending = PendingRound(
            fragment,
            action.round,
            action.step,
            self._samples[fragment],
            pseudo_gradient,
            fingerprint=shared_fingerprint([self._outer.params[i] for i in indices]),
            outer_step=self._outer.outer_step,
        )
        self._pending[fragment] = pending
        self._samples[fragment] = 0.0
        return pending

    async def _launch(self, pending: PendingRound) -> None:
        # (a pseudo-gradient with NaN or inf goes in too: the averager sends zeros with weight
        # 0 instead, so the others wait for nobody, and the step fails: see _finish_round)
        others = await self.presence.others()
        pending.others = len(others)
        if not others:  # nobody to average with: no matchmaking wait
            log = logger.info if self.verbose else logger.debug
            log("no other peer in run %r: outer step alone", self.run_id)
            return
        if everyone_done(others, pending.start_step):
            # Every other peer already finished this round (or a later one): nobody will
            # come to this one (we fell behind: a slow step, a failed round). Step alone at
            # once; _finish_round then loads their state, which puts us in their rounds.
            logger.warning(
                "DiLoCo fragment %d: every other peer of run %r is done with the round of "
                "inner step %d: stepping alone, then loading their state",
                pending.fragment,
                self.run_id,
                pending.start_step,
            )
            return
        if self._pending.get(pending.fragment) is not pending:  # cancelled meanwhile
            return
        # With no target size, the group is complete once every peer present has joined.
        expected = 1 + len(others) if self.target_group_size is None else None
        averager = self.averagers[pending.fragment]
        await self._tensor_work(self._fill_buffers, pending)
        try:
            # The round number in the bucket key (for this step only, retries included):
            # only peers in the same round of this fragment meet, so a straggler never mixes
            # in another round's pseudo-gradient.
            pending.control = averager.start_step(
                {
                    "inner_step": pending.start_step,
                    "weight": pending.weight,
                    "fingerprint": pending.fingerprint,
                    "outer_step": pending.outer_step,
                },
                None,
                pending.weight,
                self.averaging_timeout,
                expected_group_size=expected,
                group_bits=format(pending.round % ROUND_KEYS, f"0{ROUND_BITS}b"),
            )
        except Exception as e:  # the averager is down: step alone
            logger.warning("could not start averaging: %r", e)

    def _fill_buffers(self, pending: PendingRound) -> None:
        with self.fragment_averagers[pending.fragment].get_tensors() as buffers:
            for buffer, value in zip(buffers, pending.local_pseudo_gradient, strict=True):
                buffer.copy_(value)

    def _averaged(self, fragment: int) -> list[torch.Tensor]:
        with self.fragment_averagers[fragment].get_tensors() as buffers:
            return [b.clone() for b in buffers]

    async def _wait_for_round(self, pending: PendingRound) -> tuple[dict | None, int, list | None]:
        """The round's gathered data, group size and averaged pseudo-gradient (None, 1, None
        if it failed or ran past its deadlines)."""
        control = pending.control
        if control is None:
            return None, 1, None
        bound = self.averaging_timeout + self._allreduce_timeout + ROUND_GRACE
        gave_up = False

        async def watch_others() -> None:
            nonlocal gave_up
            while not control.began_allreduce:
                await trio.sleep(ROUND_WATCH_INTERVAL)
                others = await self.presence.others()
                if not control.began_allreduce and others:
                    if everyone_done(others, pending.start_step):
                        gave_up = True
                        control.cancel()
                        return

        try:
            with trio.fail_after(bound):
                failure: Exception | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_others)
                    try:  # (kept: an error raised in a nursery's body would come out grouped)
                        gathered = await control.wait_result()
                    except Exception as e:
                        failure = e
                    nursery.cancel_scope.cancel()
                if failure is not None:
                    raise failure
            group_size = len(gathered)
            averaged = None
            if group_size >= 2:
                averaged = await self._tensor_work(self._averaged, pending.fragment)
            check_lockstep(gathered, pending)
            return gathered, group_size, averaged
        except trio.TooSlowError:
            control.cancel()
            logger.warning(
                "DiLoCo round of fragment %d at inner step %d ran past %.0f s, applying the "
                "local pseudo-gradient alone",
                pending.fragment,
                pending.start_step,
                bound,
            )
        except Exception as e:  # MatchmakingError, AllReduceError, cancelled (a new state)
            if gave_up:
                logger.warning(
                    "DiLoCo fragment %d: every other peer of run %r finished the round of "
                    "inner step %d while we waited for it: stepping alone, then loading "
                    "their state",
                    pending.fragment,
                    self.run_id,
                    pending.start_step,
                )
                return None, 1, None
            logger.warning(
                "DiLoCo round of fragment %d at inner step %d failed, applying the local "
                "pseudo-gradient alone: %s",
                pending.fragment,
                pending.start_step,
                e,
            )
        return None, 1, None

    async def _finish_round(self, fragment: int, alpha: float) -> None:
        pending = self._pending.get(fragment)
        if pending is None:  # we joined while the round was in flight: not ours to apply
            return
        started = trio.current_time()
        gathered, group_size, averaged = await self._wait_for_round(pending)
        waited = trio.current_time() - started
        control = pending.control
        with self._lock:
            self._seconds_waiting += waited
            if control is not None:  # every attempt's bytes count, failed ones apart too
                self._count_round_bytes(control)
        applied = await self._tensor_work(self._apply_round, pending, averaged, alpha)
        if applied is None:  # cancelled (load_state_from_peers) meanwhile
            return
        if not applied:
            group_size, gathered = 1, None
        with self._lock:
            self._last_group_size = group_size
            self._last_round = round_statistics(pending, group_size)
        log = logger.info if self.verbose else logger.debug
        log(
            "DiLoCo outer step %d (fragment %d, inner step %d): group of %d, waited %.2f s",
            self._outer.outer_step,
            fragment,
            self._inner_step,
            group_size,
            waited,
        )
        # (declared once the round is over: a store during matchmaking would compete with the
        # matchmaking's own DHT requests)
        self.presence.declare_step(pending.start_step)
        if gathered is not None:
            await adopt_reference_state(self, gathered, pending)
        elif pending.others:
            await catch_up(self, pending)

    def _abandon_rounds(self, actions: Sequence[ApplyOuter]) -> None:
        """A step stopped before it applied these rounds: those still pending are cancelled
        and apply our own pseudo-gradient alone now (plain: runs in the cancelled step)."""
        for action in actions:
            pending = self._pending.get(action.fragment)
            if pending is None:
                continue
            logger.warning(
                "DiLoCo round of fragment %d at inner step %d was interrupted: applying the "
                "local pseudo-gradient alone",
                pending.fragment,
                pending.start_step,
            )
            if pending.control is not None:
                pending.control.cancel()
                with self._lock:
                    self._count_round_bytes(pending.control)
            if self._apply_round(pending, None, action.alpha) is not None:
                with self._lock:
                    self._last_group_size = 1
                    self._last_round = round_statistics(pending, 1)

    def _count_round_bytes(self, control: StepControl) -> None:
        (parts, deltas), (failed_parts, failed_deltas) = (
            control.bytes_sent,
            control.failed_bytes_sent,
        )
        self._bytes_as_sender += parts
        self._bytes_as_reducer += deltas
        self._failed_as_sender += failed_parts
        self._failed_as_reducer += failed_deltas
        self._attempts += control.attempts
        self._failed_attempts += control.failed_attempts

    def _apply_round(
        self, pending: PendingRound, averaged: list | None, alpha: float
    ) -> bool | None:
        """Apply the average (True), or our own pseudo-gradient alone (False); None if the
        round was cancelled meanwhile (a state was loaded)."""
        fragment = pending.fragment
        indices = self.fragments[fragment]
        model_params = self.fragments.select(self._params, fragment)
        with self._lock:
            if self._pending.get(fragment) is not pending:
                return None
            applied = False
            if averaged is not None:
                try:
                    self._outer.apply_outer_step(
                        averaged, indices, model_params=model_params, alpha=alpha
                    )
                    applied = True
                except ValueError as e:  # a NaN from a peer: nothing changed yet
                    logger.warning("averaged pseudo-gradient unusable (%s): stepping alone", e)
            if applied:
                self._rounds_averaged += 1
            else:
                if first_non_finite(pending.local_pseudo_gradient) is None:
                    self._outer.apply_outer_step(
                        pending.local_pseudo_gradient,
                        indices,
                        model_params=model_params,
                        alpha=alpha,
                    )
                else:  # diverged inner steps: back to the shared parameters, unchanged
                    logger.warning(
                        "fragment %d: the local pseudo-gradient holds NaN or inf, so the "
                        "shared parameters stay as they were and the model restarts from them",
                        fragment,
                    )
                    self._outer.copy_to(model_params, indices)
                self._rounds_alone += 1
            del self._pending[fragment]
            self._lock.notify_all()
            return applied

    def _cancel_pending_locked(self) -> None:
        pending, self._pending = self._pending, {}
        for round_ in pending.values():
            if round_.control is not None:
                round_.control.cancel()
        self._lock.notify_all()
