"""How much of the vector each peer reduces, given bandwidths (pure, exact, no solver).

Cost model of one butterfly all-reduce of a vector of size 1. Peer ``i`` reduces a fraction
``w_i`` of it. ``S`` peers are *senders* (NODE and CLIENT peers; AUX peers send nothing).

- as a sender, peer ``i`` uploads the ``1 - w_i`` it does not reduce itself and downloads as
  much back (averaged);
- as a reducer, it downloads ``w_i`` from each of the other senders and uploads ``w_i`` back to
  each of them: ``S - 1`` others for a sender, ``S`` for an AUX peer.

So ``incoming_i = outgoing_i = s_i + (S - 2 s_i) w_i`` (``s_i`` is 1 for a sender, else 0),
and the round takes ``max_i (incoming_i + outgoing_i) / bandwidth_i`` over peers with a positive
bandwidth. Peers with bandwidth 0 are clients: they reduce nothing and their own (fixed) time
is not part of the objective.

:func:`optimize_fractions` minimises that maximum exactly. It is the linear program hivemind
hands to scipy, solved in closed form: with ``c_i = S - 2 s_i > 0`` every constraint
``s_i + c_i w_i <= t b_i / 2`` is tight at the optimum unless ``t`` is held up by a peer that
reduces nothing (then any assignment under those caps is optimal); peers with ``c_i <= 0``
(only when ``S <= 2``) reduce at no extra cost and take the whole vector.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from swarmtrain.averaging.partition import apportion

__all__ = [
    "MAX_BANDWIDTH_RATIO",
    "MAX_SHARE",
    "bound_bandwidths",
    "bounded_load_balance",
    "butterfly_cost",
    "load_balance_peers",
    "optimize_fractions",
]

MAX_BANDWIDTH_RATIO = 4.0
"""A bandwidth claim above this many times the group's median claim counts as the bound."""
MAX_SHARE = 0.5
"""With two or more reducers, none reduces more than this share of the vector."""
_MIN_RELATIVE_BANDWIDTH = 1e-300  # below this, 1 / ratio overflows


def _check_bandwidths(bandwidths: Iterable[float | None]) -> list[float | None]:
    """Any sequence or 1-D array of numbers (None: unspecified) as a list of floats."""
    if isinstance(bandwidths, (str, bytes)) or not isinstance(bandwidths, Iterable):
        raise TypeError(f"bandwidths must be a sequence of numbers, got {bandwidths!r}")
    checked: list[float | None] = []
    for b in bandwidths:
        if b is None:
            checked.append(None)
            continue
        if isinstance(b, bool) or not isinstance(b, numbers.Real):
            raise TypeError(f"bandwidths must be numbers or None, got {b!r}")
        if not math.isfinite(b) or b < 0:
            raise ValueError(f"bandwidths must be finite and non-negative, got {b}")
        checked.append(float(b))
    return checked


def _resolve(
    bandwidths: Iterable[float | None], senders: Iterable[bool] | None
) -> tuple[list[float], list[bool]]:
    bandwidths = _check_bandwidths(bandwidths)
    if not bandwidths:
        raise ValueError("need at least one peer")
    senders = [True] * len(bandwidths) if senders is None else [bool(s) for s in senders]
    if len(senders) != len(bandwidths):
        raise ValueError("bandwidths and senders have different lengths")
    specified = [float(b) for b in bandwidths if b is not None and b > 0]
    default = math.fsum(b / len(specified) for b in specified) if specified else 1.0
    resolved = [default if b is None else float(b) for b in bandwidths]
    if not any(b > 0 for b in resolved):
        raise ValueError("at least one peer must have a positive (or unspecified) bandwidth")
    return resolved, senders


def _relative(resolved: list[float]) -> list[float]:
    """Bandwidths over the largest one (fractions depend only on their ratios), so that no sum
    overflows and no division by a tiny claim does; a positive claim counts as at least
    1e-300 of the largest (such a peer reduces next to nothing either way)."""
    top = max(resolved)
    return [0.0 if b == 0 else max(b / top, _MIN_RELATIVE_BANDWIDTH) for b in resolved]


def butterfly_cost(
    fractions: Sequence[float],
    bandwidths: Sequence[float | None],
    senders: Sequence[bool] | None = None,
) -> float:
    """Time of one round for a vector of size 1: max over reducing-capable peers of
    ``(incoming + outgoing) / bandwidth`` (see the module docstring)."""
    resolved, is_sender = _resolve(bandwidths, senders)
    fractions = [float(f) for f in fractions]
    if len(fractions) != len(resolved):
        raise ValueError("fractions and bandwidths have different lengths")
    num_senders = sum(is_sender)
    cost = 0.0
    for w, b, s in zip(fractions, resolved, is_sender, strict=True):
        if b > 0:
            traffic = int(s) + (num_senders - 2 * int(s)) * w
            cost = max(cost, 2.0 * traffic / b)
    return cost


