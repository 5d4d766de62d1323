"""What ``AsyncProgressTracker`` logs of the records that arrive (a base of its DHT and gossip
channels): at DEBUG, the first record of a peer's newer epoch on each channel and how late it
came; the core's warnings, once each. The attributes used here are set by
``AsyncProgressTracker``; its log records go to the tracker's logger.
"""

from __future__ import annotations

import logging
import threading

from swarmtrain.p2p import PeerID
from swarmtrain.utils.change_signal import ChangeSignal

from .progress_core import ProgressCore
from .progress_types import LocalProgress, ProgressConfig, ProgressWarning, short_peer_id

__all__ = ["ProgressArrivals"]

logger = logging.getLogger("swarmtrain.optim.progress_tracker")
_MAX_EPOCHS_SEEN = 4096


def _short_peer_id(peer_id: bytes) -> str:
    try:
        return str(PeerID(peer_id))[-12:]
    except Exception:
        return short_peer_id(peer_id)


class ProgressArrivals:
    """The members of ``AsyncProgressTracker`` its channels share, and its arrival logs."""

    # set by AsyncProgressTracker.__init__
    prefix: str
    config: ProgressConfig
    training_progress_key: str
    _core: ProgressCore
    _subkey: bytes
    _lock: threading.Lock
    _changed: ChangeSignal
    #: per channel (gossip, fetch), the newest epoch heard of each peer (for logs)
    _epochs_seen: dict[str, dict[bytes, int]]

    def _note_epoch(
        self, subkey: bytes, record: LocalProgress | None, now: float, via: str
    ) -> None:
        """Log (DEBUG) the first record of a peer's newer epoch on each channel (gossip, fetch):
        how late it reached us."""
        if record is None or subkey == self._subkey:
            return
        channel = via.split(" ", 1)[0]
        seen = self._epochs_seen.setdefault(channel, {})
        if record.epoch <= seen.get(subkey, -1):
            return
        if len(seen) >= _MAX_EPOCHS_SEEN:
            seen.clear()  # for logs only: a flood of identities costs no memory
        seen[subkey] = record.epoch
        logger.debug(
            "%s: peer %s at epoch %d via %s, %.2f s after its report",
            self.prefix,
            _short_peer_id(subkey),
            record.epoch,
            via,
            now - record.time,
        )

    def _log_warnings(self, now: float) -> None:
        with self._lock:
            warnings: list[ProgressWarning] = self._core.warnings(now)
        for warning in warnings:
            logger.warning("%s: %s", self.prefix, warning)
