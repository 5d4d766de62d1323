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

- **Same start.** Every peer must start from the same parameters (build the model under the
  same seed) or call :meth:`~DiLoCoOptimizer.load_state_from_peers`, which downloads the shared
  parameters, the outer optimizer's state and the step counters from a peer of the run.
- **Lockstep by counting.** Peers sync after the same inner step numbers (multiples of H): a
  joiner adopts its donor's inner step count, so it syncs with the others at the next multiple
  of H, with a weight of the samples it processed until then.
- **Elastic.** A peer that leaves is simply absent from the next round. If a round fails (too
  few peers, timeout, nobody else took part) the peer logs a warning and applies *its own*
  pseudo-gradient alone: training goes on, and that peer's shared parameters drift from the
  others' until it loads the state again (``statistics().rounds_alone`` counts such rounds).
- **Overlap.** With ``delay`` (tau) > 0 the all-reduce of a round runs in the background while
  training continues; its result is applied ``delay`` inner steps later and mixed into the
  local parameters with ``alpha`` (``p = alpha * p + (1 - alpha) * shared``).
- **Streaming** (``num_fragments > 1``, Streaming DiLoCo) is not implemented on the networked
  path yet: the constructor raises ``NotImplementedError``. The single-process reference
  (:func:`swarmtrain.optim.diloco_simulation.run_diloco`) simulates it.
- It is not a ``torch.optim.Optimizer`` subclass: give learning-rate schedulers
  ``opt.inner_optimizer``.

Resource handling: the optimizer owns its averager (stopped by :meth:`shutdown`, which cancels
a round in flight); the DHT belongs to the caller. Call :meth:`step` and the other methods
from one training thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from swarmtrain.averaging import DecentralizedAverager, StepControl
from swarmtrain.compression import CompressionBase, Float16Compression
from swarmtrain.optim._optimizer_state import decode_tensors, encode_tensors
from swarmtrain.optim.diloco_core import (
    ApplyOuter,
    OuterOptimizerFactory,
    OuterState,
    StartSync,
    StreamingSchedule,
)
from swarmtrain.optim.diloco_simulation import default_inner_optimizer

__all__ = ["DiLoCoOptimizer", "DiLoCoStatistics", "InnerOptimizer"]

logger = logging.getLogger(__name__)

InnerOptimizer = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]

#: version tag of the state that peers download from each other
STATE_FORMAT = "swarmtrain.diloco/1"


@dataclass(frozen=True)
class DiLoCoStatistics:
    """What one peer's optimizer has done so far.

    :param inner_step: inner steps counted since the start of the run (adopted from the donor
      by :meth:`DiLoCoOptimizer.load_state_from_peers`)
    :param outer_step: outer updates applied to the shared parameters (likewise)
    :param rounds_averaged: rounds in which we averaged with at least one other peer
    :param rounds_alone: rounds that failed, in which we applied our own pseudo-gradient
    :param last_group_size: peers (us included) in the last round; 1 if it failed
    :param bytes_sent: estimated pseudo-gradient payload we sent, in bytes (butterfly
      all-reduce in a group of ``n``: ``2 (n - 1) / n`` times the compressed size)
    :param seconds_waiting: wall time ``step()`` spent waiting for averaging results
    """

    inner_step: int
    outer_step: int
    rounds_averaged: int
    rounds_alone: int
    last_group_size: int
    bytes_sent: int
    seconds_waiting: float


@dataclass
class _Round:
    """A round whose sync started and whose result is not applied yet."""

    start_step: int
    weight: float
    local_pseudo_gradient: list[torch.Tensor]
    control: StepControl | None = None


class _PseudoGradientAverager(DecentralizedAverager):
    """Averages the pseudo-gradient buffers; newcomers download the optimizer's outer state."""

    def __init__(self, tensors, dht, *, state_provider: Callable[[], Any], **kwargs: Any):
        self._diloco_state = state_provider
        super().__init__(tensors, dht, **kwargs)

    def get_current_state(self) -> Any:
        return self._diloco_state()


