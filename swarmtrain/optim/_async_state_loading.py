"""Loading the training state from peers, for ``AsyncOptimizer`` (a mixin): the explicit
``load_state_from_peers`` and the catch-up of a peer behind its swarm, whose decisions (retry
back-off, which epoch to enter after a load or a failed load) are
:class:`~swarmtrain.optim.epoch_core.EpochCore`'s. Downloads run on the loop; checking and
applying a state runs in a worker thread. The attributes used here are set by
``AsyncOptimizer``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarmtrain.optim._async_epoch_update import AsyncEpochUpdates
from swarmtrain.optim._optimizer_options import check_positive
from swarmtrain.optim.swarm_health import SwarmHealth

__all__ = ["AsyncStateLoading"]

logger = logging.getLogger("swarmtrain.optim.optimizer")


class AsyncStateLoading(AsyncEpochUpdates):
    """``AsyncOptimizer``'s state loading and catch-up (see the module docstring)."""

    # set by AsyncOptimizer.__init__
    load_state_timeout: float
    client_mode: bool
    health: SwarmHealth
    _busy: trio.StrictFIFOLock

    if TYPE_CHECKING:

        def _check_running(self) -> None: ...

    async def _catch_up(self) -> None:
        """As ``Optimizer._catch_up``: load the state, or take the swarm's epoch alone; after a
        catch-up that left us behind, the next waits for a back-off (``EpochCore.catch_up_due``:
        until then a step only skips its batch: ``on_batch`` checks that)."""
        logger.warning(
            "%s: local epoch %d is behind the swarm's epoch %d: loading state from peers",
            self.run_id,
            self.local_epoch,
            self._tracker.global_epoch,
        )
        if await self._load_state_from_peers(None):
            return
        assert self._state_service is not None
        failure = self._state_service.state_download_failure
        no_donor = failure is not None and not failure.donors
        enter = self._epoch_core.after_failed_catch_up(
            self.local_epoch, self._tracker.global_epoch, no_donor, now=self._now()
        )
        if enter is None:
            logger.warning(
                "%s: still behind the swarm; the next try to catch up is in %.0f s",
                self.run_id,
                self._epoch_core.retry_in,
            )
        else:
            logger.warning(
                "%s: no peer served its state: moving to the swarm's epoch %d with this peer's "
                "own parameters",
                self.run_id,
                enter.epoch,
            )
            await self._enter_epoch(enter.epoch)

    async def _enter_epoch(self, epoch: int) -> None:
        self._state.local_epoch = epoch
        if self._grads is not None:
            await self._torch_work(self._grads.reset_accumulated_grads_)
        self.local_samples_accumulated = 0.0
        self._tracker.update_epoch(epoch)
        if not self.client_mode:
            assert self._state_service is not None
            self._state_service.state_sharing_priority = epoch

    def _vouched_epoch(self) -> int | None:
        progress = self._tracker.global_progress
        others_seen = progress.num_peers >= 2 or progress.epoch > self.local_epoch
        return progress.epoch if others_seen else None

    async def load_state_from_peers(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Download the training state from a peer (see ``Optimizer.load_state_from_peers``):
        retry until ``timeout`` (default ``load_state_timeout``) while some peer declares a
        state; False at once when none does. Returns whether a state was loaded."""
        async with self._busy:
            return await self._load_state_from_peers(timeout)

    async def _load_state_from_peers(
        self, seconds: float | None, min_epoch: int | None = None
    ) -> bool:
        """:meth:`load_state_from_peers`; ``min_epoch``: skip donors whose state is older (they
        are retried until the timeout)."""
        timeout = self.load_state_timeout if seconds is None else seconds
        check_positive("timeout", timeout)
        service, state = self._state_service, self._state
        self._check_running()
        assert service is not None
        if self._rounds is not None:
            await self._rounds.tag_along()
        await self._delayed_updates().wait_all()
        deadline = trio.current_time() + timeout
        loaded, detail = False, "no peer served a state in time"
        errors: set[str] = set()
        while not loaded:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            try:
                check = await trio.to_thread.run_sync(
                    state._state_check, self._vouched_epoch(), min_epoch
                )
                downloaded = await service.load_state_from_peers(remaining, check=check)
                if downloaded is not None:
                    loaded = await trio.to_thread.run_sync(
                        state._load_downloaded_state, downloaded, min_epoch
                    )
            except Exception as e:
                detail = repr(e)
                if detail not in errors:
                    errors.add(detail)
                    logger.warning("%s: loading state from peers failed: %s", self.run_id, detail)
            else:
                failure = service.state_download_failure
                if not loaded and failure is not None:
                    if not failure.donors:
                        logger.info(
                            "%s: no peer shares a training state: nothing to load", self.run_id
                        )
                        return False
                    detail = str(failure)
            self.health.observe_state_download(bool(loaded), "" if loaded else detail)
            if not loaded:
                await trio.sleep(min(0.5, max(0.0, deadline - trio.current_time())))
        if not loaded:
            logger.warning(
                "%s: could not load the training state from peers in %.0f s (%s)",
                self.run_id,
                timeout,
                detail,
            )
            return False
        enter = self._epoch_core.after_load(state.local_epoch, self._tracker.global_epoch)
        await self._enter_epoch(enter.epoch)
        logger.log(
            self.status_loglevel,
            "%s: loaded the training state, now at epoch %d",
            self.run_id,
            self.local_epoch,
        )
        return True
