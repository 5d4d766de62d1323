"""DiLoCo without the network: the outer state, parameter fragments and the streaming schedule.

DiLoCo (Douillard et al., 2023) trains each peer alone for ``H`` inner steps, then averages the
*pseudo-gradients* ``shared - local`` of all peers and feeds the average, as if it were a
gradient, to an outer optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9) that steps
the *shared* parameters; every peer then continues from the new shared parameters.

Streaming DiLoCo (Douillard et al., 2025) splits the parameters into ``F`` fragments and syncs
one fragment every ``H / F`` inner steps, so the bandwidth is spread over time; the averaged
result of a fragment is applied ``tau`` inner steps after its sync started (the all-reduce
overlaps with training) and mixed into the local parameters:
``local = alpha * local + (1 - alpha) * shared`` (``alpha = 0``: replace them).

This module only does the math, on tensors; the networked ``DiLoCoOptimizer`` averages the
pseudo-gradients and does the waiting:

- :class:`OuterState`: an offloaded fp32 copy (CPU) of the last shared parameters and the outer
  optimizer acting on it; ``pseudo_gradient`` and ``apply_outer_step``; a state dict for peers
  that join later;
- :class:`Fragments`: which parameters belong to which fragment (each exactly once, balanced by
  numel, deterministic so that every peer computes the same split);
- :class:`StreamingSchedule`: after which inner step each fragment's sync starts
  (:class:`StartSync`) and its result is applied (:class:`ApplyOuter`).

Inner steps are counted from 1: "step ``t``" is the moment right after the ``t``-th inner
optimizer step. Plain DiLoCo is ``StreamingSchedule(H)``: one fragment, synced and applied after
steps ``H, 2H, ...``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

__all__ = [
    "ApplyOuter",
    "Fragments",
    "OuterOptimizerFactory",
    "OuterState",
    "ScheduleAction",
    "StartSync",
    "StreamingSchedule",
    "default_outer_optimizer",
    "mix_",
]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

#: DiLoCo's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9 (Douillard et al., 2023)
default_outer_optimizer: OuterOptimizerFactory = functools.partial(
    torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True
)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return value


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a number, got {alpha!r}")
    if not (0 <= alpha < 1):
        raise ValueError(
            f"alpha must be in [0, 1) (the weight of the local parameters; 1 would ignore the "
            f"shared result), got {alpha!r}"
        )
    return float(alpha)


@torch.no_grad()
def mix_(local: torch.Tensor, shared: torch.Tensor, alpha: float = 0.0) -> torch.Tensor:
    """``local = alpha * local + (1 - alpha) * shared`` in place; ``alpha = 0`` copies exactly.

    ``shared`` may live on another device or have another dtype than ``local``.
    """
    alpha = _check_alpha(alpha)
    if local.shape != shared.shape:
        raise ValueError(
            f"shape mismatch: local {tuple(local.shape)}, shared {tuple(shared.shape)}"
        )
    if alpha == 0:
        return local.copy_(shared)
    shared = shared.to(device=local.device, dtype=local.dtype)
    return local.mul_(alpha).add_(shared, alpha=1 - alpha)


class OuterState:
    """The last shared parameters (fp32, on the CPU) and the outer optimizer that steps them.

    :param params: the model's parameters, in a fixed order (every peer must use the same one);
      their current values become the initial shared parameters
    :param outer_optimizer: builds the outer optimizer from the offloaded tensors; by default
      :data:`default_outer_optimizer` (SGD, lr 0.7, Nesterov momentum 0.9)

    Methods that take ``indices`` act on those parameters only (a fragment; by default all).
    The outer optimizer sees gradients only on them, so a fragment's step leaves the others'
    values and momentum untouched (true of torch's optimizers, which skip ``grad is None``).
    Not thread-safe: one caller at a time.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        outer_optimizer: OuterOptimizerFactory | None = None,
    ):
        params = list(params)
        if not params:
            raise ValueError("OuterState needs at least one parameter")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not p.dtype.is_floating_point:
                raise TypeError(f"parameter {i} must be a floating-point tensor, got {p!r:.80}")
        self.params: list[torch.Tensor] = [
            p.detach().to("cpu", torch.float32, copy=True) for p in params
        ]
        factory = outer_optimizer if outer_optimizer is not None else default_outer_optimizer
        self.optimizer = factory(self.params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"outer_optimizer must return a torch.optim.Optimizer, got {self.optimizer!r}"
            )
        #: outer updates applied so far (each fragment's update counts once)
        self.outer_step = 0

    def __len__(self) -> int:
        return len(self.params)

    def _indices(self, indices: Sequence[int] | None) -> list[int]:
        if indices is None:
            return list(range(len(self.params)))
        result = list(indices)
        if len(set(result)) != len(result):
            raise ValueError(f"duplicate parameter indices in {result}")
        for i in result:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.params):
                raise IndexError(f"parameter index {i!r} out of range [0, {len(self.params)})")
        return result

    def _check_matching(self, name: str, tensors: Sequence[torch.Tensor], indices: list[int]):
        if len(tensors) != len(indices):
            raise ValueError(f"expected {len(indices)} {name}, got {len(tensors)}")
        for i, tensor in zip(indices, tensors, strict=True):
            if tuple(tensor.shape) != tuple(self.params[i].shape):
                raise ValueError(
                    f"{name} for parameter {i}: expected shape {tuple(self.params[i].shape)}, "
                    f"got {tuple(tensor.shape)}"
                )

    @torch.no_grad()
    def pseudo_gradient(
        self, model_params: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """``shared - current`` for each selected parameter: new fp32 CPU tensors.

        :param model_params: the current values of the selected parameters, in ``indices``
          order (any device and floating dtype)
        """
        idx = self._indices(indices)
        model_params = list(model_params)
        self._check_matching("model parameters", model_params, idx)
        return [
            self.params[i] - p.detach().to("cpu", torch.float32)
            for i, p in zip(idx, model_params, strict=True)
        ]

    @torch.no_grad()
    def apply_outer_step(
        self,
        averaged_pseudo_gradient: Sequence[torch.Tensor],
        indices: Sequence[int] | None = None,
        *,
        model_params: Sequence[torch.Tensor] | None = None,
        alpha: float = 0.0,
    ) -> list[torch.Tensor]:
        """Step the outer optimizer with the averaged pseudo-gradient as the gradient.

        The shared parameters change only if every tensor has the right shape and is finite.

        :param averaged_pseudo_gradient: one tensor per selected parameter (not modified)
        :param model_params: if given, the selected parameters of the model, which then get the
          new shared values mixed in: ``p = alpha * p + (1 - alpha) * shared``
        :returns: the new shared values of the selected parameters, as the offloaded tensors
          themselves (read them, don't modify them)
        :raises ValueError: wrong count or shape, or a NaN / infinite value
        """
        idx = self._indices(indices)
        grads = list(averaged_pseudo_gradient)
        self._check_matching("pseudo-gradients", grads, idx)
        if model_params is not None:
            model_params = list(model_params)
            self._check_matching("model parameters", model_params, idx)
        alpha = _check_alpha(alpha)
        grads = [g.detach().to("cpu", torch.float32, copy=True) for g in grads]
        for i, g in zip(idx, grads, strict=True):
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"pseudo-gradient for parameter {i} is not finite")
        for p in self.params:
            p.grad = None
        for i, g in zip(idx, grads, strict=True):
            self.params[i].grad = g
        try:
            self.optimizer.step()
        finally:
            for i in idx:
                self.params[i].grad = None
        self.outer_step += 1
        if model_params is not None:
            self.copy_to(model_params, idx, alpha=alpha)
        return [self.params[i] for i in idx]

    @torch.no_grad()
    def copy_to(
        self,
        model_params: Sequence[torch.Tensor],
        indices: Sequence[int] | None = None,
        *,
        alpha: float = 0.0,
    ) -> None:
        """Write the shared values into the model: ``p = alpha * p + (1 - alpha) * shared``."""
        idx = self._indices(indices)
        model_params = list(model_params)
        self._check_matching("model parameters", model_params, idx)
        for i, p in zip(idx, model_params, strict=True):
            mix_(p, self.params[i], alpha)

    def state_dict(self) -> dict[str, Any]:
        """Copies of the shared parameters, the outer optimizer's state and ``outer_step``.

        A peer that joins builds its own ``OuterState`` from the same model and calls
        :meth:`load_state_dict`, then :meth:`copy_to` its model.
        """
        return {
            "params": [p.detach().clone() for p in self.params],
            "optimizer": _clone_tensors(self.optimizer.state_dict()),
            "outer_step": self.outer_step,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt another peer's state; checked before anything changes.

        :raises ValueError: missing keys, or parameters that do not match ours in count or shape
        """
        missing = {"params", "optimizer", "outer_step"} - set(state)
        if missing:
            raise ValueError(f"outer state is missing {sorted(missing)}")
        params = list(state["params"])
        if len(params) != len(self.params):
            raise ValueError(f"expected {len(self.params)} parameters, got {len(params)}")
        for i, (mine, theirs) in enumerate(zip(self.params, params, strict=True)):
            if not isinstance(theirs, torch.Tensor) or tuple(theirs.shape) != tuple(mine.shape):
                raise ValueError(
                    f"parameter {i}: expected shape {tuple(mine.shape)}, "
                    f"got {getattr(theirs, 'shape', type(theirs).__name__)}"
                )
        outer_step = state["outer_step"]
        if isinstance(outer_step, bool) or not isinstance(outer_step, int) or outer_step < 0:
            raise ValueError(f"outer_step must be a non-negative integer, got {outer_step!r}")
        self.optimizer.load_state_dict(_clone_tensors(state["optimizer"]))
        for mine, theirs in zip(self.params, params, strict=True):
            mine.copy_(theirs)
        self.outer_step = outer_step


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tensors(v) for v in obj)
    return obj


@dataclass(frozen=True)
class Fragments:
    """A split of parameters ``0..n-1`` into fragments, each parameter in exactly one.

    Build it with :meth:`split` (from numels) or :meth:`for_parameters`; every peer that
    splits the same model the same way gets the same fragments.

    :param groups: the parameter indices of each fragment, ascending
    :param numels: the number of values of each parameter
    """

    groups: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]

    def __post_init__(self) -> None:
        seen = sorted(i for group in self.groups for i in group)
        if seen != list(range(len(self.numels))):
            raise ValueError("fragments must cover every parameter exactly once")
        if any(not group for group in self.groups):
            raise ValueError("every fragment needs at least one parameter")
        if any(tuple(sorted(group)) != group for group in self.groups):
            raise ValueError("parameter indices within a fragment must be ascending")

    @classmethod
    def split(
        cls,
        numels: Sequence[int],
        num_fragments: int,
        *,
        strategy: Literal["contiguous", "greedy"] = "contiguous",
    ) -> Fragments:
        """Split parameters with these numels into ``num_fragments`` balanced fragments.

        :param strategy: ``"contiguous"``: runs of consecutive parameters (whole layers stay
          together, as in Streaming DiLoCo), minimizing the largest fragment's numel;
          ``"greedy"``: largest parameter first into the lightest fragment (often better
          balanced; the largest fragment holds at most ``total / F + max numel``)
        """
        numels = tuple(_check_int("numel", n, 0) for n in numels)
        _check_int("num_fragments", num_fragments, 1)
        if num_fragments > len(numels):
            raise ValueError(
                f"cannot split {len(numels)} parameters into {num_fragments} fragments: "
                "each fragment needs at least one parameter"
            )
        if strategy == "contiguous":
            groups = _split_contiguous(numels, num_fragments)
        elif strategy == "greedy":
            groups = _split_greedy(numels, num_fragments)
        else:
            raise ValueError(f"strategy must be 'contiguous' or 'greedy', got {strategy!r}")
        return cls(tuple(tuple(g) for g in groups), numels)

    @classmethod
    def for_parameters(
        cls,
        params: Iterable[torch.Tensor],
        num_fragments: int,
        *,
        strategy: Literal["contiguous", "greedy"] = "contiguous",
    ) -> Fragments:
        return cls.split([p.numel() for p in params], num_fragments, strategy=strategy)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, fragment: int) -> tuple[int, ...]:
        return self.groups[fragment]

    def fragment_numel(self, fragment: int) -> int:
        return sum(self.numels[i] for i in self.groups[fragment])

    def fragment_of(self, param_index: int) -> int:
        for fragment, group in enumerate(self.groups):
            if param_index in group:
                return fragment
        raise IndexError(f"parameter index {param_index} out of range [0, {len(self.numels)})")

    def select(self, items: Sequence[Any], fragment: int) -> list[Any]:
        """The entries of ``items`` (one per parameter) that belong to ``fragment``."""
        if len(items) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} items, got {len(items)}")
        return [items[i] for i in self.groups[fragment]]


def _split_contiguous(numels: tuple[int, ...], k: int) -> list[list[int]]:
    def pack(cap: int) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        load = 0
        for i, n in enumerate(numels):
            if groups[-1] and load + n > cap:
                groups.append([])
                load = 0
            groups[-1].append(i)
            load += n
        return groups

    lo, hi = max(numels), sum(numels)
    while lo < hi:  # the smallest cap that packs into at most k runs
        mid = (lo + hi) // 2
        if len(pack(mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    groups = pack(lo)
    while len(groups) < k:  # split the heaviest splittable run where its halves balance best
        candidates = [g for g in groups if len(g) > 1]
        heaviest = max(candidates, key=lambda g: sum(numels[i] for i in g))
        best_cut, best_max = 1, math.inf
        for cut in range(1, len(heaviest)):
            left = sum(numels[i] for i in heaviest[:cut])
            right = sum(numels[i] for i in heaviest[cut:])
            if max(left, right) < best_max:
                best_cut, best_max = cut, max(left, right)
        at = groups.index(heaviest)
        groups[at : at + 1] = [heaviest[:best_cut], heaviest[best_cut:]]
    return groups


def _split_greedy(numels: tuple[int, ...], k: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        # ties: fewer parameters first, so that no fragment stays empty
        target = min(range(k), key=lambda f: (loads[f], len(groups[f]), f))
        groups[target].append(i)
        loads[target] += numels[i]
    return [sorted(g) for g in groups]


@dataclass(frozen=True)
class StartSync:
    """After inner step ``step``: compute fragment ``fragment``'s pseudo-gradient and start
    averaging it (round ``round`` of this fragment, counted from 0)."""

    fragment: int
    round: int
    step: int


@dataclass(frozen=True)
class ApplyOuter:
    """After inner step ``step``: apply the averaged result of the sync that started ``delay``
    steps earlier, mixing it into the local parameters with ``alpha``."""

    fragment: int
    round: int
    step: int
    alpha: float


ScheduleAction = Union[StartSync, ApplyOuter]


@dataclass(frozen=True)
class StreamingSchedule:
    """When each fragment syncs and when its result is applied (Streaming DiLoCo).

    Fragment ``p`` syncs every ``inner_steps`` steps, after steps
    ``(p + 1) * inner_steps / num_fragments + k * inner_steps`` (``k = 0, 1, ...``): fragment 0
    first, the last fragment after multiples of ``inner_steps``, one fragment every
    ``inner_steps / num_fragments`` steps. Its result is applied ``delay`` steps later
    (``delay = 0``: at once, blocking), before its next sync.

    :param inner_steps: H, the inner steps between two syncs of the same fragment
    :param num_fragments: F, which must divide H
    :param delay: tau, in ``[0, H)``: inner steps the averaging may overlap with training
    :param alpha: in ``[0, 1)``: local parameters keep this weight when the result is applied
    """

    inner_steps: int
    num_fragments: int = 1
    delay: int = 0
    alpha: float = 0.0

    def __post_init__(self) -> None:
        _check_int("inner_steps", self.inner_steps, 1)
        _check_int("num_fragments", self.num_fragments, 1)
        _check_int("delay", self.delay, 0)
        if self.inner_steps % self.num_fragments:
            raise ValueError(
                f"num_fragments ({self.num_fragments}) must divide inner_steps "
                f"({self.inner_steps}) so that fragments sync every inner_steps / num_fragments"
            )
        if self.delay >= self.inner_steps:
            raise ValueError(
                f"delay ({self.delay}) must be less than inner_steps ({self.inner_steps}): "
                "a fragment's result must be applied before its next sync starts"
            )
        object.__setattr__(self, "alpha", _check_alpha(self.alpha))

    @property
    def stride(self) -> int:
        """Inner steps between the syncs of consecutive fragments."""
        return self.inner_steps // self.num_fragments

    def _check_fragment(self, fragment: int) -> None:
        _check_int("fragment", fragment, 0)
        if fragment >= self.num_fragments:
            raise IndexError(f"fragment {fragment} out of range [0, {self.num_fragments})")

    def start_step(self, fragment: int, round: int) -> int:
        """The step after which round ``round`` of ``fragment`` starts."""
        self._check_fragment(fragment)
        _check_int("round", round, 0)
        return (fragment + 1) * self.stride + round * self.inner_steps

    def apply_step(self, fragment: int, round: int) -> int:
        """The step after which round ``round`` of ``fragment`` is applied."""
        return self.start_step(fragment, round) + self.delay

    def _started_at(self, step: int) -> tuple[int, int] | None:
        """(fragment, round) whose sync starts after ``step``, if any."""
        if step < 1 or step % self.stride:
            return None
        slot = step // self.stride - 1  # 0, 1, 2, ... for steps stride, 2 * stride, ...
        return slot % self.num_fragments, slot // self.num_fragments

    def actions(self, step: int) -> tuple[ScheduleAction, ...]:
        """What to do after inner step ``step`` (from 1), starts before applies.

        At most one fragment starts and one is applied per step; with ``delay = 0`` the same
        fragment starts and is applied at the same step.
        """
        _check_int("step", step, 0)
        result: list[ScheduleAction] = []
        started = self._started_at(step)
        if started is not None:
            result.append(StartSync(started[0], started[1], step))
        applied = self._started_at(step - self.delay)
        if applied is not None:
            result.append(ApplyOuter(applied[0], applied[1], step, self.alpha))
        return tuple(result)

    def in_flight(self, step: int) -> tuple[StartSync, ...]:
        """Syncs that started at or before ``step`` and are applied after it.

        A peer that joins after ``step`` does not take part in these rounds: it takes the
        shared parameters it downloads and waits for each fragment's next round.
        """
        _check_int("step", step, 0)
        result = []
        for started_step in range(max(1, step - self.delay + 1), step + 1):
            started = self._started_at(started_step)
            if started is not None and started_step + self.delay > step:
                result.append(StartSync(started[0], started[1], started_step))
        return tuple(result)

    def rounds_completed(self, fragment: int, step: int) -> int:
        """How many rounds of ``fragment`` have been applied by the end of ``step``."""
        self._check_fragment(fragment)
        _check_int("step", step, 0)
        first = self.apply_step(fragment, 0)
        return 0 if step < first else (step - first) // self.inner_steps + 1
