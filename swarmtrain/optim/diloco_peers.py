"""Who is in a DiLoCo run: each peer declares itself in the DHT, and reads the others.

Key ``{run_id}_diloco.peers``, subkey: the peer's id (signed with its identity key, so nobody
else can write it: ``swarmtrain.dht.peer_records``), value ``{"donor": bool, "step": int}``
(whether it serves its state to joiners; the inner step of the last round it finished, once
it finished one), expiring ``ttl`` seconds after each store; a task of the presence's nursery
re-stores it every ``ttl / 3`` seconds and at once after :meth:`RunPresence.declare_step`, and
leaving :meth:`RunPresence.create` replaces it with ``None`` (gone). The optimizer uses it to
skip waits that cannot end well: a lone peer loads no state and starts no round, a round is
complete as soon as every peer present has joined, and a peer whose round every other peer has
already finished (they declared that step or a later one) does not wait for them in it.

A peer killed without saying goodbye stays "present" until its record expires (``ttl``): a
rerun of the run at once waited for it in its first rounds and tried to load its state. So
:meth:`RunPresence.others` dials each donor it lists (a donor can be dialled; other peers may
be clients) once, within ``probe_timeout``, and leaves out a donor that cannot be reached until
it stores its record again (the rules of :mod:`swarmtrain.optim.progress_liveness`).

Resource handling: ``async with RunPresence.create(dht, run_id, donor=...)`` (``dht``: an
``AsyncDHT``) stores the first record (bounded by ``timeout``) and starts the refresh task;
leaving it stops the task and stores the goodbye record (shielded, bounded by ``timeout``).
Everything runs on the DHT's trio loop: no thread.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from swarmtrain.dht import PeerRecordValidator, get_dht_time
from swarmtrain.dht.owned_keys import PRESENCE_KEY_PATTERN

from ._owner_probe import dial_owner
from .progress_liveness import OwnerCandidate, OwnerLiveness, Probe, ProbeOutcome

__all__ = ["PRESENCE_KEY_PATTERN", "Present", "RunPresence", "presence_key"]

logger = logging.getLogger(__name__)

DEFAULT_TTL = 30.0


def presence_key(run_id: str) -> str:
    return f"{run_id}_diloco.peers"


@dataclass(frozen=True)
class Present:
    """Another peer of the run, as its record says."""

    peer_id: bytes
    donor: bool
    #: the inner step of the last round it finished (None: none yet, or an older version)
    step: int | None = None


class RunPresence:
    """Declares this peer in ``run_id`` and lists the other peers; see the module docstring.
    Build it with :meth:`create`.

    :param dht: a running ``AsyncDHT``
    :param donor: whether this peer serves its state to joiners
    :param ttl: seconds a record lives without a refresh
    :param timeout: bound on each DHT store or read
    :param probe_timeout: a donor that cannot be dialled within this long is left out
    """

    def __init__(
        self,
        dht,
        run_id: str,
        *,
        donor: bool,
        ttl: float = DEFAULT_TTL,
        timeout: float = 5.0,
        probe_timeout: float = 3.0,
    ):
        self.dht = dht
        self.key = presence_key(run_id)
        self.donor = bool(donor)
        self.ttl = float(ttl)
        self.timeout = float(timeout)
        self.probe_timeout = float(probe_timeout)
        self._ours = dht.peer_id.to_bytes()
        self._step: int | None = None
        self._wake = trio.Event()  # store the record now (a new step)
        self._liveness = OwnerLiveness(retry_period=self.ttl / 3)

    @classmethod
    @asynccontextmanager
    async def create(cls, dht, run_id: str, **kwargs) -> AsyncIterator[RunPresence]:
        """Declare this peer (first record stored before this returns), keep the record alive
        in a task, and store the goodbye record on the way out."""
        self = cls(dht, run_id, **kwargs)
        # records are owned: only a peer can write (or blank) its own subkey
        dht.add_validators([PeerRecordValidator([PRESENCE_KEY_PATTERN])])
        await self._store(self._record())
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._refresh)
                try:
                    yield self
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._store(None)  # newcomers see at once that we left

    def declare_step(self, step: int) -> None:
        """Declare that we finished the round of inner step ``step`` (stored by the refresh
        task, at once: this call does not wait for the DHT)."""
        self._step = int(step)
        self._wake.set()

    def _record(self) -> dict:
        record: dict = {"donor": self.donor}
        if self._step is not None:
            record["step"] = self._step
        return record

    async def others(self) -> list[Present]:
        """The other peers whose records are alive ([] if the DHT read fails or times out)."""
        found = None
        with trio.move_on_after(self.timeout):
            try:
                found = await self.dht.get(self.key, latest=True)
            except Exception as e:  # a DHT that is down: nobody we know of
                logger.debug("could not read %s: %r", self.key, e)
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        present: dict[bytes, tuple[Present, float]] = {}
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            if subkey == self._ours or not isinstance(subkey, bytes) or not isinstance(value, dict):
                continue
            expiration = getattr(item, "expiration_time", now + 1)
            if expiration <= now:
                continue
            step = value.get("step")
            step = step if isinstance(step, int) and not isinstance(step, bool) else None
            present[subkey] = (Present(subkey, bool(value.get("donor", False)), step), expiration)
        return await self._reachable(present, now)

    async def _reachable(
        self, present: dict[bytes, tuple[Present, float]], now: float
    ) -> list[Present]:
        """``present`` without the donors that could not be dialled (see the module docstring)."""
        self._liveness.prune({peer: expiration for peer, (_, expiration) in present.items()})
        probes = self._liveness.due(
            (
                OwnerCandidate(peer, peer, expiration)
                for peer, (record, expiration) in present.items()
                if record.donor
            ),
            now,
        )
        outcomes: dict[Probe, ProbeOutcome] = {}
        if probes:  # (at most a few dozen peers in a DiLoCo run: all dialled at once)
            outcomes = await self._probe(probes)
        for probe in probes:
            outcome = outcomes.get(probe)
            if outcome is None:
                self._liveness.abandon(probe)
            elif self._liveness.on_result(probe, outcome, now) and outcome is not (
                ProbeOutcome.REACHABLE
            ):
                logger.info(
                    "%s: peer %s cannot be dialled: not counting it as present",
                    self.key,
                    probe.peer_id.hex()[:16],
                )
        return [
            record
            for peer, (record, expiration) in present.items()
            if self._liveness.counts(peer, expiration)
        ]

    async def _probe(self, probes: list[Probe]) -> dict[Probe, ProbeOutcome]:
        outcomes: dict[Probe, ProbeOutcome] = {}

        async def dial(probe: Probe) -> None:
            outcomes[probe] = ProbeOutcome.UNREACHABLE  # unless it answers in time
            with trio.move_on_after(self.probe_timeout):
                outcomes[probe] = await dial_owner(self.dht.p2p, probe.peer_id)

        async with trio.open_nursery() as nursery:
            for probe in probes:
                nursery.start_soon(dial, probe)
        return outcomes

    async def _store(self, value) -> None:
        with trio.move_on_after(self.timeout):
            try:
                await self.dht.store(self.key, value, get_dht_time() + self.ttl, subkey=self._ours)
                return
            except Exception as e:
                logger.debug("could not declare this peer under %s: %r", self.key, e)
                return
        logger.debug("declaring this peer under %s timed out", self.key)

    async def _refresh(self) -> None:
        while True:
            with trio.move_on_after(self.ttl / 3):
                await self._wake.wait()
            self._wake = trio.Event()
            await self._store(self._record())
