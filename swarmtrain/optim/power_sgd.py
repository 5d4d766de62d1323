"""``PowerSGDGradientAverager``: gradient averaging with PowerSGD low-rank compression.

PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727) sends two thin matrices per
gradient instead of the gradient. A gradient with 2+ dimensions is viewed as an ``m x n``
matrix ``M`` (the split of its dimensions that makes ``m`` and ``n`` closest); with a shared
``n x r`` matrix ``Q`` one averaging step is::

    M_i = residual_i + local mean gradient_i      (error feedback)
    P   = mean_i(M_i Q)                            all-reduce round 1 ("P"), weighted by samples
    P   = orthogonalize(P)                         same result on every peer
    Q   = mean_i(M_i^T P)                          all-reduce round 2 ("Q")
    G   = P Q^T  ~  mean_i(M_i)                    the averaged gradient every peer applies
    residual_i = M_i - G                           kept locally, added to the next step

So the ``r (m + n)`` values of ``P`` and ``Q`` travel instead of ``m n``. If the group's mean
gradient has rank at most ``r``, ``G`` is exact. Otherwise what is lost comes back through the
residuals: the running sum of the applied ``G`` differs from the running sum of the true means
only by the current (weighted) mean residual. ``Q`` is kept between steps (a warm start: one
power iteration per step) and starts as the same seeded random matrix on every peer.

Tensors with fewer than 2 dimensions, and those where PowerSGD would save less than
``min_compression_ratio`` of the values, are averaged as they are, in round 1.

Everything else — accumulation, weights (samples), ``use_averaged_gradients``, failure
handling (a failed step leaves the local mean gradient and keeps the residuals) — is
``GradientAverager``'s. A peer that contributed no samples (weight 0) receives the group's
average but keeps its residual. Peers average together only with the same rank and the same
choice of compressed tensors (both are part of the schema hash).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import torch
import trio

from swarmtrain.averaging import AllReduceRunner
from swarmtrain.averaging.async_averager import (
    AsyncDecentralizedAverager,
    GatheredData,
    _add_deltas,
    _load_gathered,
)
from swarmtrain.averaging.averager_config import compute_schema_hash
from swarmtrain.averaging.errors import AllReduceError, NonFiniteError
from swarmtrain.averaging.finite import first_non_finite
from swarmtrain.averaging.matchmaking_types import MatchmakingGroup
from swarmtrain.compression import CompressionInfo, TensorRole
from swarmtrain.optim._tensor_infos import TaggedCompression, tag_compression
from swarmtrain.optim.grad_averager import GradientAverager
from swarmtrain.p2p import PeerID

__all__ = ["PowerSGDGradientAverager", "PowerSGDPlan", "matrix_shape", "orthogonalize_"]

logger = logging.getLogger(__name__)

_SEED = 0x5057  # the initial Q of every peer (same on all peers)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The ``(m, n)`` view of a tensor of ``shape``: split its dimensions where ``m`` and ``n``
    are closest (best for low-rank compression); None for fewer than 2 dimensions."""
    if len(shape) < 2:
        return None
    total = math.prod(shape)
    best: tuple[int, int] | None = None
    for k in range(1, len(shape)):
        m = math.prod(shape[:k])
        candidate = (m, total // m if m else 0)
        if best is None or abs(candidate[0] - candidate[1]) < abs(best[0] - best[1]):
            best = candidate
    return best


def orthogonalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Make the columns of a 2-D ``matrix`` (``m x r``, ``m >= r``) orthonormal, in place,
    spanning the same space as its columns where they are independent (QR decomposition: no
    NaN for zero or dependent columns). Returns ``matrix``."""
    if matrix.ndim != 2 or matrix.shape[0] < matrix.shape[1]:
        raise ValueError(f"orthogonalize_ needs an m x r matrix with m >= r, got {matrix.shape}")
    q, _ = torch.linalg.qr(matrix.float(), mode="reduced")
    matrix.copy_(q)
    return matrix


def _check_rank(rank: Any) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"averager_rank must be a positive int, got {rank!r}")
    if rank < 1:
        raise ValueError(f"averager_rank must be at least 1, got {rank}")
    return rank


def _check_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"min_compression_ratio must be a number, got {ratio!r}")
    if not 0 <= ratio < 1:
        raise ValueError(
            f"min_compression_ratio must be in [0, 1) (the fraction of values PowerSGD must "
            f"save for a tensor to be compressed), got {ratio}"
        )
    return float(ratio)


class PowerSGDPlan:
    """Which tensors are compressed, and their PowerSGD state (residuals and ``Q``); pure math,
    no I/O. A tensor of shape ``s`` viewed as ``m x n`` is compressed when ``1 - r (m + n) /
    (m n) >= min_compression_ratio`` and ``r < min(m, n)``.

    :param shapes: the gradients' shapes, in order
    """

    def __init__(self, shapes: Sequence[Sequence[int]], rank: int, min_compression_ratio: float):
        self.rank = _check_rank(rank)
        self.min_compression_ratio = _check_ratio(min_compression_ratio)
        self.shapes = tuple(tuple(s) for s in shapes)
        compressed, matrices = [], []
        for i, shape in enumerate(self.shapes):
            mn = matrix_shape(shape)
            if mn is None or min(mn) <= rank:
                continue
            m, n = mn
            if 1 - rank * (m + n) / (m * n) >= self.min_compression_ratio:
                compressed.append(i)
                matrices.append(mn)
        self.compressed = tuple(compressed)
        self.uncompressed = tuple(i for i in range(len(self.shapes)) if i not in compressed)
        self.matrix_shapes = tuple(matrices)
        self.residuals = [torch.zeros(m, n) for m, n in matrices]
        self.qs = [self.initial_q(j) for j in range(len(matrices))]

    def initial_q(self, j: int) -> torch.Tensor:
        """The starting ``Q`` of the ``j``-th compressed tensor (the same on every peer)."""
        generator = torch.Generator().manual_seed(_SEED + j)
        return torch.randn(self.matrix_shapes[j][1], self.rank, generator=generator)

    def p_templates(self) -> list[torch.Tensor]:
        return [torch.zeros(m, self.rank) for m, _ in self.matrix_shapes]

    def schema_tensors(self) -> list[torch.Tensor]:
        """Tensors whose shapes describe what peers exchange (for the schema hash)."""
        qs = [torch.zeros(n, self.rank) for _, n in self.matrix_shapes]
        return [*self.p_templates(), *qs]

    @property
    def values_sent(self) -> tuple[int, int]:
        """``(values sent per step, values of the gradients)``."""
        full = sum(math.prod(s) for s in self.shapes)
        sent = sum(math.prod(self.shapes[i]) for i in self.uncompressed)
        sent += sum(self.rank * (m + n) for m, n in self.matrix_shapes)
        return sent, full

    # ---------------------------------------------------------------- one step

    def begin(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(M, P)`` per compressed tensor: ``M = residual + grad`` (as a matrix), ``P = M Q``."""
        ms, ps = [], []
        for j, i in enumerate(self.compressed):
            q = self.qs[j]
            if not (torch.isfinite(q).all() and q.abs().sum() > 0):
                q = self.qs[j] = self.initial_q(j)  # degenerate (e.g. after a zero gradient)
            m = self.residuals[j] + grads[i].detach().float().reshape(self.matrix_shapes[j])
            ms.append(m)
            ps.append(m @ q)
        return ms, ps

    @staticmethod
    def q_matrices(ms: Sequence[torch.Tensor], ps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Orthogonalize each averaged ``P`` in place; return ``M^T P``."""
        qs = []
        for m, p in zip(ms, ps, strict=True):
            orthogonalize_(p)
            qs.append(m.t() @ p)
        return qs

    def finish(
        self,
        ms: Sequence[torch.Tensor],
        ps: Sequence[torch.Tensor],
        qs: Sequence[torch.Tensor],
        *,
        keep_residuals: bool,
    ) -> list[torch.Tensor]:
        """Commit a step: store the averaged ``Q``; set ``residual = M - P Q^T`` unless
        ``keep_residuals`` (we contributed nothing). Returns the approximations ``P Q^T``,
        shaped like the gradients."""
        approximations = []
        for j, (m, p, q) in enumerate(zip(ms, ps, qs, strict=True)):
            approximation = p @ q.t()
            if not keep_residuals:
                self.residuals[j] = m - approximation
            self.qs[j] = q.clone()
            approximations.append(approximation.reshape(self.shapes[self.compressed[j]]))
        return approximations


class _AsyncPowerSGDAverager(AsyncDecentralizedAverager):
    """The trio averager, with a PowerSGD step (two all-reduce rounds) instead of one round."""

    def __init__(self, *args: Any, plan: PowerSGDPlan, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.schema_hash = _schema_hash(self._averaged_tensors, plan, self.config.part_size_bytes)

    @classmethod
    def create_with_plan(cls, averaged_tensors, dht, *, plan: PowerSGDPlan, **kwargs: Any):
        """``create`` for this class (``create`` builds ``cls(...)``: bind the plan to it)."""
        factory = functools.partial(cls, plan=plan)
        create = AsyncDecentralizedAverager.create.__func__  # type: ignore[attr-defined]
        return create(factory, averaged_tensors, dht, **kwargs)

    async def _round(
        self,
        group: MatchmakingGroup,
        suffix: bytes,
        tensors: Sequence[torch.Tensor],
        infos: Sequence[CompressionInfo],
        weight: float,
        failed_members: set[PeerID] | None = None,
    ) -> tuple[torch.Tensor, ...] | None:
        """One all-reduce round over ``tensors``; their deltas (None for an AUX peer). The
        members whose part or delta we did without are added to ``failed_members``."""
        assert self._allreduce is not None
        round_group = self._allreduce_group(group, sum(t.numel() for t in tensors), suffix)
        config = self.config.allreduce_config()
        codec = config.compression
        if isinstance(codec, TaggedCompression):
            codec = codec.inner
        config = dataclasses.replace(config, compression=tag_compression(codec, infos))
        runner = AllReduceRunner(
            self._allreduce, round_group, tensors, weight=weight, config=config
        )
        result = await runner.run()
        failed = {*result.banned_senders, *result.failed_reducers}
        if failed_members is not None:
            failed_members.update(failed)
        others = {p for p in round_group.peer_ids if p != self.peer_id}
        if others and others <= failed:
            raise AllReduceError(
                f"PowerSGD round {suffix.decode()}: no other member of the group of "
                f"{group.size} took part in all-reduce"
            )
        if not result.complete:
            logger.warning(
                "PowerSGD round %s in a group of %d was partial: banned senders %s, failed "
                "reducers %s%s",
                suffix.decode(),
                group.size,
                {str(k): v.value for k, v in result.banned_senders.items()},
                {str(k): v.value for k, v in result.failed_reducers.items()},
                ", timed out" if result.timed_out else "",
            )
        return result.deltas

    async def _run_allreduce(self, group: MatchmakingGroup, weight: float) -> GatheredData:
        plan = self.plan
        async with self._locked_tensors() as tensors:
            snapshot = await trio.to_thread.run_sync(
                lambda: [t.detach().cpu().clone() for t in tensors]
            )
        bad = first_non_finite(snapshot)
        if bad is not None:  # take part in both rounds with zeros and no weight, keep ours
            message = (
                f"gradient {bad} of the {len(snapshot)} holds NaN or inf values: this peer "
                f"skips PowerSGD round {group.group_id.hex()} (it sends zeros with weight 0, "
                f"so the others' averages stay finite, and keeps its own values)"
            )
            logger.warning("%s", message)
            snapshot, weight = [torch.zeros_like(t) for t in snapshot], 0.0
        ms, ps = await trio.to_thread.run_sync(plan.begin, snapshot)
        plain = [snapshot[i] for i in plan.uncompressed]
        infos = [
            CompressionInfo.from_tensor(t, key=f"powersgd_p{j}", role=TensorRole.GRADIENT)
            for j, t in enumerate(ps)
        ] + [
            CompressionInfo.from_tensor(snapshot[i], key=i, role=TensorRole.GRADIENT)
            for i in plan.uncompressed
        ]
        failed: set[PeerID] = set()  # members we did without in either phase
        deltas = await self._round(group, b".P", [*ps, *plain], infos, weight, failed)
        if deltas is None:  # an AUX peer: it reduces round Q as well, with zeros
            qs = [torch.zeros(n, plan.rank) for _, n in plan.matrix_shapes]
            if qs:
                await self._round(group, b".Q", qs, _q_infos(qs), weight, failed)
            return _gathered(group, failed)
        averaged = [t.float() + d.float() for t, d in zip([*ps, *plain], deltas, strict=True)]
        ps, plain = averaged[: len(ps)], averaged[len(ps) :]
        if ps:
            qs = await trio.to_thread.run_sync(plan.q_matrices, ms, ps)
            q_deltas = await self._round(group, b".Q", qs, _q_infos(qs), weight, failed)
            assert q_deltas is not None
            qs = [q + d.float() for q, d in zip(qs, q_deltas, strict=True)]
        else:
            qs = []
        if bad is not None:
            raise NonFiniteError(message)

        def commit(tensors: Sequence[torch.Tensor]) -> None:
            approximations = plan.finish(ms, ps, qs, keep_residuals=weight <= 0)
            new: list[torch.Tensor | None] = [None] * len(snapshot)
            for i, value in zip(plan.compressed, approximations, strict=True):
                new[i] = value
            for i, value in zip(plan.uncompressed, plain, strict=True):
                new[i] = value
            filled = [v for v in new if v is not None]
            assert len(filled) == len(snapshot)  # the plan covers every tensor once
            step_deltas = [v - s.float() for v, s in zip(filled, snapshot, strict=True)]
            _add_deltas(tensors, step_deltas)

        async with self._locked_tensors() as tensors:
            await trio.to_thread.run_sync(commit, tensors)
        return _gathered(group, failed)


def _q_infos(qs: Sequence[torch.Tensor]) -> list[CompressionInfo]:
    return [
        CompressionInfo.from_tensor(q, key=f"powersgd_q{j}", role=TensorRole.GRADIENT)
        for j, q in enumerate(qs)
    ]


def _gathered(group: MatchmakingGroup, failed: set[PeerID]) -> GatheredData:
    members = {PeerID(m.peer_id): _load_gathered(m.gather) for m in group.members}
    return GatheredData(members, failed=failed)


def _schema_hash(tensors: Sequence[torch.Tensor], plan: PowerSGDPlan, part_size: int) -> bytes:
    return compute_schema_hash([*tensors, *plan.schema_tensors()], part_size)


class PowerSGDGradientAverager(GradientAverager):
    """A :class:`GradientAverager` that averages with PowerSGD (see the module docstring).

    :param parameters: the model's parameters
    :param averager_rank: the rank ``r`` of the compressed gradients (small: 1-8 saves the
      most; about ``sqrt(min(m, n))`` loses little)
    :param min_compression_ratio: compress a tensor only if PowerSGD sends at most
      ``1 - min_compression_ratio`` of its values (hivemind's default 0.5)
    :param kwargs: ``GradientAverager``'s keywords (``dht``, ``prefix``, ``reuse_grad_buffers``,
      ``accumulate_grads_on``, ``client_mode``, ``warn``, averager keywords)

    It can be given to ``Optimizer(grad_averager_factory=...)`` with
    ``functools.partial(PowerSGDGradientAverager, averager_rank=4)``.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        averager_rank: int = 4,
        *,
        min_compression_ratio: float = 0.5,
        **kwargs: Any,
    ):
        if kwargs.get("grad_extra_tensors"):
            raise ValueError("PowerSGDGradientAverager chooses its own averaged tensors")
        kwargs.pop("grad_extra_tensors", None)
        parameters = tuple(parameters)
        shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else () for p in parameters]
        self._plan = PowerSGDPlan(shapes, averager_rank, min_compression_ratio)
        sent, full = self._plan.values_sent
        logger.debug(
            "PowerSGD rank %d compresses %d of %d tensors: %d of %d values sent per step",
            self._plan.rank,
            len(self._plan.compressed),
            len(parameters),
            sent,
            full,
        )
        super().__init__(parameters, **kwargs)

    _async_class = _AsyncPowerSGDAverager  # what runs on the background loop

    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def plan(self) -> PowerSGDPlan:
        """Which tensors are compressed; residuals and ``Q`` (change only under ``get_tensors``)."""
        return self._plan

    @property
    def schema_hash(self) -> bytes:
        return _schema_hash(self._averaged_tensors, self._plan, self.config.part_size_bytes)

    def open_async(
        self, async_dht: Any, state_provider: Callable[[], Any] | None = None
    ) -> AbstractAsyncContextManager[AsyncDecentralizedAverager]:
        """The trio PowerSGD averager over this object's tensors and plan (what
        ``run_in_background`` runs on the background loop; see ``DecentralizedAverager``)."""
        fields = {k: v for k, v in vars(self.config).items() if k not in ("prefix", "client_mode")}
        return self._async_class.create_with_plan(
            self._averaged_tensors,
            async_dht,
            plan=self._plan,
            prefix=self.prefix,
            client_mode=self.client_mode,
            tensor_lock=self.lock_averaged_tensors,
            state_provider=state_provider or self.get_current_state,
            **fields,
        )

    def get_current_state(self) -> Any:
        """What newcomers download: the current ``Q`` matrices (so their first step uses the
        group's warm start)."""
        bits = self._service.get_group_bits() if self._service is not None else ""
        with self.get_tensors():
            qs = [q.clone() for q in self._plan.qs]
        metadata = {"group_bits": bits, "powersgd_rank": self._plan.rank}
        infos = [
            CompressionInfo.from_tensor(q, key=f"powersgd_q{j}", role=TensorRole.GRADIENT)
            for j, q in enumerate(qs)
        ]
        return metadata, qs, infos

    def load_state_from_peers(  # type: ignore[override]
        self, wait: bool = True, timeout: float | None = None, donors=None, check=None
    ) -> Any:
        """Download the group's ``Q`` matrices (see :meth:`get_current_state`); returns what
        ``DecentralizedAverager.load_state_from_peers`` returns."""
        if not wait:
            raise ValueError("PowerSGDGradientAverager.load_state_from_peers needs wait=True")
        loaded = super().load_state_from_peers(
            wait=True, timeout=timeout, donors=donors, check=check
        )
        if loaded is None:
            return None
        _, tensors = loaded
        expected = [q.shape for q in self._plan.qs]
        if [t.shape for t in tensors] != expected:
            logger.warning("a peer sent PowerSGD state of other shapes: ignored")
            return loaded
        with self.get_tensors():
            self._plan.qs = [t.float().clone() for t in tensors]
        return loaded