def optimize_fractions(
    bandwidths: Sequence[float | None], senders: Sequence[bool] | None = None
) -> tuple[float, ...]:
    """Fractions (summing to 1) that minimise :func:`butterfly_cost`.

    :param bandwidths: per peer; 0 is a client (reduces nothing), None is "unspecified" (the
      mean of the specified positive bandwidths, or 1 when none is specified)
    :param senders: per peer, whether it sends its own tensors (False for AUX peers); all True
      by default
    """
    resolved, is_sender = _resolve(bandwidths, senders)
    resolved = _relative(resolved)
    num_senders = sum(is_sender)
    reducers = [i for i, b in enumerate(resolved) if b > 0]
    s = [float(x) for x in is_sender]
    c = [num_senders - 2 * s[i] for i in range(len(resolved))]
    fractions = [0.0] * len(resolved)

    free = [i for i in reducers if c[i] <= 0]  # reducing costs them nothing (S <= 2)
    if free:
        total = math.fsum(resolved[i] for i in free)
        for i in free:
            fractions[i] = resolved[i] / total
        return tuple(fractions)

    # All c_i > 0: the optimum is t = max(t0, t1) (t in units of "time / 2").
    t0 = max(s[i] / resolved[i] for i in reducers)
    t1 = (1.0 + math.fsum(s[i] / c[i] for i in reducers)) / math.fsum(
        resolved[i] / c[i] for i in reducers
    )
    t = max(t0, t1)
    caps = {i: max(0.0, (t * resolved[i] - s[i]) / c[i]) for i in reducers}
    total = math.fsum(caps.values())
    for i in reducers:
        fractions[i] = caps[i] / total
    return tuple(fractions)


def load_balance_peers(
    vector_size: int,
    bandwidths: Sequence[float | None],
    min_size: int = 0,
    *,
    senders: Sequence[bool] | None = None,
) -> tuple[int, ...]:
    """How many of ``vector_size`` values each peer reduces (hivemind's function and meaning).

    :param bandwidths: per peer (any sequence or 1-D array; see :func:`optimize_fractions`)
    :param min_size: peers that would reduce fewer values get none (their share goes to the
      others), unless that would leave nobody
    :raises ValueError: a bandwidth is negative, NaN or infinite, or none is positive
    """
    if vector_size < 0:
        raise ValueError(f"vector_size must be non-negative, got {vector_size}")
    fractions = list(optimize_fractions(bandwidths, senders))
    if min_size > 0 and vector_size > 0:
        threshold = min_size / vector_size
        if max(fractions) >= threshold:
            fractions = [f if f >= threshold else 0.0 for f in fractions]
    return apportion(vector_size, fractions)


def bound_bandwidths(
    bandwidths: Sequence[float | None], max_ratio: float = MAX_BANDWIDTH_RATIO
) -> list[float | None]:
    """Claims clamped to ``max_ratio`` x the (lower) median of the positive claims (None and 0
    stay): a peer that claims 1e12 cannot take the whole vector, nor raise everyone's default."""
    checked = _check_bandwidths(bandwidths)
    positive = sorted(b for b in checked if b is not None and b > 0)
    if not positive:
        return checked
    bound = max_ratio * positive[(len(positive) - 1) // 2]
    return [None if b is None else min(b, bound) for b in checked]


def bounded_load_balance(
    vector_size: int,
    bandwidths: Sequence[float | None],
    *,
    senders: Sequence[bool] | None = None,
    max_ratio: float = MAX_BANDWIDTH_RATIO,
    max_share: float = MAX_SHARE,
) -> tuple[int, ...]:
    """:func:`load_balance_peers` on claims that peers make about themselves: claims bounded by
    :func:`bound_bandwidths`, then no peer reduces more than ``max_share`` of the vector while
    another peer could (the excess goes to the others in proportion to their bandwidths)."""
    bounded = bound_bandwidths(bandwidths, max_ratio)
    resolved = _relative(_resolve(bounded, senders)[0])
    fractions = list(optimize_fractions(bounded, senders))
    eligible = [i for i, b in enumerate(resolved) if b > 0]
    if len(eligible) >= 2 and max_share * len(eligible) >= 1:
        capped: set[int] = set()
        while True:
            over = [i for i in eligible if i not in capped and fractions[i] > max_share]
            if not over:
                break
            capped.update(over)
            excess = math.fsum(fractions[i] - max_share for i in over)
            for i in over:
                fractions[i] = max_share
            rest = [i for i in eligible if i not in capped]
            weight = math.fsum(resolved[i] for i in rest)
            for i in rest:
                fractions[i] += excess * resolved[i] / weight
    return apportion(vector_size, fractions)
