"""Peers an averager avoids for a while after they sent poison (sans-IO: ``now`` passed in).

Each offence bans a peer for ``base_duration x 2 ** (offences - 1)`` seconds, at most
``max_duration``. The offence count decays: it halves every ``half_life`` seconds without a
new offence, so a peer that broke once (an fp16 overflow) is soon forgiven, while one that
keeps sending poison stays out longer each time. At most ``max_peers`` peers are remembered
(the ones whose ban ends first are forgotten first).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DEFAULT_BAN_DURATION", "BanList"]

DEFAULT_BAN_DURATION = 60.0


PeerT = TypeVar("PeerT", bound=Hashable)


@dataclass
class _Record:
    offences: float
    last_offence: float
    until: float


class BanList(Generic[PeerT]):
    """Decaying bans of peers (see the module docstring).

    :param base_duration: length of a first ban in seconds (0: nobody is ever banned)
    :param max_duration: longest ban (default 64 x ``base_duration``)
    :param half_life: seconds over which a peer's offence count halves (default 10 x
      ``max_duration``)
    :param max_peers: most peers remembered
    """

    def __init__(
        self,
        base_duration: float = DEFAULT_BAN_DURATION,
        *,
        max_duration: float | None = None,
        half_life: float | None = None,
        max_peers: int = 4096,
    ):
        if not math.isfinite(base_duration) or base_duration < 0:
            raise ValueError(f"base_duration must be finite and non-negative, got {base_duration}")
        max_duration = 64 * base_duration if max_duration is None else float(max_duration)
        if not math.isfinite(max_duration) or max_duration < base_duration:
            raise ValueError("max_duration must be finite and at least base_duration")
        half_life = 10 * max_duration if half_life is None else float(half_life)
        if base_duration and not (math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"half_life must be positive and finite, got {half_life}")
        if max_peers < 1:
            raise ValueError(f"max_peers must be positive, got {max_peers}")
        self.base_duration = float(base_duration)
        self.max_duration = max_duration
        self.half_life = half_life
        self.max_peers = max_peers
        self._records: dict[PeerT, _Record] = {}

    def offences(self, peer: PeerT, now: float) -> float:
        """``peer``'s offence count, decayed to ``now``."""
        record = self._records.get(peer)
        if record is None:
            return 0.0
        elapsed = max(0.0, now - record.last_offence)
        return record.offences * 0.5 ** (elapsed / self.half_life)

    def ban(self, peer: PeerT, now: float) -> float:
        """Record an offence of ``peer``; return when its ban ends."""
        if not self.base_duration:
            return now
        offences = self.offences(peer, now) + 1
        duration = min(self.max_duration, self.base_duration * 2 ** (offences - 1))
        previous = self._records.get(peer)
        until = max(now + duration, previous.until if previous else -math.inf)
        self._records[peer] = _Record(offences, now, until)
        if len(self._records) > self.max_peers:
            del self._records[min(self._records, key=lambda p: self._records[p].until)]
        return until

    def is_banned(self, peer: PeerT, now: float) -> bool:
        record = self._records.get(peer)
        return record is not None and now < record.until

    def banned(self, now: float) -> frozenset[PeerT]:
        """The peers banned at ``now``."""
        return frozenset(p for p, r in self._records.items() if now < r.until)

    def __len__(self) -> int:
        return len(self._records)