def _positive(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")


def _flatten_params(params: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of ``params`` (tensors, or param-group dicts), in order, each once."""
    result: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if id(p) not in seen:
                seen.add(id(p))
                result.append(p)
    if not result:
        raise ValueError("DiLoCoOptimizer got an empty parameter list")
    return result


def pack_state(
    outer: OuterState, inner_step: int, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``(metadata, tensors)`` that carry ``outer`` (parameters, optimizer state, step) and the
    inner step count; the metadata holds the optimizer state's structure, with each tensor
    replaced by a reference (``_optimizer_state.encode_tensors``)."""
    state = outer.state_dict()  # already copies: no second copy here
    tensors: list[torch.Tensor] = list(state["params"])
    optimizer = encode_tensors(state["optimizer"], tensors, copy=False)
    metadata = {
        "format": STATE_FORMAT,
        "num_params": len(state["params"]),
        "outer_step": state["outer_step"],
        "inner_step": inner_step,
        "optimizer": optimizer,
        **(extra or {}),
    }
    return metadata, tensors


def unpack_state(metadata: Any, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int]:
    """The inverse of :func:`pack_state`: ``(OuterState state dict, inner step)``.

    :raises ValueError: not a state of this format, or references to missing tensors
    """
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} state: {str(metadata)[:200]}")
    num_params, inner_step = metadata.get("num_params"), metadata.get("inner_step")
    for name, value in (("num_params", num_params), ("inner_step", inner_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if num_params > len(tensors):
        raise ValueError(f"state announces {num_params} parameters, carries {len(tensors)} tensors")

    state = {
        "params": list(tensors[:num_params]),
        "optimizer": decode_tensors(metadata.get("optimizer"), tensors, first=num_params),
        "outer_step": metadata.get("outer_step"),
    }
    return state, inner_step


class DiLoCoOptimizer:
    """DiLoCo over the swarm; see the module docstring.

    :param params: the model's parameters (tensors or param-group dicts), in the same order on
      every peer; with an optimizer *instance* as ``inner_optimizer``, they must be its params
    :param dht: a running blocking :class:`~swarmtrain.dht.DHT` (the caller's: we never close it)
    :param run_id: the name of the run; peers with the same ``run_id`` average together
    :param inner_optimizer: an optimizer over ``params``, or a factory ``f(params)``; default
      AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.01)
    :param inner_steps: H, inner steps between two outer steps
    :param outer_optimizer: builds the outer optimizer from the offloaded shared parameters;
      default :data:`~swarmtrain.optim.diloco_core.default_outer_optimizer`
    :param pseudo_grad_compression: codec for the pseudo-gradients in all-reduce
      (default fp16)
    :param batch_size_per_step: samples per inner step (our weight in the average is the
      samples since the last outer step); None: each inner step counts as one sample
    :param averager_opts: more :class:`~swarmtrain.averaging.AveragerConfig` keywords for the
      averager (they override the ones derived from the arguments here)
    :param matchmaking_time: the averager's ``min_matchmaking_time``: how long a round waits
      for peers before it starts with the group it has
    :param averaging_timeout: give up a round after this many seconds of matchmaking (retries
      included), and an all-reduce after as many more
    :param min_group_size: fewest peers (us included) to average with; below that the round
      fails and we step alone
    :param target_group_size: largest group (None: everyone who shows up)
    :param num_fragments: F; only 1 (see the module docstring)
    :param delay: tau in ``[0, inner_steps)``: inner steps the all-reduce overlaps with training
    :param alpha: in ``[0, 1)``: weight the local parameters keep when a delayed result arrives
    :param load_state_timeout: default bound for :meth:`load_state_from_peers`
    :param verbose: log each round at INFO (else DEBUG)
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
        _positive_int("batch_size_per_step", batch_size_per_step, allow_none=True)
        _positive_int("min_group_size", min_group_size)
        _positive_int("target_group_size", target_group_size, allow_none=True)
        _positive_int("num_fragments", num_fragments)
        _positive("matchmaking_time", matchmaking_time)
        _positive("averaging_timeout", averaging_timeout)
        _positive("load_state_timeout", load_state_timeout)
        if num_fragments > 1:
            raise NotImplementedError(
                "streaming DiLoCo (num_fragments > 1) is not implemented on the networked "
                "DiLoCoOptimizer yet; use num_fragments=1, or simulate streaming with "
                "swarmtrain.optim.diloco_simulation.run_diloco"
            )
        # Validates inner_steps, delay and alpha with clear errors.
        self.schedule = StreamingSchedule(inner_steps, num_fragments, delay, alpha)
        if pseudo_grad_compression is None:
            pseudo_grad_compression = Float16Compression()
        if not isinstance(pseudo_grad_compression, CompressionBase):
            raise TypeError("pseudo_grad_compression must be a swarmtrain.compression codec")

        if isinstance(inner_optimizer, torch.optim.Optimizer):
            self._params = _flatten_params(inner_optimizer.param_groups)
            if params is not None and {id(p) for p in _flatten_params(params)} != {
                id(p) for p in self._params
            }:
                raise ValueError("params must be the parameters of the inner optimizer instance")
            self.inner_optimizer = inner_optimizer
        else:
            if params is None:
                raise ValueError("params is required unless inner_optimizer is an instance")
            params = list(params)
            self._params = _flatten_params(params)
            factory = inner_optimizer if inner_optimizer is not None else default_inner_optimizer
            if not callable(factory):
                raise TypeError("inner_optimizer must be an optimizer or a factory f(params)")
            self.inner_optimizer = factory(params)
            if not isinstance(self.inner_optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"inner_optimizer must build a torch.optim.Optimizer, "
                    f"got {self.inner_optimizer!r}"
                )

        self.run_id = run_id
        self.dht = dht
        self.inner_steps = inner_steps
        self.batch_size_per_step = batch_size_per_step
        self.averaging_timeout = float(averaging_timeout)
        self.load_state_timeout = float(load_state_timeout)
        self.verbose = verbose
        self._outer = OuterState(self._params, outer_optimizer)
        # Guards the outer state, the step counters and the round in flight: the training
        # thread changes them, the averager's worker thread reads them for newcomers.
        self._lock = threading.Condition()
        self._inner_step = 0
        self._samples = 0.0  # since the last sync started
        self._pending: _Round | None = None
        self._rounds_averaged = self._rounds_alone = 0
        self._last_group_size = 0
        self._bytes_sent = 0.0
        self._seconds_waiting = 0.0
        self._buffers = [torch.zeros_like(p) for p in self._outer.params]
        self._payload_bytes = sum(pseudo_grad_compression.compress(b).nbytes for b in self._buffers)

        opts: dict[str, Any] = {
            "min_matchmaking_time": float(matchmaking_time),
            "request_timeout": min(3.0, matchmaking_time / 2),
            "allreduce_timeout": float(averaging_timeout),
            "compression": pseudo_grad_compression,
            "min_group_size": min_group_size,
            "target_group_size": target_group_size,
        }
        opts.update(averager_opts or {})
        self.averager = _PseudoGradientAverager(
            self._buffers,
            dht,
            prefix=f"{run_id}_diloco",
            state_provider=self._current_state,
            start=True,
            **opts,
        )

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
        """One inner step; after every H-th (and ``delay`` steps later) the outer round.

        :param closure: re-evaluates the loss (as in torch), run before the inner step
        :param batch_size: samples in this step (default ``batch_size_per_step``, or 1)
        :returns: what ``closure`` returned, or None
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner_optimizer.step()
        if batch_size is None:
            batch_size = self.batch_size_per_step or 1
        _positive("batch_size", batch_size)
        with self._lock:
            self._inner_step += 1
            self._samples += batch_size
            actions = self.schedule.actions(self._inner_step)
            for action in actions:
                if isinstance(action, StartSync):
                    self._start_round_locked(action)
        for action in actions:
            if isinstance(action, StartSync) and self._pending is not None:
                self._launch(self._pending)
            elif isinstance(action, ApplyOuter):
                self._finish_round(action.alpha)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the outer state and the counters (a round in flight
        is not saved: it is cancelled on restart)."""
        with self._lock:
            return {
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "outer": self._outer.state_dict(),
                "inner_step": self._inner_step,
                "samples": self._samples,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model's own parameters are the caller's to restore:
        between outer steps they differ from the shared ones)."""
        inner_step = state["inner_step"]
        if isinstance(inner_step, bool) or not isinstance(inner_step, int) or inner_step < 0:
            raise ValueError(f"inner_step must be a non-negative integer, got {inner_step!r}")
        with self._lock:
            self._cancel_pending_locked()
            self._outer.load_state_dict(state["outer"])
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
            self._inner_step = inner_step
            self._samples = float(state.get("samples", 0.0))

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
        """Outer updates applied to the shared parameters."""
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
                bytes_sent=int(self._bytes_sent),
                seconds_waiting=self._seconds_waiting,
            )

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download the shared parameters, the outer optimizer's state and the step counters
        from a peer of the run and write the shared parameters into the model.

        The inner optimizer keeps its own state. Tries again until ``timeout`` (default
        ``load_state_timeout``) if nobody answers; returns whether a state was loaded.
        """
        timeout = self.load_state_timeout if timeout is None else timeout
        _positive("timeout", timeout)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning("could not load the DiLoCo state of %r from peers", self.run_id)
                return False
            loaded = self.averager.load_state_from_peers(timeout=remaining)
            if loaded is not None:
                try:
                    outer_state, inner_step = unpack_state(*loaded)
                    with self._lock:
                        self._cancel_pending_locked()
                        self._outer.load_state_dict(outer_state)
                        self._outer.copy_to(self._params)
                        self._inner_step = inner_step
                        self._samples = 0.0
                except (ValueError, TypeError, KeyError) as e:
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
        """Apply the result of a round still in flight (``delay > 0``) now, e.g. when training
        ends; a no-op with ``delay = 0``."""
        if self._pending is not None:
            self._finish_round(self.schedule.alpha)

    def shutdown(self) -> None:
        """Cancel a round in flight and stop the averager (the DHT stays up)."""
        with self._lock:
            self._cancel_pending_locked()
        self.averager.shutdown()

    def __enter__(self) -> DiLoCoOptimizer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ rounds

    def _start_round_locked(self, action: StartSync) -> None:
        if self._pending is not None:  # cannot happen with delay < inner_steps
            raise RuntimeError("a round started while the previous one is still in flight")
        pseudo_gradient = self._outer.pseudo_gradient(self._params)
        self._pending = _Round(action.step, self._samples, pseudo_gradient)
        self._samples = 0.0

    def _launch(self, pending: _Round) -> None:
        with self.averager.get_tensors() as buffers:
            for buffer, value in zip(buffers, pending.local_pseudo_gradient, strict=True):
                buffer.copy_(value)
        try:
            pending.control = self.averager.step(
                gather={"inner_step": pending.start_step, "weight": pending.weight},
                weight=pending.weight,
                timeout=self.averaging_timeout,
                wait=False,
            )
        except Exception as e:  # the averager is down: step alone
            logger.warning("could not start averaging: %r", e)

    def _finish_round(self, alpha: float) -> None:
        pending = self._pending
        if pending is None:  # we joined while the round was in flight: not ours to apply
            return
        started = time.perf_counter()
        averaged, group_size = None, 1
        if pending.control is not None:
            try:
                gathered = pending.control.result()
                group_size = len(gathered)
                if group_size >= 2:
                    with self.averager.get_tensors() as buffers:
                        averaged = [b.clone() for b in buffers]
                self._check_lockstep(gathered, pending)
            except Exception as e:  # MatchmakingError, AllReduceError, shutdown
                logger.warning(
                    "DiLoCo round at inner step %d failed, applying the local pseudo-gradient "
                    "alone: %s",
                    pending.start_step,
                    e,
                )
        self._seconds_waiting += time.perf_counter() - started
        with self._lock:
            if self._pending is not pending:  # cancelled meanwhile (load_state_from_peers)
                return
            applied = False
            if averaged is not None:
                try:
                    self._outer.apply_outer_step(averaged, model_params=self._params, alpha=alpha)
                    applied = True
                except ValueError as e:  # a NaN from a peer: nothing changed yet
                    logger.warning("averaged pseudo-gradient unusable (%s): stepping alone", e)
            if applied:
                self._rounds_averaged += 1
                self._bytes_sent += self._payload_bytes * 2 * (group_size - 1) / group_size
            else:
                group_size = 1
                self._outer.apply_outer_step(
                    pending.local_pseudo_gradient, model_params=self._params, alpha=alpha
                )
                self._rounds_alone += 1
            self._last_group_size = group_size
            self._pending = None
            self._lock.notify_all()
        log = logger.info if self.verbose else logger.debug
        log(
            "DiLoCo outer step %d (inner step %d): group of %d, waited %.2f s",
            self._outer.outer_step,
            self._inner_step,
            group_size,
            time.perf_counter() - started,
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
        pending, self._pending = self._pending, None
        if pending is not None and pending.control is not None:
            pending.control.cancel()
        self._lock.notify_all()

    def _current_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """For newcomers (runs in the averager's worker thread): the state after the round in
        flight, if any, is applied — a newcomer that took the state from before it would miss
        that outer update for good."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._pending is None, self.averaging_timeout):
                raise TimeoutError("a DiLoCo round is still in flight")
            return pack_state(self._outer, self._inner_step)
