"""Byzantine-robust aggregation of one part over all senders: CenteredClip.

CenteredClip (Karimireddy et al. 2021; used by Gorbunov et al., "Secure Distributed Training
at Scale", 2022) starts from a robust point ``v`` (here the weighted coordinate-wise median)
and iterates ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i``, where ``clip`` scales a
vector down to norm ``tau``. A contribution far from the others moves ``v`` by at most
``tau * w_i / sum w`` per iteration, whatever its values; contributions within ``tau`` of
``v`` count as in a plain weighted mean.
"""

from __future__ import annotations

import math

import torch

__all__ = ["AGGREGATIONS", "centered_clip", "check_aggregation", "weighted_median"]

AGGREGATIONS = ("mean", "centered_clip")


def check_aggregation(aggregation: str, clip_tau: float | None, clip_iterations: int) -> None:
    """Validate the aggregation options (raises ValueError / TypeError with their names)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if clip_tau is not None:
        if isinstance(clip_tau, bool) or not isinstance(clip_tau, (int, float)):
            raise TypeError(f"clip_tau must be a number or None, got {clip_tau!r}")
        if not math.isfinite(clip_tau) or clip_tau <= 0:
            raise ValueError(f"clip_tau must be positive and finite, got {clip_tau}")
    if isinstance(clip_iterations, bool) or not isinstance(clip_iterations, int):
        raise TypeError(f"clip_iterations must be an int, got {clip_iterations!r}")
    if clip_iterations < 1:
        raise ValueError(f"clip_iterations must be at least 1, got {clip_iterations}")


def weighted_median(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise weighted median of the rows of ``values`` (n x d), weights (n,) >= 0
    with a positive sum: per coordinate, the smallest value whose cumulative weight reaches
    half of the total."""
    order = torch.sort(values, dim=0)
    cumulative = torch.cumsum(weights[order.indices], dim=0)
    half = cumulative[-1:] / 2
    first = torch.searchsorted(cumulative.T.contiguous(), half.T.contiguous()).T
    first = first.clamp_(max=values.shape[0] - 1)
    return torch.gather(order.values, 0, first).reshape(-1)


def centered_clip(
    values: torch.Tensor, weights: torch.Tensor, tau: float | None = None, iterations: int = 5
) -> torch.Tensor:
    """CenteredClip of the rows of ``values`` (n x d) with ``weights`` (n,), see the module.

    :param tau: clipping radius (an L2 norm over the whole part); None: the weighted median of
      the rows' distances to the starting point (scale-free: honest rows keep their spread,
      a far-off row counts as if it were at a typical distance)
    :param iterations: number of clipping steps from the weighted median
    :returns: the aggregate (d,), in ``values``' dtype (computed in float64: no overflow for
      any finite float32 input)
    """
    out_dtype = values.dtype
    values, weights = values.to(torch.float64), weights.to(torch.float64)
    total = float(weights.sum())
    if values.ndim != 2 or weights.shape != (values.shape[0],) or not total > 0:
        raise ValueError("need an n x d tensor and n non-negative weights with a positive sum")
    v = weighted_median(values, weights)
    if tau is None:
        distances = torch.linalg.vector_norm(values - v, dim=1)
        tau = float(weighted_median(distances[:, None], weights)[0])
        if not tau > 0:  # at least half of the weight sits on the median itself
            return v.to(out_dtype)
    share = weights / total
    for _ in range(iterations):
        diff = values - v
        norms = torch.linalg.vector_norm(diff, dim=1)
        scale = torch.clamp(tau / norms.clamp(min=torch.finfo(values.dtype).tiny), max=1.0)
        v = v + (share * scale) @ diff
    return v.to(out_dtype)
