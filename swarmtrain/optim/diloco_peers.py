"""Who is in a DiLoCo run: each peer declares itself in the DHT, and reads the others.

Key ``{run_id}_diloco.peers``, subkey: the peer's id, value ``{"donor": bool}`` (whether it
serves its state to joiners), expiring ``ttl`` seconds after each store; a thread re-stores it
every ``ttl / 3`` seconds, and :meth:`RunPresence.stop` replaces it with ``None`` (gone). The
optimizer uses it to skip waits that cannot end well: a lone peer loads no state and starts
no round, and a round is complete as soon as every peer present has joined.

Resource handling: :meth:`RunPresence.start` stores the first record (blocking, bounded by
``timeout``) and starts the thread; :meth:`RunPresence.stop` ends it and stores the last record.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from swarmtrain.dht import get_dht_time

__all__ = ["RunPresence", "presence_key"]

logger = logging.getLogger(__name__)

DEFAULT_TTL = 30.0


def presence_key(run_id: str) -> str:
    return f"{run_id}_diloco.peers"


@dataclass(frozen=True)
class Present:
    """Another peer of the run, as its record says."""

    peer_id: bytes
    donor: bool


class RunPresence:
    """Declares this peer in ``run_id`` and lists the other peers; see the module docstring.

    :param dht: a running blocking ``DHT``
    :param donor: whether this peer serves its state to joiners
    :param ttl: seconds a record lives without a refresh
    :param timeout: bound on each DHT store or read
    """

    def __init__(
        self, dht, run_id: str, *, donor: bool, ttl: float = DEFAULT_TTL, timeout: float = 5.0
    ):
        self.dht = dht
        self.key = presence_key(run_id)
        self.donor = bool(donor)
        self.ttl = float(ttl)
        self.timeout = float(timeout)
        self._ours = dht.peer_id.to_bytes()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._store({"donor": self.donor})
        self._thread = threading.Thread(
            target=self._refresh, name=f"presence {self.key}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(self.timeout + 1.0)
        self._store(None)  # newcomers see at once that we left

    def others(self) -> list[Present]:
        """The other peers whose records are alive (blocking DHT read; [] if it fails)."""
        try:
            found = self.dht.get(self.key, latest=True, return_future=True).result(self.timeout)
        except Exception as e:  # a timeout or a DHT that is down: nobody we know of
            logger.debug("could not read %s: %r", self.key, e)
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        present = []
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            if subkey == self._ours or not isinstance(subkey, bytes) or not isinstance(value, dict):
                continue
            if getattr(item, "expiration_time", now + 1) <= now:
                continue
            present.append(Present(subkey, bool(value.get("donor", False))))
        return present

    def _store(self, value) -> None:
        try:
            self.dht.store(
                self.key,
                value,
                get_dht_time() + self.ttl,
                subkey=self._ours,
                return_future=True,
            ).result(self.timeout)
        except Exception as e:
            logger.debug("could not declare this peer under %s: %r", self.key, e)

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self._store({"donor": self.donor})
