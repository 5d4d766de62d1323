"""``DiLoCoOptimizer``: DiLoCo across peers, behind a torch-optimizer interface.

Each peer trains alone with its *inner* optimizer (AdamW by default). Every ``inner_steps``
(H) inner steps it computes its pseudo-gradient ``shared - local`` (fp32, on the CPU; see
:class:`~swarmtrain.optim.diloco_core.OuterState`), averages it with the peers it finds through
the DHT (a :class:`~swarmtrain.averaging.DecentralizedAverager` whose averaged tensors are the
pseudo-gradient buffers; each peer's weight is the number of samples it processed since the
last outer step), feeds the average to the *outer* optimizer (SGD, lr 0.7, Nesterov momentum
0.9 by default) and writes the new shared parameters into the model::

    dht = DHT(initial_peers=[...])
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
- **Bytes.** ``statistics().bytes_sent`` is the pseudo-gradient payload this peer wrote, as
  its averagers count it (``DecentralizedAverager.bytes_sent``): parts sent as a sender and
  averaged parts returned as a reducer; framing is not counted.
- It is not a ``torch.optim.Optimizer`` subclass: give learning-rate schedulers
  ``opt.inner_optimizer``.

Resource handling: the optimizer owns its averagers and its presence record (stopped by
:meth:`shutdown`, which cancels a round in flight; ``step()`` raises afterwards); the DHT
belongs to the caller. Call :meth:`step` and the other methods
from one training thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from swarmtrain.averaging import DecentralizedAverager, StepControl
from swarmtrain.averaging.finite import first_non_finite
from swarmtrain.averaging.state_checks import StateCheck, TensorSpec
from swarmtrain.compression import CompressionBase, Float16Compression
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
from swarmtrain.optim.diloco_simulation import default_inner_optimizer
from swarmtrain.optim.diloco_state import (
    STATE_FORMAT,
    _peer_order,
    check_positive,
    check_positive_int,
    check_state,
    flatten_params,
    pack_state,
    reference_peers,
    shared_fingerprint,
    unpack_state,
)
from swarmtrain.utils.facade import close_aio_worker, run_in_worker_thread, thread_aio_property
from swarmtrain.utils.logs import show_logs

__all__ = [
    "STATE_FORMAT",
    "DiLoCoOptimizer",
    "DiLoCoStatistics",
    "InnerOptimizer",
    "pack_state",
    "unpack_state",
]

logger = logging.getLogger(__name__)

#: rounds are told apart in the DHT key by their number modulo ``2 ** ROUND_BITS``
ROUND_BITS = 16
ROUND_KEYS = 1 << ROUND_BITS

InnerOptimizer = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]


@dataclass(frozen=True)
class DiLoCoStatistics:
    """What one peer's optimizer has done so far.

    :param inner_step: inner steps counted since the start of the run (adopted from the donor
      by :meth:`DiLoCoOptimizer.load_state_from_peers`)
    :param outer_step: outer updates applied to the shared parameters (likewise); with F
      fragments each fragment's update counts once, so F per H inner steps
    :param rounds_averaged: rounds (of any fragment) in which we averaged with another peer
    :param rounds_alone: rounds that failed, in which we applied our own pseudo-gradient
    :param last_group_size: peers (us included) in the last round; 1 if it failed
    :param bytes_sent: pseudo-gradient payload we sent, ``bytes_sent_as_sender +
      bytes_sent_as_reducer``
    :param bytes_sent_as_sender: payload of the parts we sent to other reducers (framing
      excluded)
    :param bytes_sent_as_reducer: payload of the averaged parts we returned to other senders
    :param seconds_waiting: wall time ``step()`` spent waiting for averaging results
    :param states_caught_up: times we fell a round behind the others and loaded their state
      to rejoin their rounds
    """

    inner_step: int
    outer_step: int
    rounds_averaged: int
    rounds_alone: int
    last_group_size: int
    bytes_sent: int
    bytes_sent_as_sender: int
    bytes_sent_as_reducer: int
    seconds_waiting: float
    states_caught_up: int = 0


@dataclass
class _Round:
    """A round of one fragment whose sync started and whose result is not applied yet."""

    fragment: int
    round: int
    start_step: int
    weight: float
    local_pseudo_gradient: list[torch.Tensor]
    fingerprint: list[float]  # of the fragment's shared parameters the round started from
    outer_step: int
    control: StepControl | None = None
    bytes_before: tuple[int, int] = (0, 0)  # the averager's bytes_sent at launch
    others: int = 0  # other peers of the run present at launch


class _PseudoGradientAverager(DecentralizedAverager):
    """Averages the pseudo-gradient buffers; newcomers download the optimizer's outer state."""

    def __init__(self, tensors, dht, *, state_provider: Callable[[], Any], **kwargs: Any):
        self._diloco_state = state_provider
        super().__init__(tensors, dht, **kwargs)

    def get_current_state(self) -> Any:
        return self._diloco_state()


