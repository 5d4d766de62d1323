"""Our side of the group key in one matchmaking round (sans-IO; part of
:class:`~swarmtrain.averaging.matchmaking_core.MatchmakingCore`): our expiration and the
declaration we store under the key (:class:`OwnDeclaration`), and when we read the key
(:class:`KeyReads`)."""

from __future__ import annotations

import math

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking_types import (
    Action,
    Declaration,
    Declare,
    FetchDeclarations,
    MatchmakingConfig,
    PeerId,
)

__all__ = ["KeyReads", "OwnDeclaration"]


class OwnDeclaration:
    """Our expiration (declared, unless a client) and the declaration we stored, with the
    settings of a core: its config, id, schema hash, group key, mode, bandwidth, deadline and
    scheduled time."""

    def __init__(
        self,
        config: MatchmakingConfig,
        peer_id: PeerId,
        schema_hash: bytes,
        group_key: str,
        mode: AveragingMode,
        bandwidth: float | None,
        deadline: float,
        scheduled_time: float | None,
    ) -> None:
        self.config, self.peer_id, self.schema_hash = config, peer_id, schema_hash
        self.group_key, self.mode, self.bandwidth = group_key, mode, bandwidth
        self.deadline, self.scheduled_time = deadline, scheduled_time
        #: whether we declare (and so may lead): every mode but CLIENT
        self.declares = mode != AveragingMode.CLIENT
        self.expiration = -math.inf  # our current expiration (declared, unless a client)
        self.declared: Declaration | None = None

    def seen_by_legacy_peers(self) -> float:
        """Our expiration as an older peer reads it: our record's DHT expiration."""
        declared = self.declared
        return declared.readable_until if declared is not None else self.expiration

    def toward(self, legacy: bool) -> float:
        """The expiration we compare with, and send to, a leader (``legacy``: an older peer)."""
        return self.seen_by_legacy_peers() if legacy else self.expiration

    def expiration_at(self, now: float) -> float:
        """The expiration of a declaration made at ``now``: the scheduled time, at least
        ``min_matchmaking_time`` away, at most the deadline."""
        start = now if self.scheduled_time is None else max(self.scheduled_time, now)
        return min(max(start, now + self.config.min_matchmaking_time), self.deadline)

    def refresh_client_expiration(self, now: float) -> None:
        """A client never leads, so its expiration only says until when it wants a group: it is
        recomputed whenever it picks a leader (leaders that declared after its step began then
        qualify too), never kept from the start of the step."""
        if not self.declares:
            self.expiration = self.expiration_at(now)

    def renew(self, now: float, actions: list[Action]) -> None:
        """Declare again, with the expiration of a declaration made at ``now``."""
        self.declare(self.expiration_at(now), actions)

    def declare(self, expiration: float, actions: list[Action]) -> None:
        """Take ``expiration``; unless a client, store it under the group key."""
        self.expiration = expiration
        if self.declares:
            self.declared = Declaration(
                self.peer_id,
                self.expiration,
                True,
                self.schema_hash,
                self.mode,
                self.bandwidth,
                dht_expiration=self.expiration + self.config.declaration_linger,
            )
            actions.append(Declare(self.group_key, self.declared))

    def withdraw(self) -> list[Action]:
        """The store that withdraws our declaration (none if we have none)."""
        if self.declared is None:
            return []
        d = self.declared
        self.declared = None
        gone = Declaration(
            d.peer_id,
            d.expiration,
            False,
            d.schema_hash,
            d.mode,
            dht_expiration=math.nextafter(d.readable_until, math.inf),
        )
        return [Declare(self.group_key, gone)]


class KeyReads:
    """When we read the group key: at once after a renewal, else at intervals doubling from
    ``first_refresh_interval`` to ``refresh_interval``, one read at a time."""

    def __init__(self, config: MatchmakingConfig, group_key: str) -> None:
        self.config, self.group_key = config, group_key
        self.pending = False
        self.next_fetch = -math.inf
        self.refresh_wait = config.first_refresh_interval  # doubles to refresh_interval

    def answered(self, now: float) -> None:
        """A read ended (with declarations or failed): schedule the next one."""
        self.pending = False
        wait = min(self.refresh_wait, self.config.refresh_interval)
        self.next_fetch = now + wait
        self.refresh_wait = wait * 2

    def restart(self) -> None:
        """Read again at once, then at the first interval (a new expiration may make new
        peers eligible)."""
        self.next_fetch = -math.inf
        self.refresh_wait = self.config.first_refresh_interval

    def fetch(self, actions: list[Action]) -> None:
        """Read the group key unless a read is under way."""
        if not self.pending:
            self.pending = True
            actions.append(FetchDeclarations(self.group_key))
