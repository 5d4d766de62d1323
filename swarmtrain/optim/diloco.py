"""``DiLoCoOptimizer``: DiLoCo across peers, behind a torch-optimizer interface.

Each peer trains alone with its *inner* optimizer (AdamW by default). Every ``inner_steps``
(H) inner steps it computes its pseudo-gradient ``shared - local`` (fp32, on the CPU; see
:class:`~swarmtrain.optim.diloco_core.OuterState`), averages it with the peers it finds through
the DHT (a :class:`~swarmtrain.averaging.DecentralizedAverager` whose averaged tensors are the
pseudo-gradient buffers; each peer's weight is the number of samples it processed since the
last outer step), feeds the average to the *outer* optimizer (SGD, lr 0.7, Nesterov momentum
0.9 by default) and writes the new shared parameters into the model::

    dht = DHT(initial_peers=[...])          # trio: see swarmtrain.optim.async_diloco
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="my_run", inner_steps=500,
                          batch_size_per_step=32)
    opt.load_state_from_peers()      # a peer that joins a running swarm
    for batch in data:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()                   # every 500th call also averages and takes the outer step
    opt.shutdown(); dht.shutdown()

Behaviour worth knowing:

- **Same start.** Every peer should start from the same parameters (build the model under the
  same seed) or call :meth:`~DiLoCoOptimizer.load_state_from_peers`, which downloads the shared
  parameters, the outer optimizer's state and the step counters from a peer of the run (it
  returns False at once when no other peer of the run serves its state). The joiner checks
  a donor's state before it uses any of it (``diloco_state.check_state``: our shapes, fp32
  without casts, finite values, the outer optimizer's structure and hyperparameters; ``lr`` up
  to ``max_donor_lrs``): a donor that fails is banned for 10 minutes and the next one is
  tried. Each round's gather
  data carries a fingerprint of the shared parameters (a few values at fixed positions,
  ``diloco_state.shared_fingerprint``): a peer whose fingerprint is not the one the group
  follows (the largest matching class; ties: the furthest outer step, then the smallest peer
  id) warns and loads the state of that class's peers right after the round (with ``delay``
  > 0 it only warns: donors serve no state while rounds overlap).
- **Who is there.** Each peer declares itself in the DHT (``diloco_peers.RunPresence``). A
  peer alone in its run starts no matchmaking (its round is "alone" at once, see
  **Elastic**), and with ``target_group_size=None`` a group is complete as soon as every peer
  present has joined, instead of waiting out ``matchmaking_time``.
- **NaN.** A peer whose pseudo-gradient holds NaN or inf (diverged inner steps) sends zeros
  with weight 0 instead (the others average without it at once), keeps the shared parameters
  unchanged and restarts its model from them.
- **Lockstep by counting.** Peers sync after the same inner step numbers (multiples of H): a
  joiner adopts its donor's inner step count, so it syncs with the others at the next multiple
  of H, with a weight of the samples it processed until then. The round number is part of
  the matchmaking key (the averager's group bits), so peers only ever average the same round
  of the same fragment: a peer that arrives after the others' group started steps alone in
  that round (see **Elastic**) instead of mixing its pseudo-gradient into another round.
- **Elastic.** A peer that leaves is simply absent from the next round. If a round fails (too
  few peers, timeout, nobody else took part) the peer logs a warning and applies *its own*
  pseudo-gradient alone: training goes on, and that peer's shared parameters drift from the
  others' until it loads the state again (``statistics().rounds_alone`` counts such rounds).
  Each peer's presence record carries the inner step of the last round it finished: a peer
  that finds every other peer already done with its round (it fell behind: a slow step, a failed
  round) steps alone at once instead of waiting out its matchmaking, and after a round alone
  a peer that sees others a round or more ahead loads their state, hence their inner step
  count, and meets them in their next round (``statistics().states_caught_up``; with
  ``delay`` > 0 it only warns). Without that, rounds being keyed by their number, it would
  stay one round behind, alone in every round.
- **Overlap.** With ``delay`` (tau) > 0 the all-reduce of a round runs in the background while
  training continues; its result is applied ``delay`` inner steps later and mixed into the
  local parameters with ``alpha`` (``p = alpha * p + (1 - alpha) * shared``).
- **Streaming** (``num_fragments`` F > 1, Streaming DiLoCo): the parameters are split into F
  contiguous fragments (:meth:`Fragments.for_parameters
  <swarmtrain.optim.diloco_core.Fragments.for_parameters>`, the same split on every peer);
  fragment ``p`` syncs after inner steps ``(p + 1) H / F + k H`` and is applied ``delay`` steps
  later, exactly as :class:`~swarmtrain.optim.diloco_core.StreamingSchedule` says. Each
  fragment has its own averager (prefix ``{run_id}_diloco_{p}of{F}``) whose tensors are that
  fragment's pseudo-gradient buffers, so a round sends only that fragment and rounds of
  different fragments may overlap; the outer optimizer steps only that fragment's parameters
  (its momentum is per parameter, hence per fragment). Each round is weighted by the samples
  processed since that fragment's previous sync. Only fragment 0's averager serves the state
  to joiners; it waits for a moment when no round is in flight (with ``delay`` >= H / F there
  may be none: keep ``delay < H / F`` if peers join mid-run).
- **Bytes.** ``statistics().bytes_sent`` is the pseudo-gradient payload this peer wrote in
  its rounds' all-reduce attempts: parts sent as a sender and averaged parts returned as a
  reducer; framing is not counted. A round whose group failed and that found another group
  before its deadline makes several attempts: ``statistics()`` counts them
  (``allreduce_attempts``, ``failed_allreduce_attempts``) and the bytes of the failed ones
  (``failed_bytes_as_sender`` / ``_as_reducer``, included in the totals), and ``last_round``
  says the same of the last round.
- It is not a ``torch.optim.Optimizer`` subclass: give learning-rate schedulers
  ``opt.inner_optimizer``.

One implementation: this class is a blocking facade over
:class:`~swarmtrain.optim.async_diloco.AsyncDiLoCoOptimizer` running on swarmtrain's background
trio loop (the DHT's). An inner step that neither starts nor applies a round runs entirely in
the caller's thread (it never enters the loop); one that does waits for the loop's part of it.
A trio trainer uses ``async with DiLoCoOptimizer.create(..., dht=async_dht) as opt: await
opt.step()``; an asyncio one ``await opt.aio.step()``.

Resource handling: the optimizer owns its averagers and its presence record (stopped by
:meth:`shutdown`, which cancels a round in flight; ``step()`` raises afterwards); the DHT
belongs to the caller. Call :meth:`step` and the other methods from one training thread.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from swarmtrain.averaging import DecentralizedAverager
from swarmtrain.optim._diloco_rounds import ROUND_BITS, ROUND_KEYS
from swarmtrain.optim.async_diloco import AsyncDiLoCoOptimizer, InnerOptimizer
from swarmtrain.optim.diloco_core import Fragments, StreamingSchedule
from swarmtrain.optim.diloco_peers import Present, RunPresence
from swarmtrain.optim.diloco_records import DiLoCoStatistics, RoundStatistics
from swarmtrain.optim.diloco_state import STATE_FORMAT, pack_state, unpack_state
from swarmtrain.utils.background import BackgroundRuntime, BackgroundService
from swarmtrain.utils.facade import (
    AioNamespace,
    aio_namespace,
    aio_property,
    forward,
    run_in_worker_thread,
)

__all__ = [
    "ROUND_BITS",
    "ROUND_KEYS",
    "STATE_FORMAT",
    "AsyncDiLoCoOptimizer",
    "DiLoCoOptimizer",
    "DiLoCoStatistics",
    "InnerOptimizer",
    "RoundStatistics",
    "pack_state",
    "unpack_state",
]


class DiLoCoOptimizer(BackgroundService):
    """DiLoCo over the swarm; see the module docstring.

    :param params: the model's parameters (tensors or param-group dicts), in the same order on
      every peer; with an optimizer *instance* as ``inner_optimizer``, they must be its params
    :param dht: a running blocking :class:`~swarmtrain.dht.DHT` (the caller's: we never close it)
    :param run_id: the name of the run; peers with the same ``run_id`` average together
    :param inner_optimizer: an optimizer over ``params``, or a factory ``f(params)``; default
      AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.01)
    :param inner_steps: H, inner steps between two outer steps (of the same fragment)
    :param outer_optimizer: builds the outer optimizer from the offloaded shared parameters;
      default :data:`~swarmtrain.optim.diloco_core.default_outer_optimizer`
    :param pseudo_grad_compression: codec for the pseudo-gradients in all-reduce
      (default fp16)
    :param batch_size_per_step: samples per inner step (our weight in the average is the
      samples since the fragment's last sync); None: each inner step counts as one sample
    :param aggregation: how pseudo-gradients are averaged: ``"mean"`` or ``"centered_clip"``
      (robust to a minority of peers sending garbage; see ``AveragerConfig``)
    :param averager_opts: more :class:`~swarmtrain.averaging.AveragerConfig` keywords for the
      averagers (they override the ones derived from the arguments here)
    :param matchmaking_time: the averager's ``min_matchmaking_time``: how long a round waits
      for peers before it starts with the group it has (without a ``target_group_size`` it
      starts as soon as every peer of the run has joined)
    :param averaging_timeout: give up a round after this many seconds of matchmaking (retries
      included), and an all-reduce after as many more
    :param min_group_size: fewest peers (us included) to average with; below that the round
      fails and we step alone
    :param target_group_size: largest group (None: everyone who shows up)
    :param num_fragments: F, which must divide H: parameters are synced in F fragments at
      staggered inner steps (Streaming DiLoCo); 1: plain DiLoCo
    :param delay: tau in ``[0, inner_steps)``: inner steps each all-reduce overlaps with
      training
    :param alpha: in ``[0, 1)``: weight the local parameters keep when a delayed result arrives
    :param load_state_timeout: default bound for :meth:`load_state_from_peers`
    :param declaration_linger: seconds a matchmaking declaration stays readable in the DHT past
      its expiration (default 5; >= 0): a DHT read slower than ``matchmaking_time`` still finds
      the peers that declared while it ran; 0: declarations expire with the window
    :param verbose: log each round at INFO (else DEBUG) and show swarmtrain's logs on stderr
    """

    _service_name = "this DiLoCoOptimizer"
    #: builds the implementation from the keywords (a subclass of ``AsyncDiLoCoOptimizer``
    #: that, e.g., serves another state may be put here)
    _implementation: Callable[..., AsyncDiLoCoOptimizer] = AsyncDiLoCoOptimizer
    #: the trio way in: ``async with DiLoCoOptimizer.create(params, dht=async_dht, ...)``
    create = AsyncDiLoCoOptimizer.create

    def __init__(self, params: Iterable[Any] | None, *, dht: Any, **kwargs: Any):
        running = getattr(dht, "_running", None)
        dht_runtime, async_dht = running() if running is not None else (None, dht)
        #: the implementation (its torch side is built here, in the caller's thread; it
        #: checks the keywords: the signature shown is ``AsyncDiLoCoOptimizer.__init__``'s)
        self._impl = self._implementation(params, dht=async_dht, **kwargs)
        if dht_runtime is None:
            raise TypeError(
                "DiLoCoOptimizer(dht=...) needs a running blocking swarmtrain DHT; with a trio "
                "DHT (from `async with DHT.create(...)`) use `async with "
                "DiLoCoOptimizer.create(..., dht=dht)`"
            )
        if BackgroundRuntime._instance is not dht_runtime:
            raise RuntimeError("the DHT runs on another background loop (made before a fork?)")
        self.dht = dht
        impl = self._start_in_background(self._impl.open)
        runtime = self._running()[0]
        for view, service in zip(impl.fragment_averagers, impl.averagers, strict=True):
            view._attach(runtime, service)
        self._presence = _PresenceView(runtime, impl.presence)

    # ------------------------------------------------------------------ the implementation's

    @property
    def averagers(self) -> list[DecentralizedAverager]:
        """One blocking averager per fragment (their trio averagers run in the optimizer)."""
        return list(self._impl.fragment_averagers)

    @property
    def averager(self) -> DecentralizedAverager:
        """Fragment 0's averager (the only one with ``num_fragments=1``)."""
        return self._impl.fragment_averagers[0]

    @property
    def presence(self) -> _PresenceView:
        """This peer's presence record; ``presence.others()`` lists the other peers (blocking)."""
        return self._presence

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self._impl.inner_optimizer

    @property
    def fragments(self) -> Fragments:
        """Which parameters each fragment syncs (contiguous, balanced by numel)."""
        return self._impl.fragments

    @property
    def schedule(self) -> StreamingSchedule:
        return self._impl.schedule

    @property
    def run_id(self) -> str:
        return self._impl.run_id

    @property
    def inner_steps(self) -> int:
        return self._impl.inner_steps

    @property
    def num_fragments(self) -> int:
        return self._impl.num_fragments

    @property
    def batch_size_per_step(self) -> int | None:
        return self._impl.batch_size_per_step

    @property
    def averaging_timeout(self) -> float:
        return self._impl.averaging_timeout

    @property
    def load_state_timeout(self) -> float:
        return self._impl.load_state_timeout

    @property
    def target_group_size(self) -> int | None:
        return self._impl.target_group_size

    @property
    def max_donor_lrs(self) -> tuple[float, ...]:
        """The largest outer lr a donor's state may carry, per param group."""
        return self._impl.max_donor_lrs

    # ------------------------------------------------------------------ torch.optim-like

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (change ``lr`` here)."""
        return self._impl.param_groups

    @property
    def state(self) -> Any:
        return self._impl.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self._impl.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._impl.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """One inner step, then what the schedule says: start a fragment's round (its
        all-reduce runs in the background) and/or apply one (waiting for it if needed).

        The inner step runs in this thread; only a step that starts or applies a round enters
        the background loop (and waits there for that part).

        :param closure: re-evaluates the loss (as in torch), run before the inner step
        :param batch_size: samples in this step (default ``batch_size_per_step``, or 1)
        :returns: what ``closure`` returned, or None
        :raises RuntimeError: after :meth:`shutdown`
        """
        runtime, impl = self._running()
        loss, plan = impl._take_inner_step(closure, batch_size)
        if plan:
            runtime.call(impl._run_plan, plan)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the outer state and the counters (rounds in flight
        are not saved: they are cancelled on restart)."""
        return self._impl._state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model's own parameters are the caller's to restore:
        between outer steps they differ from the shared ones)."""
        self._impl._load_state_dict(state)

    # ------------------------------------------------------------------ swarm

    @property
    def local_epoch(self) -> int:
        """Completed outer rounds by our inner step count (``inner_step // inner_steps``)."""
        return self._impl.local_epoch

    @property
    def inner_step(self) -> int:
        return self._impl.inner_step

    @property
    def outer_step(self) -> int:
        """Outer updates applied to the shared parameters (one per fragment round)."""
        return self._impl.outer_step

    def shared_parameters(self) -> list[torch.Tensor]:
        """Copies of the shared parameters (fp32, CPU) after the last outer step."""
        return self._impl.shared_parameters()

    def statistics(self) -> DiLoCoStatistics:
        return self._impl.statistics()

    load_state_from_peers = forward(AsyncDiLoCoOptimizer.load_state_from_peers)
    wait_for_pending_rounds = forward(AsyncDiLoCoOptimizer.wait_for_pending_rounds)

    def shutdown(self, timeout: float | None = None) -> None:
        """Cancel the rounds in flight and stop the averagers (the DHT stays up); a second
        call does nothing. ``step()`` raises afterwards. ``timeout``: cut the close short
        after this many seconds (see ``BackgroundService.shutdown``)."""
        try:
            super().shutdown(timeout)
        finally:
            for view in self._impl.fragment_averagers:
                view.shutdown()

    #: asyncio awaitables, e.g. ``await opt.aio.step()``: the trio implementation's methods
    #: run on the background loop, never blocking the asyncio loop
    aio = aio_property()
    _aio_methods = {
        "step": AsyncDiLoCoOptimizer.step,
        "state_dict": AsyncDiLoCoOptimizer.state_dict,
        "load_state_dict": AsyncDiLoCoOptimizer.load_state_dict,
    }

    @classmethod
    async def aio_create(cls, *args: Any, **kwargs: Any) -> DiLoCoOptimizer:
        """From asyncio: build the optimizer in a worker thread (the loop goes on)."""
        return await run_in_worker_thread(cls, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<DiLoCoOptimizer over {self._impl!r}>"


async def _aio_shutdown(self: AioNamespace, timeout: float | None = None) -> None:
    """From asyncio: :meth:`DiLoCoOptimizer.shutdown` in a worker thread."""
    await run_in_worker_thread(self._owner.shutdown, timeout)


# ``opt.aio``: the generated awaitables, plus ``shutdown``
DiLoCoOptimizer._aio_class = type(  # type: ignore[attr-defined]
    "AsyncioDiLoCoOptimizer",
    (aio_namespace(DiLoCoOptimizer),),
    {"shutdown": _aio_shutdown, "__slots__": (), "__module__": __name__},
)


class _PresenceView:
    """A running :class:`RunPresence` seen from blocking code (``others()`` blocks)."""

    def __init__(self, runtime: BackgroundRuntime, presence: RunPresence):
        self._runtime_presence = (runtime, presence)

    def _running(self) -> tuple[BackgroundRuntime, RunPresence]:
        return self._runtime_presence

    others: Callable[[], list[Present]] = forward(RunPresence.others)

    @property
    def donor(self) -> bool:
        return self._runtime_presence[1].donor


def _show_keywords() -> None:
    """``inspect.signature(DiLoCoOptimizer)`` lists ``AsyncDiLoCoOptimizer``'s keywords."""
    target: Any = DiLoCoOptimizer.__init__
    target.__signature__ = inspect.signature(AsyncDiLoCoOptimizer.__init__)


_show_keywords()
