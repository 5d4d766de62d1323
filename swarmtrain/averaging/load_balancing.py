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
hands to scipy, solved in closed form. With ``c_i = S - 2 s_i > 0`` peer ``i`` finishes at
``T_i(w_i) = (s_i + c_i w_i) / b_i`` (in units of 2 / vector), so the optimum is *water
filling*: one level ``t`` with ``w_i = max(0, (t b_i - s_i) / c_i)`` and ``sum w_i = 1``. Every
peer that reduces anything finishes at ``t``; a peer whose own sending alone takes longer
(``s_i / b_i >= t``) reduces nothing.

Where the optimum is not unique -- a slow sender's own traffic ``s_i / b_i`` is the round's
time whatever the others do -- this picks the *most balanced* optimal point: the one that
minimises the per-peer times lexicographically (the slowest peer first, then the next, ...).
It is unique and it is the optimal point that tolerates the largest overestimate of any other
peer's bandwidth before that peer would slow the round down. hivemind's interior-point solver
lands near the middle of the same optimal face, and rounds to the same integers in its own
examples (``load_balance_peers(60, [0.32, 0.55, 0.44], min_size=10) == (0, 40, 20)``); an
arbitrary vertex or cap-proportional point of that face gave ``(0, 39, 21)``. Peers with
``c_i <= 0`` (only when ``S <= 2``) reduce at no extra cost: they take the whole vector, split
in proportion to bandwidth.

Every member of a group computes the same slices from the same claims, so the result must be
deterministic: plain float arithmetic in a fixed order, ties by index.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from swarmtrain.averaging.partition import apportion

__all__ = [
    "MAX_BANDWIDTH_RATIO",
    "MAX_SHARE",
    "NoReducerError",
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


class NoReducerError(ValueError, AssertionError):
    """Every bandwidth is 0: nobody can reduce. A ``ValueError``; also an ``AssertionError``,
    which hivemind's ``load_balance_peers`` raises here, so ported ``except`` clauses hold."""


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
        raise NoReducerError("at least one peer must have a positive (or unspecified) bandwidth")
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


def _costs(
    bandwidths: Sequence[float | None], senders: Sequence[bool] | None
) -> tuple[list[float], list[float], list[float]]:
    """Bandwidths relative to the largest (:func:`_relative`), sender flags ``s`` (1.0 / 0.0)
    and reduce costs ``c``."""
    resolved, is_sender = _resolve(bandwidths, senders)
    num_senders = sum(is_sender)
    s = [float(x) for x in is_sender]
    return _relative(resolved), s, [num_senders - 2 * x for x in s]


def _fill(
    b: list[float], s: list[float], c: list[float], peers: Sequence[int], mass: float
) -> dict[int, float]:
    """Shares of ``peers`` (all with b > 0) summing to ``mass`` that minimise the latest of
    their times, and then the next latest, ... (the module docstring's water filling)."""
    free = [i for i in peers if c[i] <= 0]  # reducing costs them nothing (S <= 2)
    if free:
        total = math.fsum(b[i] for i in free)
        return {i: mass * b[i] / total for i in free}
    # A peer starts reducing once the level passes its own sending time s_i / b_i: take peers
    # in that order until the level at which the active ones reduce ``mass`` lies below the
    # next peer's threshold.
    order = sorted(peers, key=lambda i: (s[i] / b[i], i))
    for k in range(1, len(order) + 1):
        active = order[:k]
        level = (mass + math.fsum(s[i] / c[i] for i in active)) / math.fsum(
            b[i] / c[i] for i in active
        )
        if k == len(order) or level <= s[order[k]] / b[order[k]]:
            break
    shares = {i: max(0.0, (level * b[i] - s[i]) / c[i]) for i in active}
    total = math.fsum(shares.values())
    if total <= 0:  # only through rounding: fall back to bandwidth shares
        shares, total = {i: b[i] for i in active}, math.fsum(b[i] for i in active)
    return {i: mass * share / total for i, share in shares.items()}


def optimize_fractions(
    bandwidths: Sequence[float | None], senders: Sequence[bool] | None = None
) -> tuple[float, ...]:
    """Fractions (summing to 1) that minimise :func:`butterfly_cost`; where several do, the
    most balanced of them (see the module docstring).

    :param bandwidths: per peer; 0 is a client (reduces nothing), None is "unspecified" (the
      mean of the specified positive bandwidths, or 1 when none is specified)
    :param senders: per peer, whether it sends its own tensors (False for AUX peers); all True
      by default
    """
    b, s, c = _costs(bandwidths, senders)
    fractions = [0.0] * len(b)
    for i, share in _fill(b, s, c, [i for i, x in enumerate(b) if x > 0], 1.0).items():
        fractions[i] = share
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
    :raises ValueError: a bandwidth is negative, NaN or infinite; :class:`NoReducerError`
      (also an ``AssertionError``, as in hivemind) when none is positive
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
    another peer could. The rest is balanced among the others as :func:`optimize_fractions`
    does, so the round is as fast as it can be under that cap."""
    bounded = bound_bandwidths(bandwidths, max_ratio)
    b, s, c = _costs(bounded, senders)
    eligible = [i for i, x in enumerate(b) if x > 0]
    fractions = [0.0] * len(b)
    shares = _fill(b, s, c, eligible, 1.0)
    if len(eligible) >= 2 and max_share * len(eligible) >= 1:
        capped: set[int] = set()
        while True:
            over = [i for i, share in shares.items() if i not in capped and share > max_share]
            if not over:
                break
            capped.update(over)
            rest = [i for i in eligible if i not in capped]
            mass = 1.0 - max_share * len(capped)
            shares = {i: max_share for i in capped}
            if rest and mass > 0:
                shares.update(_fill(b, s, c, rest, mass))
    for i, share in shares.items():
        fractions[i] = share
    return apportion(vector_size, fractions)
