"""``AsyncDiLoCoOptimizer``: DiLoCo on trio, the one implementation behind both ways in.

::

    async with DHT.create(initial_peers=[...]) as dht:
        async with DiLoCoOptimizer.create(
            model.parameters(), dht=dht, run_id="my_run", inner_steps=500,
            batch_size_per_step=32,
        ) as opt:
            await opt.load_state_from_peers()   # a peer that joins a running swarm
            for batch in data:
                opt.zero_grad()
                loss_fn(model, batch).backward()
                await opt.step()                # every 500th call also averages

Keywords and behaviour: those of the blocking :class:`~swarmtrain.optim.diloco.DiLoCoOptimizer`
(its module docstring), which is a facade over this class on the background loop. Here nothing
runs in a background thread: the fragment averagers (``DecentralizedAverager.open_async``) and
the presence record (:class:`~swarmtrain.optim.diloco_peers.RunPresence`, refreshed by a task)
live in :meth:`create`'s nursery on the caller's loop; an inner step (and the pseudo-gradient of
a round that starts) runs in ``trio.to_thread`` unless the parameters are small CPU tensors;
the outer round (matchmaking, all-reduce, the outer step, the divergence repair and round
catch-up of :mod:`~swarmtrain.optim.diloco_sync`) is awaited, bounded by ``averaging_timeout``.

A step splits in two: :meth:`_take_inner_step` (plain, any thread: the inner optimizer step, the
counters, the pseudo-gradients of rounds that start) returns a :class:`StepPlan`; only a plan
with work in it (a round starts or must be applied) needs :meth:`_run_plan` on the loop. The
blocking facade runs the first half in the caller's thread, so an inner step that touches no
round never enters the loop.

Cancellation: every method can be cancelled; a running thread part finishes first. A step
cancelled (or interrupted by Ctrl-C in the blocking facade) before it applied the rounds due
at its inner step cancels them and applies our own pseudo-gradient alone at once (a round
alone, as when it fails), so no round is left in flight past its apply step; a round that
overlaps later steps (``delay`` > 0) stays in flight until its own apply step.

Resource handling: :meth:`create` starts one averager per fragment, the presence record and
its refresh task; leaving it cancels the rounds in flight, says goodbye (presence), then stops
the averagers. The DHT is the caller's.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Union

import torch
import trio

from swarmtrain.averaging import DecentralizedAverager
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
from swarmtrain.averaging.averager_config import check_declaration_linger
from swarmtrain.averaging.matchmaking_types import DEFAULT_DECLARATION_LINGER
from swarmtrain.averaging.state_checks import StateCheck, TensorSpec
from swarmtrain.compression import CompressionBase, Float16Compression
from swarmtrain.dht import AsyncDHT
from swarmtrain.optim._diloco_rounds import DiLoCoRounds
from swarmtrain.optim._optimizer_state import encode_tensors
from swarmtrain.optim._state_checks import LR_TOLERANCE, initial_lrs, stepped_state
from swarmtrain.optim.diloco_core import (
    ApplyOuter,
    Fragments,
    OuterOptimizerFactory,
    OuterState,
    StartSync,
    StreamingSchedule,
    default_outer_optimizer,
)
from swarmtrain.optim.diloco_peers import RunPresence
from swarmtrain.optim.diloco_records import (
    DiLoCoStatistics,
    PendingRound,
    RoundStatistics,
    StepPlan,
)
from swarmtrain.optim.diloco_simulation import default_inner_optimizer
from swarmtrain.optim.diloco_state import (
    check_positive,
    check_positive_int,
    check_state,
    flatten_params,
    pack_state,
    unpack_state,
)
from swarmtrain.utils.logs import show_logs

__all__ = ["AsyncDiLoCoOptimizer", "DiLoCoStatistics", "InnerOptimizer", "RoundStatistics"]

logger = logging.getLogger("swarmtrain.optim.diloco")

#: parameters up to this size (on the CPU) take their inner steps and round copies on the loop
#: (cheaper than a hop to a worker thread); larger ones, and steps with a closure (forward and
#: backward), run in ``trio.to_thread``
INLINE_STEP_MAX_BYTES = 256 << 10

InnerOptimizer = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]


class AsyncDiLoCoOptimizer(DiLoCoRounds):
    """DiLoCo over the swarm on trio; build it with ``async with DiLoCoOptimizer.create(...)``
    (``dht``: an ``AsyncDHT`` from ``DHT.create``). Keywords: those of ``DiLoCoOptimizer``."""

    def __init__(
        self,
        params: Iterable[Any] | None,
        *,
        dht,
        run_id: str,
        inner_optimizer: InnerOptimizer | None = None,
        inner_steps: int,
        outer_optimizer: OuterOptimizerFactory | None = None,
        pseudo_grad_compression: CompressionBase | None = None,
        batch_size_per_step: int | None = None,
        aggregation: str = "mean",
        averager_opts: dict[str, Any] | None = None,
        matchmaking_time: float = 15.0,
        averaging_timeout: float = 60.0,
        min_group_size: int = 2,
        target_group_size: int | None = None,
        num_fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        load_state_timeout: float = 60.0,
        declaration_linger: float = DEFAULT_DECLARATION_LINGER,
        verbose: bool = False,
    ):
        """Check the keywords and build the torch side (no network yet): use :meth:`create`."""
        if not isinstance(run_id, str) or not run_id or "." in run_id or "::" in run_id:
            raise ValueError(f"run_id must be a non-empty string without '.' or '::': {run_id!r}")
        check_positive_int("batch_size_per_step", batch_size_per_step, allow_none=True)
        check_positive_int("min_group_size", min_group_size)
        check_positive_int("target_group_size", target_group_size, allow_none=True)
        check_positive_int("num_fragments", num_fragments)
        check_positive("matchmaking_time", matchmaking_time)
        check_positive("averaging_timeout", averaging_timeout)
        check_positive("load_state_timeout", load_state_timeout)
        check_declaration_linger(declaration_linger)
        # Validates inner_steps, num_fragments | inner_steps, delay and alpha with clear errors.
        self.schedule = StreamingSchedule(inner_steps, num_fragments, delay, alpha)
        if pseudo_grad_compression is None:
            pseudo_grad_compression = Float16Compression()
        if not isinstance(pseudo_grad_compression, CompressionBase):
            raise TypeError("pseudo_grad_compression must be a swarmtrain.compression codec")

        if isinstance(inner_optimizer, torch.optim.Optimizer):
            self._params = flatten_params(inner_optimizer.param_groups)
            if params is not None and {id(p) for p in flatten_params(params)} != {
                id(p) for p in self._params
            }:
                raise ValueError("params must be the parameters of the inner optimizer instance")
            self.inner_optimizer = inner_optimizer
        else:
            if params is None:
                raise ValueError("params is required unless inner_optimizer is an instance")
            params = list(params)
            self._params = flatten_params(params)
            factory = inner_optimizer if inner_optimizer is not None else default_inner_optimizer
            if not callable(factory):
                raise TypeError("inner_optimizer must be an optimizer or a factory f(params)")
            self.inner_optimizer = factory(params)
            if not isinstance(self.inner_optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"inner_optimizer must build a torch.optim.Optimizer, "
                    f"got {self.inner_optimizer!r}"
                )
        #: which parameters each fragment syncs (contiguous, balanced by numel)
        self.fragments = Fragments.for_parameters(self._params, num_fragments)
        if not isinstance(dht, AsyncDHT):
            raise TypeError(
                f"dht must be a running trio swarmtrain DHT (from `async with "
                f"DHT.create(...) as dht`), got {type(dht).__name__}; with a blocking DHT use "
                "swarmtrain.DiLoCoOptimizer(dht=...)"
            )

        self.run_id = run_id
        self.dht = dht
        self.inner_steps = inner_steps
        self.num_fragments = num_fragments
        self.batch_size_per_step = batch_size_per_step
        self.averaging_timeout = float(averaging_timeout)
        self.load_state_timeout = float(load_state_timeout)
        self.target_group_size = target_group_size
        self.verbose = verbose
        if verbose:
            show_logs()
        self._outer = OuterState(self._params, outer_optimizer)
        self._outer_factory = outer_optimizer or default_outer_optimizer
        #: the largest outer lr a donor's state may carry, per param group (see ``check_state``)
        self.max_donor_lrs = tuple(LR_TOLERANCE * lr for lr in initial_lrs(self._outer.optimizer))
        self._stepped_outer_state: tuple[Any, Sequence[TensorSpec]] | None = None
        #: inner steps and the tensor work of rounds run on the loop (small CPU parameters)
        self._tensors_on_loop = _runs_on_loop(self._params)
        # Guards the outer state, the step counters and the rounds in flight: a step changes
        # them, a worker thread reads them for newcomers (``_current_state``).
        self._lock = threading.Condition()
        self._inner_step = 0
        self._samples = [0.0] * num_fragments  # per fragment, since its last sync started
        self._pending: dict[int, PendingRound] = {}
        self._rounds_averaged = self._rounds_alone = 0
        self._states_caught_up = 0
        self._last_group_size = 0
        self._bytes_as_sender = self._bytes_as_reducer = 0
        self._failed_as_sender = self._failed_as_reducer = 0
        self._attempts = self._failed_attempts = 0
        self._last_round: RoundStatistics | None = None
        self._seconds_waiting = 0.0
        self._closed = False

        opts: dict[str, Any] = {
            "min_matchmaking_time": float(matchmaking_time),
            "request_timeout": min(3.0, matchmaking_time / 2),
            "allreduce_timeout": float(averaging_timeout),
            "min_group_size": min_group_size,
            "target_group_size": target_group_size,
            "aggregation": aggregation,
            "declaration_linger": float(declaration_linger),
        }
        opts.update(averager_opts or {})
        opts.setdefault("compression", pseudo_grad_compression)
        self._allreduce_timeout = float(opts["allreduce_timeout"] or averaging_timeout)
        #: the torch side of each fragment's averager (its pseudo-gradient buffers, their
        #: lock, its config); fragment 0's also serves the state to joiners
        self.fragment_averagers: list[_FragmentAverager] = []
        for f, group in enumerate(self.fragments.groups):
            prefix = (
                f"{run_id}_diloco"
                if num_fragments == 1
                else f"{run_id}_diloco_{f}of{num_fragments}"
            )
            fragment_opts = dict(opts)
            if f > 0:
                fragment_opts["allow_state_sharing"] = False
            self.fragment_averagers.append(
                _FragmentAverager(
                    [torch.zeros_like(self._outer.params[i]) for i in group],
                    dht,
                    prefix=prefix,
                    start=False,
                    **fragment_opts,
                )
            )
        self._donor = not self.fragment_averagers[0].client_mode and opts.get(
            "allow_state_sharing", True
        )
        # set by open()
        #: the running trio averagers, one per fragment
        self.averagers: list[AsyncDecentralizedAverager] = []
        self._presence: RunPresence | None = None
        self._busy = trio.StrictFIFOLock()  # step / load_state_from_peers: one at a time

    @classmethod
    @asynccontextmanager
    async def create(
        cls, params: Iterable[Any] | None = None, **kwargs: Any
    ) -> AsyncIterator[AsyncDiLoCoOptimizer]:
        """Start a DiLoCo optimizer on a running ``AsyncDHT`` (keywords: ``DiLoCoOptimizer``'s);
        building the torch side (the shared copies, the outer optimizer) runs in a worker
        thread."""
        self = await trio.to_thread.run_sync(functools.partial(cls, params, **kwargs))
        async with self.open():
            yield self

    @asynccontextmanager
    async def open(self) -> AsyncIterator[AsyncDiLoCoOptimizer]:
        """Start the averagers and the presence record of an optimizer built by the
        constructor (what :meth:`create` does after building it)."""
        if self.averagers or self._closed:
            raise RuntimeError("this DiLoCoOptimizer was already started")
        async with AsyncExitStack() as stack:
            for averager in self.fragment_averagers:
                self.averagers.append(
                    await stack.enter_async_context(
                        averager.open_async(self.dht, state_provider=self._current_state)
                    )
                )
            #: this peer's record in the run (who else is there: see diloco_peers)
            self._presence = await stack.enter_async_context(
                RunPresence.create(self.dht, self.run_id, donor=self._donor)
            )
            try:
                yield self
            finally:
                self._closed = True
                with self._lock:
                    self._cancel_pending_locked()

    @property
    def presence(self) -> RunPresence:
        """This peer's presence record in the run (and the others': ``await .others()``)."""
        if self._presence is None:
            raise RuntimeError("this DiLoCoOptimizer is not running: start it with create()")
        return self._presence

    @property
    def averager(self) -> AsyncDecentralizedAverager:
        """Fragment 0's averager (the only one with ``num_fragments=1``)."""
        return self.averagers[0]

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("this DiLoCoOptimizer was shut down")
        if not self.averagers:
            raise RuntimeError("this DiLoCoOptimizer is not running: start it with create()")

    # ------------------------------------------------------------------ torch.optim-like

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (change ``lr`` here)."""
        return self.inner_optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.inner_optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner_optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    async def step(
        self, closure: Callable[[], Any] | None = None, batch_size: int | None = None
    ) -> Any:
        """One inner step, then what the schedule says: start a fragment's round (its
        all-reduce runs in the background) and/or apply one (waiting for it if needed).

        :param closure: re-evaluates the loss (as in torch), run before the inner step (in
          the same thread as the inner step)
        :param batch_size: samples in this step (default ``batch_size_per_step``, or 1)
        :returns: what ``closure`` returned, or None
        :raises RuntimeError: after the optimizer was closed
        """
        self._check_running()
        async with self._busy:
            if self._tensors_on_loop and closure is None:
                loss, plan = self._take_inner_step(None, batch_size)
            else:
                loss, plan = await trio.to_thread.run_sync(
                    self._take_inner_step, closure, batch_size
                )
            if plan:
                await self._run_plan(plan)
            return loss

    def _take_inner_step(
        self, closure: Callable[[], Any] | None, batch_size: int | None
    ) -> tuple[Any, StepPlan]:
        """The inner step and its bookkeeping (plain: any thread, one at a time): what is
        left to do on the loop, if anything."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if batch_size is None:
            batch_size = self.batch_size_per_step or 1
        check_positive("batch_size", batch_size)
        self.inner_optimizer.step()
        plan = StepPlan()
        with self._lock:
            self._inner_step += 1
            self._samples = [s + batch_size for s in self._samples]
            actions = self.schedule.actions(self._inner_step)
            for action in actions:
                if isinstance(action, StartSync):
                    plan.started.append(self._start_round_locked(action))
                elif isinstance(action, ApplyOuter):
                    plan.apply.append(action)
        return loss, plan

    async def _run_plan(self, plan: StepPlan) -> None:
        """Launch the rounds an inner step started, then apply those due (on the loop). If
        this is cancelled (or Ctrl-C), the rounds due now that are still pending step alone
        at once: none is left in flight past its apply step."""
        try:
            for pending in plan.started:
                await self._launch(pending)
            for action in plan.apply:
                await self._finish_round(action.fragment, action.alpha)
        except BaseException:
            self._abandon_rounds(plan.apply)
            raise

    async def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the outer state and the counters (rounds in flight
        are not saved: they are cancelled on restart)."""
        return await trio.to_thread.run_sync(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "outer": self._outer.state_dict(),
                "inner_step": self._inner_step,
                "samples": list(self._samples),
            }

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model's own parameters are the caller's to restore:
        between outer steps they differ from the shared ones)."""
        async with self._busy:
            await trio.to_thread.run_sync(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        inner_step = state["inner_step"]
        if isinstance(inner_step, bool) or not isinstance(inner_step, int) or inner_step < 0:
            raise ValueError(f"inner_step must be a non-negative integer, got {inner_step!r}")
        samples = state.get("samples", 0.0)
        samples = [float(samples)] * self.num_fragments if _is_number(samples) else samples
        if len(samples) != self.num_fragments:
            raise ValueError(
                f"the state has sample counts for {len(samples)} fragments, we have "
                f"{self.num_fragments}: restore it with the same num_fragments"
            )
        with self._lock:
            self._cancel_pending_locked()
            self._outer.load_state_dict(state["outer"])
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
            self._inner_step = inner_step
            self._samples = [float(s) for s in samples]

    # ------------------------------------------------------------------ swarm

    @property
    def local_epoch(self) -> int:
        """Completed outer rounds by our inner step count (``inner_step // inner_steps``)."""
        return self._inner_step // self.inner_steps

    @property
    def inner_step(self) -> int:
        return self._inner_step

    @property
    def outer_step(self) -> int:
        """Outer updates applied to the shared parameters (one per fragment round)."""
        return self._outer.outer_step

    def shared_parameters(self) -> list[torch.Tensor]:
        """Copies of the shared parameters (fp32, CPU) after the last outer step."""
        with self._lock:
            return [p.detach().clone() for p in self._outer.params]

    def statistics(self) -> DiLoCoStatistics:
        with self._lock:
            return DiLoCoStatistics(
                inner_step=self._inner_step,
                outer_step=self._outer.outer_step,
                rounds_averaged=self._rounds_averaged,
                rounds_alone=self._rounds_alone,
                last_group_size=self._last_group_size,
                bytes_sent=self._bytes_as_sender + self._bytes_as_reducer,
                bytes_sent_as_sender=self._bytes_as_sender,
                bytes_sent_as_reducer=self._bytes_as_reducer,
                seconds_waiting=self._seconds_waiting,
                states_caught_up=self._states_caught_up,
                allreduce_attempts=self._attempts,
                failed_allreduce_attempts=self._failed_attempts,
                failed_bytes_as_sender=self._failed_as_sender,
                failed_bytes_as_reducer=self._failed_as_reducer,
                last_round=self._last_round,
            )

    async def load_state_from_peers(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 (hivemind's keyword)
        donors=None,
    ) -> bool:
        """Download the shared parameters, the outer optimizer's state and the step counters
        from a peer of the run and write the shared parameters into the model.

        The inner optimizer keeps its own state. Returns False at once when no other peer of
        the run serves its state (a lone peer keeps its own parameters); else tries again
        until ``timeout`` (default ``load_state_timeout``) if nobody answers. Returns whether
        a state was loaded. ``donors``: only from these peers (ids as bytes or ``PeerID``).

        :raises RuntimeError: after the optimizer was closed
        """
        self._check_running()
        timeout = self.load_state_timeout if timeout is None else timeout
        check_positive("timeout", timeout)
        async with self._busy:
            return await self._load_state_from_peers(timeout, donors)

    async def _load_state_from_peers(self, seconds: float, donors=None) -> bool:
        if not any(peer.donor for peer in await self.presence.others()):
            logger.info(
                "no other peer of run %r serves its DiLoCo state: keeping this peer's own "
                "parameters",
                self.run_id,
            )
            return False
        with trio.move_on_after(seconds) as scope:
            while True:
                check = await trio.to_thread.run_sync(self._state_check)
                remaining = max(scope.deadline - trio.current_time(), 0.0)
                loaded = await self.averager.load_state_from_peers(
                    timeout=remaining, donors=donors, check=check
                )
                failure = self.averager.state_download_failure
                if loaded is None and failure is not None and failure.banned and not failure.donors:
                    logger.warning(
                        "every donor of run %r served a state that failed our checks: they are "
                        "banned for a while, keeping this peer's own state",
                        self.run_id,
                    )
                    return False
                if loaded is not None:
                    try:
                        inner_step = await trio.to_thread.run_sync(self._adopt_state, loaded)
                    except (ValueError, TypeError, KeyError, AttributeError) as e:
                        logger.warning("a peer sent an unusable DiLoCo state: %r", e)
                    else:
                        logger.info(
                            "loaded DiLoCo state: outer step %d, inner step %d",
                            self.outer_step,
                            inner_step,
                        )
                        return True
                await trio.sleep(0.5)
        logger.warning("could not load the DiLoCo state of %r from peers", self.run_id)
        return False

    def _adopt_state(self, loaded: tuple[Any, list[torch.Tensor]]) -> int:
        metadata, tensors = loaded
        outer_state, inner_step = unpack_state(metadata, tensors)
        with self._lock:
            self._cancel_pending_locked()
            self._outer.load_state_dict(outer_state)
            self._outer.copy_to(self._params)
            self._inner_step = inner_step
            self._samples = [0.0] * self.num_fragments
        return inner_step

    async def wait_for_pending_rounds(self) -> None:
        """Apply the results of rounds still in flight (``delay > 0``) now, fragment by
        fragment, e.g. when training ends; a no-op with ``delay = 0``."""
        self._check_running()
        async with self._busy:
            for fragment in sorted(self._pending):
                await self._finish_round(fragment, self.schedule.alpha)

    # ------------------------------------------------------------------ rounds

    def _state_check(self) -> StateCheck:
        """What a donor's state must look like (ours, now), as a check (``check_state``)."""
        if self._stepped_outer_state is None:
            stepped = stepped_state(self._outer_factory, self._outer.params)
            self._stepped_outer_state = stepped if stepped is not None else ({}, [])
        with self._lock:
            tensors: list[torch.Tensor] = []
            optimizer_metadata = encode_tensors(
                self._outer.optimizer.state_dict(), tensors, copy=False
            )
            return functools.partial(
                check_state,
                params=[TensorSpec.of(p) for p in self._outer.params],
                optimizer_metadata=optimizer_metadata,
                optimizer_specs=[TensorSpec.of(t) for t in tensors],
                stepped=self._stepped_outer_state,
                num_fragments=self.num_fragments,
                lr_limits=self.max_donor_lrs,
            )

    def _current_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """For newcomers (runs in the averager's worker thread): the state once no round is in
        flight — a newcomer that took the state from before a round's result would miss that
        outer update for good."""
        with self._lock:
            if not self._lock.wait_for(lambda: not self._pending, self.averaging_timeout):
                raise TimeoutError("DiLoCo rounds are still in flight")
            return pack_state(self._outer, self._inner_step, {"num_fragments": self.num_fragments})

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} run_id={self.run_id!r} inner_step={self._inner_step} "
            f"outer_step={self._outer.outer_step}>"
        )


class _FragmentAverager(DecentralizedAverager):
    """The torch side of a fragment's averager (built with ``start=False``); its trio averager
    runs inside the optimizer. The blocking ``DiLoCoOptimizer`` attaches that running averager
    (:meth:`_attach`), so the blocking methods (``peer_id``, ``allow_state_sharing``,
    ``state_download_failure``, ...) reach it on the background loop; the optimizer owns it,
    so :meth:`shutdown` only marks this view closed."""

    def _attach(self, runtime: Any, service: AsyncDecentralizedAverager) -> None:
        self._runtime, self._service = runtime, service

    def shutdown(self, timeout: float | None = None) -> None:
        self._shut_down = True


def _runs_on_loop(params: Sequence[torch.Tensor]) -> bool:
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return nbytes <= INLINE_STEP_MAX_BYTES and all(p.device.type == "cpu" for p in params)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
