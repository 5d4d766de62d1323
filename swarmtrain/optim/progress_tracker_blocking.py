"""``ProgressTracker``: the blocking facade of :class:`AsyncProgressTracker` for plain loops."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

from swarmtrain.dht import DHT, AsyncDHT
from swarmtrain.dht.node import DHTNode
from swarmtrain.p2p.pubsub import PubSub
from swarmtrain.utils.background import BackgroundService
from swarmtrain.utils.facade import aio_property

from .progress_records import ProgressTrackerStatistics
from .progress_tracker import AsyncProgressTracker
from .progress_types import GlobalProgress, LocalProgress, PerformanceEMA

T = TypeVar("T")


class ProgressTracker(BackgroundService):
    """hivemind's ``ProgressTracker`` for plain (blocking) code, over a blocking ``DHT``.

    It runs an :class:`AsyncProgressTracker` on swarmtrain's background trio loop; keywords
    are those of :meth:`create`. Call :meth:`shutdown` (or use ``with``) when done.
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        start: bool = True,
        **kwargs: Any,
    ):
        self.dht, self.prefix = dht, prefix
        self._target_batch_size, self._kwargs = target_batch_size, kwargs
        if start:
            self.start()

    create = AsyncProgressTracker.create  #: the trio way in

    #: asyncio awaitables (``await tracker.aio.wait_global_epoch(3)``); bound them with
    #: ``asyncio.wait_for`` or ``asyncio.timeout``
    aio = aio_property()
    _aio_methods = {
        "wait_global_epoch": AsyncProgressTracker.wait_global_epoch,
        "wait_ready_to_update_epoch": AsyncProgressTracker.wait_ready_to_update_epoch,
        "wait_num_peers": AsyncProgressTracker.wait_num_peers,
        "refresh": AsyncProgressTracker.refresh,
    }

    _service_name = "this ProgressTracker"

    def start(self) -> None:

        async def get_async_dht(async_dht: AsyncDHT, node: DHTNode) -> AsyncDHT:
            return async_dht

        async_dht = self.dht.run_coroutine(get_async_dht)
        self._start_in_background(
            lambda: AsyncProgressTracker.create(
                async_dht, self.prefix, self._target_batch_size, **self._kwargs
            )
        )

    def shutdown(self, timeout: float | None = None) -> None:
        """Publish a departure record, stop the background tasks (cut short after
        ``timeout`` seconds)."""
        super().shutdown(timeout)

    def _tracker(self) -> AsyncProgressTracker:
        return self._running()[1]

    def _readable(self) -> AsyncProgressTracker:
        """The tracker to read from: after shutdown, its last state (as in hivemind)."""
        if self._shut_down and self._service is not None:
            return self._service
        return self._tracker()

    @property
    def pubsub(self) -> PubSub | None:
        """The ``PubSub`` progress is gossiped on (None with ``use_pubsub=False``). It lives on
        swarmtrain's background loop, like a blocking ``MetricsPublisher``: pass it there as
        ``MetricsPublisher(dht, run_id, pubsub=opt.tracker.pubsub)`` to gossip metrics too."""
        return self._tracker().pubsub

    # Reads take the core's current snapshots directly (frozen objects, replaced whole), and
    # reports run in this thread under the tracker's lock, waking the loop without waiting for
    # it: a training step never waits for a loop busy with averaging or the DHT.

    @property
    def global_progress(self) -> GlobalProgress:
        return self._readable()._core.global_progress

    @property
    def local_progress(self) -> LocalProgress:
        return self._readable()._core.local_progress

    @property
    def performance_ema(self) -> PerformanceEMA:
        """This peer's samples/s, as reported (``.samples_per_second``; hivemind's name)."""
        return self._readable().performance_ema

    @property
    def global_epoch(self) -> int:
        return self.global_progress.epoch

    @property
    def local_public_key(self) -> bytes:
        """The subkey of this peer's progress record: its peer id (``PeerID.to_bytes()``)."""
        return self._tracker().local_public_key

    @property
    def ready_to_update_epoch(self) -> bool:
        return self._tracker().ready_to_update_epoch

    @property
    def estimated_next_update_time(self) -> float:
        return self._tracker().estimated_next_update_time

    def announce(self) -> None:
        """Publish this peer's record now, before it reports samples (see
        :meth:`AsyncProgressTracker.announce`)."""
        self._tracker().announce()

    def report_local_progress(self, local_epoch: int, samples_accumulated: int) -> None:
        self._tracker().report_local_progress(local_epoch, samples_accumulated)

    def update_epoch(self, new_epoch: int | None = None) -> int:
        return self._tracker().update_epoch(new_epoch)

    def on_round_partners(self, peer_ids: Iterable[Any], epoch: int) -> None:
        """This peer averaged with ``peer_ids`` (``PeerID`` or bytes) in a round of ``epoch``
        (see :meth:`AsyncProgressTracker.on_round_partners`)."""
        self._tracker().on_round_partners(peer_ids, epoch)

    @contextmanager
    def pause_updates(self) -> Iterator[None]:
        with self._tracker().pause_updates():
            yield

    def wait_global_epoch(self, epoch: int, timeout: float | None = None) -> GlobalProgress:
        """Block until the swarm's epoch is at least ``epoch``; ``TimeoutError`` after
        ``timeout`` seconds."""
        return self._wait(lambda: self._tracker().wait_global_epoch(epoch), timeout)

    def wait_ready_to_update_epoch(self, timeout: float | None = None) -> GlobalProgress:
        return self._wait(self._tracker().wait_ready_to_update_epoch, timeout)

    def wait_num_peers(self, num_peers: int, timeout: float | None = None) -> GlobalProgress:
        """Block until the swarm's progress counts ``num_peers`` peers; ``TimeoutError`` after
        ``timeout`` seconds."""
        return self._wait(lambda: self._tracker().wait_num_peers(num_peers), timeout)

    def refresh(self, timeout: float | None = None) -> GlobalProgress:
        """Fetch the swarm's progress from the DHT now; ``TimeoutError`` after ``timeout``."""
        return self._wait(self._tracker().refresh, timeout)

    def _wait(self, fn: Callable[[], Any], timeout: float | None) -> Any:
        runtime, _ = self._running()

        async def bounded() -> Any:
            try:
                with trio.fail_after(math.inf if timeout is None else timeout):
                    return await fn()
            except trio.TooSlowError:
                raise TimeoutError(f"not done within {timeout} s") from None

        return runtime.call(bounded)

    def statistics(self) -> ProgressTrackerStatistics:
        return self._tracker().statistics()

    def peers(self) -> dict[bytes, LocalProgress]:
        """Live progress records of the other peers, by owner marker."""
        return self._tracker().peers()
