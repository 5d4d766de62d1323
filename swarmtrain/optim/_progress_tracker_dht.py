"""The DHT channel of ``AsyncProgressTracker`` (a mixin): storing this peer's progress record
and fetching everyone's, on the schedule the core decides
(:mod:`swarmtrain.optim.progress_fetch_schedule`). The attributes used here are set by
``AsyncProgressTracker``; its log records go to the tracker's logger.
"""

from __future__ import annotations

import logging

import trio

from swarmtrain.dht import AsyncDHT, ValueWithExpiration, get_dht_time

from ._progress_tracker_arrivals import ProgressArrivals
from .progress_records import _INVALID, _parse_progress
from .progress_types import LocalProgress, describe_eta

__all__ = ["ProgressDHTChannel"]

logger = logging.getLogger("swarmtrain.optim.progress_tracker")


class ProgressDHTChannel(ProgressArrivals):
    """``AsyncProgressTracker``'s DHT tasks: the reporter and the fetcher."""

    # set by AsyncProgressTracker.__init__
    dht: AsyncDHT
    _status_loglevel: int
    _last_status: tuple[int, int] | None
    _fetch_failures: int
    _stores: int
    _store_failures: int
    _fetch_scopes: dict[int, trio.CancelScope]

    async def _store_loop(self) -> None:
        while True:
            now = get_dht_time()
            with self._lock:
                due = self._core.next_store_time(now)
                record = self._core.take_store(now) if due <= now else None
            if due > now:
                with trio.move_on_after(due - now):
                    await self._changed.wait()
                continue
            if record is None:
                continue
            expiration = now + self.config.metadata_expiration
            stored = False
            try:
                with trio.move_on_after(self.config.metadata_expiration):
                    stored = await self.dht.store(
                        self.training_progress_key,
                        record.to_dict(),
                        expiration,
                        subkey=self._subkey,
                    )
            except Exception:
                logger.warning("could not store progress of %s", self.prefix, exc_info=True)
            if stored:
                self._stores += 1
                if record.samples_accumulated == 0:  # an epoch change (or an announcement)
                    logger.debug(
                        "%s: stored epoch %d in %.2f s",
                        self.prefix,
                        record.epoch,
                        get_dht_time() - now,
                    )
            else:
                self._store_failures += 1
                logger.debug("progress of %s was not stored", self.prefix)

    async def _fetch_loop(self) -> None:
        # A fetch starts on schedule even while a slow one is still out (at most
        # MAX_FETCHES_IN_FLIGHT; the core decides): one slow read does not delay what the
        # next one would bring.
        async with trio.open_nursery() as fetches:
            while True:
                now = get_dht_time()
                with self._lock:
                    number = self._core.on_fetch_started(now) if self._core.fetch_due(now) else None
                    next_start = self._core.next_fetch_start(now)
                if number is not None:
                    fetches.start_soon(self._run_fetch, now, number)
                    continue
                with trio.move_on_after(max(0.0, next_start - now)):
                    await self._changed.wait()  # gossip, reports and ended fetches

    async def _fetch(self) -> None:
        """Fetch the swarm's progress now (besides the scheduled fetches)."""
        started = get_dht_time()
        with self._lock:
            number = self._core.on_fetch_started(started)
        await self._run_fetch(started, number)

    async def _run_fetch(self, started: float, number: int) -> None:
        """Fetch ``number``, begun at ``started``; stopped once a fetch begun later ended."""
        scope = self._fetch_scopes[number] = trio.CancelScope()
        try:
            with scope:
                found = await self.dht.get(self.training_progress_key, latest=True)
        except Exception:
            self._fetch_failures += 1
            logger.warning("could not fetch progress of %s", self.prefix, exc_info=True)
            with self._lock:
                self._core.on_fetch_failed(get_dht_time(), number)
            self._changed.notify()
            return
        finally:
            del self._fetch_scopes[number]
        if scope.cancelled_caught:
            return  # obsolete: a fetch begun after it already ended
        entries: dict[bytes, tuple[LocalProgress | None, float]] = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                if not (isinstance(subkey, bytes) and isinstance(item, ValueWithExpiration)):
                    continue  # a plain value: not ours (validators reject them)
                parsed = _parse_progress(item.value)
                if parsed is not _INVALID:
                    entries[subkey] = (parsed, item.expiration_time)  # type: ignore[assignment]
        now = get_dht_time()
        with self._lock:
            progress = self._core.on_fetch(entries, now, number)
            obsolete = [n for n in self._fetch_scopes if not self._core.fetch_running(n)]
        for stale in obsolete:
            self._fetch_scopes[stale].cancel()
        for subkey, (parsed, _) in entries.items():
            self._note_epoch(subkey, parsed, now, f"fetch ({now - started:.2f} s)")
        # at the status level once per epoch and change of peers; every fetch at DEBUG
        status = (progress.epoch, progress.num_peers)
        level = self._status_loglevel if status != self._last_status else logging.DEBUG
        self._last_status = status
        logger.log(
            level,
            "%s: %d samples of %d for epoch #%d from %d peers; ETA %s (fetch took %.2f s, next "
            "in %.2f s)",
            self.prefix,
            progress.samples_accumulated,
            progress.target_batch_size,
            progress.epoch,
            progress.num_peers,
            describe_eta(progress, now),
            now - started,
            progress.next_fetch_time - now,
        )
        self._log_warnings(now)
        self._changed.notify()
