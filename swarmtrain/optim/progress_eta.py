"""How far the swarm is in its epoch and when it reaches the target (sans-IO).

The samples of the peers at the global epoch whose samples count (once this peer has partners,
only the *vouched* peers': see :mod:`swarmtrain.optim.progress_votes`), each at most its
:class:`~swarmtrain.optim.progress_votes.Credit` allows, plus what the peers one epoch ahead
accumulated in it before they stepped (their
:class:`~swarmtrain.optim.progress_votes.Carry`); a claim over twice the bound is reported.
The ETA extrapolates each such peer's samples from its report time at its samples/s (capped at
``max_rate``), and divides what remains of the target by the samples/s of those peers. (hivemind
counts peers behind for speed too, "they will catch up"; but a peer behind is usually still
averaging the last epoch, and counting its speed ended epochs at ~55-80% of the target on a
loaded box.)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .progress_types import EPS, ImplausibleProgress, LocalProgress
from .progress_votes import SampleCredits

__all__ = ["EpochEstimate", "estimate_epoch"]


@dataclass(frozen=True)
class EpochEstimate:
    """The swarm's samples toward the target of an epoch and its speed."""

    samples: int  #: samples that count, as reported
    rate: float  #: samples/s of the peers whose samples count
    eta: float  #: seconds until the target, at that speed
    #: records whose samples were over twice their bound (by key), in the order found
    implausible: tuple[tuple[bytes, ImplausibleProgress], ...]


def estimate_epoch(
    epoch: int,
    local: LocalProgress | None,
    others: Mapping[bytes, LocalProgress],
    credits: SampleCredits,
    vouched: Collection[bytes] | None,
    max_rate: float,
    target: int,
    now: float,
) -> EpochEstimate:
    """The estimate for ``epoch`` from this peer's record (``local``: None when it does not
    count) and the others' (``vouched``: the keys whose samples count, None: all of them)."""
    implausible: list[tuple[bytes, ImplausibleProgress]] = []
    samples, estimated, rate = 0.0, 0.0, 0.0
    if local is not None:  # our own samples are not in doubt
        rate += local.samples_per_second
        samples += local.samples_accumulated
        elapsed = max(0.0, now - local.time)
        estimated += local.samples_accumulated + elapsed * local.samples_per_second
    for key, peer in others.items():
        counts = vouched is None or key in vouched
        carry = credits.carries.get(key)
        if peer.epoch == epoch + 1 and carry is not None and carry.credit.epoch == epoch:
            if not counts:
                continue
            bound = carry.credit.bound(max_rate, carry.left_at)
            samples += min(carry.samples, bound)
            estimated += min(carry.samples, bound)
            continue
        if peer.epoch != epoch:
            continue
        credit = credits.credits.get(key)
        bound = math.inf if credit is None else credit.bound(max_rate, now)
        if peer.samples_accumulated > 2 * bound:
            allowed = int(bound)
            implausible.append(
                (
                    key,
                    ImplausibleProgress(
                        peer.peer_id, key, peer.epoch, peer.samples_accumulated, epoch, allowed
                    ),
                )
            )  # reported even when nobody vouches for it: the claim is a lie either way
        if not counts:
            continue
        peer_rate = min(peer.samples_per_second, max_rate)
        rate += peer_rate
        samples += min(peer.samples_accumulated, bound)
        elapsed = max(0.0, now - peer.time)
        estimated += min(peer.samples_accumulated + elapsed * peer_rate, bound)
    eta = max(0.0, target - estimated) / (rate + EPS)
    return EpochEstimate(int(samples), rate, eta, tuple(implausible))