class DiLoCoOptimizer:
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
    :param verbose: log each round at INFO (else DEBUG) and show swarmtrain's logs on stderr
    """

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
        verbose: bool = False,
    ):
        if not isinstance(run_id, str) or not run_id or "." in run_id or "::" in run_id:
            raise ValueError(f"run_id must be a non-empty string without '.' or '::': {run_id!r}")
        check_positive_int("batch_size_per_step", batch_size_per_step, allow_none=True)
        check_positive_int("min_group_size", min_group_size)
        check_positive_int("target_group_size", target_group_size, allow_none=True)
        check_positive_int("num_fragments", num_fragments)
        check_positive("matchmaking_time", matchmaking_time)
        check_positive("averaging_timeout", averaging_timeout)
        check_positive("load_state_timeout", load_state_timeout)
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

        self.run_id = run_id
        self.dht = dht
        self.inner_steps = inner_steps
        self.num_fragments = num_fragments
        self.batch_size_per_step = batch_size_per_step
        self.averaging_timeout = float(averaging_timeout)
        self.load_state_timeout = float(load_state_timeout)
        self.verbose = verbose
        if verbose:
            show_logs()
        self._outer = OuterState(self._params, outer_optimizer)
        self._outer_factory = outer_optimizer or default_outer_optimizer
        #: the largest outer lr a donor's state may carry, per param group (see ``check_state``)
        self.max_donor_lrs = tuple(LR_TOLERANCE * lr for lr in initial_lrs(self._outer.optimizer))
        self._stepped_outer_state: tuple[Any, Sequence[TensorSpec]] | None = None
        # Guards the outer state, the step counters and the rounds in flight: the training
        # thread changes them, the averager's worker thread reads them for newcomers.
        self._lock = threading.Condition()
        self._inner_step = 0
        self._samples = [0.0] * num_fragments  # per fragment, since its last sync started
        self._pending: dict[int, _Round] = {}
        self._rounds_averaged = self._rounds_alone = 0
        self._states_caught_up = 0
        self._last_group_size = 0
        self._bytes_as_sender = self._bytes_as_reducer = 0
        self._seconds_waiting = 0.0

        opts: dict[str, Any] = {
            "min_matchmaking_time": float(matchmaking_time),
            "request_timeout": min(3.0, matchmaking_time / 2),
            "allreduce_timeout": float(averaging_timeout),
            "min_group_size": min_group_size,
            "target_group_size": target_group_size,
            "aggregation": aggregation,
        }
        opts.update(averager_opts or {})
        opts.setdefault("compression", pseudo_grad_compression)
        #: one averager per fragment; fragment 0's also serves the state to joiners
        self.averagers: list[_PseudoGradientAverager] = []
        try:
            for f, group in enumerate(self.fragments.groups):
                prefix = (
                    f"{run_id}_diloco"
                    if num_fragments == 1
                    else (f"{run_id}_diloco_{f}of{num_fragments}")
                )
                fragment_opts = dict(opts)
                if f > 0:
                    fragment_opts["allow_state_sharing"] = False
                self.averagers.append(
                    _PseudoGradientAverager(
                        [torch.zeros_like(self._outer.params[i]) for i in group],
                        dht,
                        prefix=prefix,
                        state_provider=self._current_state,
                        start=True,
                        **fragment_opts,
                    )
                )
            #: this peer's record in the run (who else is there: see diloco_peers)
            self.presence = RunPresence(
                dht,
                run_id,
                donor=not self.averagers[0].client_mode and opts.get("allow_state_sharing", True),
            )
            self.presence.start()
        except BaseException:
            for averager in self.averagers:
                averager.shutdown()
            raise
        self.target_group_size = target_group_size
        self._closed = False

    @property
    def averager(self) -> DecentralizedAverager:
        """Fragment 0's averager (the only one with ``num_fragments=1``)."""
        return self.averagers[0]

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

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """One inner step, then what the schedule says: start a fragment's round (its
        all-reduce runs in the background) and/or apply one (waiting for it if needed).

        :param closure: re-evaluates the loss (as in torch), run before the inner step
        :param batch_size: samples in this step (default ``batch_size_per_step``, or 1)
        :returns: what ``closure`` returned, or None
        :raises RuntimeError: after :meth:`shutdown`
        """
        self._check_running()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if batch_size is None:
            batch_size = self.batch_size_per_step or 1
        check_positive("batch_size", batch_size)
        self.inner_optimizer.step()
        started: list[_Round] = []
        with self._lock:
            self._inner_step += 1
            self._samples = [s + batch_size for s in self._samples]
            actions = self.schedule.actions(self._inner_step)
            for action in actions:
                if isinstance(action, StartSync):
                    started.append(self._start_round_locked(action))
        for pending in started:
            self._launch(pending)
        for action in actions:
            if isinstance(action, ApplyOuter):
                self._finish_round(action.fragment, action.alpha)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the outer state and the counters (rounds in flight
        are not saved: they are cancelled on restart)."""
        with self._lock:
            return {
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "outer": self._outer.state_dict(),
                "inner_step": self._inner_step,
                "samples": list(self._samples),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model's own parameters are the caller's to restore:
        between outer steps they differ from the shared ones)."""
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
            )

    def load_state_from_peers(self, timeout: float | None = None, donors=None) -> bool:
        """Download the shared parameters, the outer optimizer's state and the step counters
        from a peer of the run and write the shared parameters into the model.

        The inner optimizer keeps its own state. Returns False at once when no other peer of
        the run serves its state (a lone peer keeps its own parameters); else tries again
        until ``timeout`` (default ``load_state_timeout``) if nobody answers. Returns whether
        a state was loaded. ``donors``: only from these peers (ids as bytes or ``PeerID``).

        :raises RuntimeError: after :meth:`shutdown`
        """
        self._check_running()
        timeout = self.load_state_timeout if timeout is None else timeout
        check_positive("timeout", timeout)
        deadline = time.monotonic() + timeout
        if not any(peer.donor for peer in self.presence.others()):
            logger.info(
                "no other peer of run %r serves its DiLoCo state: keeping this peer's own "
                "parameters",
                self.run_id,
            )
            return False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning("could not load the DiLoCo state of %r from peers", self.run_id)
                return False
            loaded = self.averager.load_state_from_peers(
                timeout=remaining, donors=donors, check=self._state_check()
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
                    metadata, tensors = loaded
                    outer_state, inner_step = unpack_state(metadata, tensors)
                    with self._lock:
                        self._cancel_pending_locked()
                        self._outer.load_state_dict(outer_state)
                        self._outer.copy_to(self._params)
                        self._inner_step = inner_step
                        self._samples = [0.0] * self.num_fragments
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    logger.warning("a peer sent an unusable DiLoCo state: %r", e)
                else:
                    logger.info(
                        "loaded DiLoCo state: outer step %d, inner step %d",
                        self.outer_step,
                        inner_step,
                    )
                    return True
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def wait_for_pending_rounds(self) -> None:
        """Apply the results of rounds still in flight (``delay > 0``) now, fragment by
        fragment, e.g. when training ends; a no-op with ``delay = 0``."""
        for fragment in sorted(self._pending):
            self._finish_round(fragment, self.schedule.alpha)

    def shutdown(self, timeout: float | None = None) -> None:
        """Cancel the rounds in flight and stop the averagers (the DHT stays up); a second
        call does nothing. ``step()`` raises afterwards. ``timeout``: cut each averager's
        close short after this many seconds (see ``BackgroundService.shutdown``)."""
        if self._closed:
            return
        self._closed = True
        close_aio_worker(self)
        with self._lock:
            self._cancel_pending_locked()
        self.presence.stop()
        for averager in self.averagers:
            averager.shutdown(timeout)

    #: asyncio awaitables, e.g. ``await opt.aio.step()``: each runs the blocking method in
    #: this optimizer's worker thread, never blocking the asyncio loop
    aio = thread_aio_property(
        "step", "load_state_from_peers", "wait_for_pending_rounds", "shutdown"
    )

    @classmethod
    async def aio_create(cls, *args: Any, **kwargs: Any) -> DiLoCoOptimizer:
        """From asyncio: build the optimizer in a worker thread (the loop goes on)."""
        return await run_in_worker_thread(cls, *args, **kwargs)

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("this DiLoCoOptimizer was shut down")

    def __enter__(self) -> DiLoCoOptimizer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ rounds

    def _start_round_locked(self, action: StartSync) -> _Round:
        fragment = action.fragment
        if fragment in self._pending:  # cannot happen with delay < inner_steps
            raise RuntimeError(f"fragment {fragment}'s round started while its last is in flight")
        indices = self.fragments[fragment]
        pseudo_gradient = self._outer.pseudo_gradient(
            self.fragments.select(self._params, fragment), indices
        )
        pending = _Round(
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

    def _launch(self, pending: _Round) -> None:
        # (a pseudo-gradient with NaN or inf goes in too: the averager sends zeros with weight
        # 0 instead, so the others wait for nobody, and the step fails: see _finish_round)
        others = self.presence.others()
        pending.others = len(others)
        if not others:  # nobody to average with: no matchmaking wait
            log = logger.info if self.verbose else logger.debug
            log("no other peer in run %r: outer step alone", self.run_id)
            return
        if all(peer.step is not None and peer.step >= pending.start_step for peer in others):
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
        # With no target size, the group is complete once every peer present has joined.
        expected = 1 + len(others) if self.target_group_size is None else None
        averager = self.averagers[pending.fragment]
        with averager.get_tensors() as buffers:
            for buffer, value in zip(buffers, pending.local_pseudo_gradient, strict=True):
                buffer.copy_(value)
        try:
            pending.bytes_before = averager.bytes_sent
            # The round number in the bucket key (for this step only, retries included):
            # only peers in the same round of this fragment meet, so a straggler never mixes
            # in another round's pseudo-gradient.
            pending.control = averager.step(
                gather={
                    "inner_step": pending.start_step,
                    "weight": pending.weight,
                    "fingerprint": pending.fingerprint,
                    "outer_step": pending.outer_step,
                },
                weight=pending.weight,
                timeout=self.averaging_timeout,
                expected_group_size=expected,
                wait=False,
                group_bits=format(pending.round % ROUND_KEYS, f"0{ROUND_BITS}b"),
            )
        except Exception as e:  # the averager is down: step alone
            logger.warning("could not start averaging: %r", e)

    def _finish_round(self, fragment: int, alpha: float) -> None:
        pending = self._pending.get(fragment)
        if pending is None:  # we joined while the round was in flight: not ours to apply
            return
        started = time.perf_counter()
        averaged, group_size, gathered = None, 1, None
        if pending.control is not None:
            try:
                gathered = pending.control.result()
                group_size = len(gathered)
                if group_size >= 2:
                    with self.averagers[fragment].get_tensors() as buffers:
                        averaged = [b.clone() for b in buffers]
                self._check_lockstep(gathered, pending)
            except Exception as e:  # MatchmakingError, AllReduceError, shutdown
                logger.warning(
                    "DiLoCo round of fragment %d at inner step %d failed, applying the local "
                    "pseudo-gradient alone: %s",
                    fragment,
                    pending.start_step,
                    e,
                )
        waited = time.perf_counter() - started
        try:
            parts, deltas = self.averagers[fragment].bytes_sent
        except Exception:  # the averager is down: nothing we can count went out
            parts, deltas = pending.bytes_before
        indices = self.fragments[fragment]
        model_params = self.fragments.select(self._params, fragment)
        with self._lock:
            self._seconds_waiting += waited
            self._bytes_as_sender += parts - pending.bytes_before[0]  # even if the round failed
            self._bytes_as_reducer += deltas - pending.bytes_before[1]
            if self._pending.get(fragment) is not pending:  # cancelled (load_state_from_peers)
                return
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
                group_size = 1
                gathered = None
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
            self._last_group_size = group_size
            del self._pending[fragment]
            self._lock.notify_all()
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
            self._adopt_reference_state(gathered, pending)
        elif pending.others:
            self._catch_up(pending)

    def _peers_ahead(self, others, pending: _Round) -> list:
        """The peers of ``others`` (``RunPresence`` records) that finished a round at least H
        inner steps after ``pending``'s: a round or more ahead of us."""
        return [
            peer
            for peer in others
            if peer.step is not None and peer.step >= pending.start_step + self.inner_steps
        ]

    def _catch_up(self, pending: _Round) -> None:
        """After a round we stepped alone in while other peers were present: if some of them
        are already a round further, we fell behind, and every later round of ours would be
        alone too (rounds are keyed by their number). Load the state of those peers: their
        shared parameters and inner step count put us back into their rounds."""
        ahead = self._peers_ahead(self.presence.others(), pending)
        ahead_donors = [peer.peer_id for peer in ahead if peer.donor]
        if not ahead:
            return
        if self.schedule.delay > 0 or not ahead_donors:  # (no state served mid-round)
            logger.warning(
                "DiLoCo fragment %d: %d peers are a round or more ahead of this one and serve "
                "no state now; call load_state_from_peers() to rejoin their rounds",
                pending.fragment,
                len(ahead),
            )
            return
        logger.warning(
            "DiLoCo fragment %d: %d peers are a round or more ahead of this one (inner step "
            "%d): loading their state to rejoin their rounds",
            pending.fragment,
            len(ahead),
            pending.start_step,
        )
        timeout = min(self.load_state_timeout, self.averaging_timeout)
        if self.load_state_from_peers(timeout, donors=sorted(ahead_donors)):
            with self._lock:
                self._states_caught_up += 1
        else:
            logger.warning(
                "DiLoCo fragment %d: could not load the state of the peers ahead; this peer "
                "stays behind their rounds",
                pending.fragment,
            )

    def _adopt_reference_state(self, gathered: dict, pending: _Round) -> None:
        """If the round's fingerprints show that our shared parameters differ from the ones
        the group follows (another random init, a joiner that loaded nothing), load them."""
        fingerprints = {}
        for peer_id, data in gathered.items():
            if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), list):
                return  # a peer of an older version: nothing to compare
            outer_step = data.get("outer_step", 0)
            outer_step = outer_step if isinstance(outer_step, int) else 0
            fingerprints[peer_id.to_bytes()] = (data["fingerprint"], outer_step)
        reference = reference_peers(fingerprints)
        ours = self.averagers[pending.fragment].peer_id.to_bytes()
        if ours in reference or ours not in fingerprints:
            return
        if self.schedule.delay > 0:  # donors serve no state while their rounds overlap
            logger.warning(
                "DiLoCo fragment %d: this peer's shared parameters differ from those of %d of "
                "the %d peers in the round (another initialization, a partial round, or a "
                "joiner that loaded no state); with delay > 0 call load_state_from_peers() "
                "when no round is in flight to resynchronize",
                pending.fragment,
                len(reference),
                len(fingerprints),
            )
            return
        logger.warning(
            "DiLoCo fragment %d: this peer's shared parameters differ from those of %d of the "
            "%d peers in the round (another initialization, a partial round, or a joiner that "
            "loaded no state): loading theirs",
            pending.fragment,
            len(reference),
            len(fingerprints),
        )
        timeout = min(self.load_state_timeout, self.averaging_timeout)
        if not self.load_state_from_peers(timeout, donors=sorted(reference)):
            logger.warning(
                "DiLoCo fragment %d: could not load the shared parameters of peers %s; this "
                "peer keeps its own, which differ",
                pending.fragment,
                sorted(_peer_order(p)[1].hex()[:12] for p in reference),
            )

    def _check_lockstep(self, gathered: dict, pending: _Round) -> None:
        steps = {g.get("inner_step") for g in gathered.values() if isinstance(g, dict)} - {
            pending.start_step
        }
        if steps:
            logger.warning(
                "averaged at inner step %d with peers at inner steps %s: their shared "
                "parameters may differ (load_state_from_peers resynchronizes)",
                pending.start_step,
                sorted(s for s in steps if isinstance(s, int)),
            )

    def _cancel_pending_locked(self) -> None:
        pending, self._pending = self._pending, {}
        for round_ in pending.values():
            if round_.control is not None:
                round_.control.cancel()
        self._lock.notify_all()

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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
