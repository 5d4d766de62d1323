"""The gradient rounds of ``AsyncOptimizer`` (and so of the blocking ``Optimizer``).

``AsyncGradientRounds`` owns at most one pre-scheduled control of the gradient averager:

- :meth:`maybe_schedule` starts matchmaking once the swarm is expected to reach
  ``target_batch_size`` within ``matchmaking_time`` (the tracker's ETA; ``EpochCore`` decides
  when), so that the group is assembled while the peers still compute (hivemind's
  pre-scheduling);
- :meth:`begin` loads the accumulated gradients into the averaged buffers, resets the
  accumulators and lets all-reduce run in that control (or in a new one); alone, it only
  loads the local mean gradient;
- :meth:`finish` waits for the round: afterwards the averaged buffers hold the group's mean
  gradient, or the local mean gradient if the round failed (logged); a round still looking
  for a group after the swarm went past its epoch is given up;
- after the first successful round, every round tells matchmaking how many peers to expect
  (the tracker's count, or the last group's size if larger: auxiliary peers publish no
  progress), so a leader assembles as soon as they are all in instead of waiting out
  ``matchmaking_time``; the first round expects one more than the peers seen in its epoch (a
  leader then holds for a late declaration, and never assembles early on a count that may
  still grow);
- a round still looking for a group once the swarm went past its epoch gives up at once when
  no other peer present is in that epoch any more (``_epoch_sync.left_behind_grace``), so a
  peer that missed one round enters the next epoch with the others and joins their next round;
- every round matches under group bits made from its epoch (``epoch_group_bits``), so a late
  peer still finishing epoch ``e`` never averages with peers already in ``e + 1``'s round;
- :meth:`tag_along` lets a scheduled round whose group is already assembled run with weight 0
  (so the others are not disrupted), and cancels one that is still looking for a group.

Every wait is a trio await and every touch of the gradient buffers (they are guarded by
``threading`` locks the averager's all-reduce also takes) runs in a worker thread, so the
loop is never blocked by a lock or a copy. ``averager`` is the running
:class:`~swarmtrain.averaging.AsyncDecentralizedAverager` over ``buffers``' averaged tensors
(or a ``HelperProcessBackend`` whose controls are awaitable too); ``buffers`` is a
``GradientAverager`` built with ``start=False``: only its accumulator and buffer methods are
used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import trio

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
from swarmtrain.averaging.control import AveragingStage
from swarmtrain.dht import deserialize
from swarmtrain.optim._epoch_sync import expected_round_size, left_behind_grace
from swarmtrain.optim._torch_work import TorchWork
from swarmtrain.optim.grad_averager import GradientAverager

__all__ = ["AsyncGradientRounds", "epoch_group_bits"]

logger = logging.getLogger("swarmtrain.optim.optimizer")

_POLL_INTERVAL = 0.1  # seconds between looks at the swarm's epoch while a round runs

#: gradient rounds are told apart in the matchmaking key by their epoch modulo 2 ** EPOCH_BITS
EPOCH_BITS = 8


def epoch_group_bits(epoch: int) -> str:
    """The group bits of the gradient round that ends ``epoch``."""
    return format(epoch % (1 << EPOCH_BITS), f"0{EPOCH_BITS}b")


def _load_epoch(data: bytes) -> Any:
    try:
        return deserialize(data)
    except Exception:
        return None


class AsyncGradientRounds:
    """Runs the gradient rounds of one ``AsyncOptimizer`` (see the module docstring)."""

    def __init__(
        self,
        averager: AsyncDecentralizedAverager,
        buffers: GradientAverager,
        *,
        run_id: str,
        matchmaking_time: float,
        averaging_timeout: float,
        status_loglevel: int,
        health: Any = None,
        swarm_epoch: Callable[[], int] | None = None,
        peer_epochs: Callable[[], Collection[int]] | None = None,
        torch_work: TorchWork | None = None,
    ):
        self.averager, self.buffers = averager, buffers
        self.run_id = run_id
        self.matchmaking_time = matchmaking_time
        self.averaging_timeout = averaging_timeout
        self.status_loglevel = status_loglevel
        self.health = health
        self.swarm_epoch = swarm_epoch
        self.peer_epochs = peer_epochs  #: the epochs the other peers present published
        self.torch_work = torch_work or TorchWork()  #: loads the buffers (``_torch_work``)
        self.scheduled: StepControl | None = None
        self.averaged = 0  #: rounds that averaged with a group
        self.alone = 0  #: epochs that used the local gradients
        self.last_group_size = 0

    def expected_group_size(self, num_peers: int, epoch: int | None = None) -> int | None:
        """Peers to expect in the round that ends ``epoch`` (``_epoch_sync.expected_round_size``):
        ``num_peers`` (present, counting us) or the last group's size, if larger; before a round
        succeeded, one more than the peers seen in ``epoch`` (a hold, never an early assembly on
        a count that may still grow)."""
        return expected_round_size(num_peers, self.last_group_size, epoch, self._other_epochs())

    @staticmethod
    def _usable(control: StepControl | None) -> bool:
        return control is not None and not (control.triggered or control.done())

    def _start(self, epoch: int, num_peers: int) -> StepControl:
        return self.averager.start_step(
            gather=epoch,
            timeout=self.averaging_timeout,
            require_trigger=True,
            expected_group_size=self.expected_group_size(num_peers, epoch),
            group_bits=epoch_group_bits(epoch),
        )

    @property
    def needs_schedule(self) -> bool:
        """Whether :meth:`maybe_schedule` would start matchmaking (no usable round yet)."""
        return not self._usable(self.scheduled)

    def maybe_schedule(self, seconds_left: float, epoch: int, num_peers: int) -> None:
        """Start matchmaking for the round that ends ``epoch`` unless one is scheduled."""
        if self._usable(self.scheduled):
            return
        logger.log(
            self.status_loglevel,
            "%s: pre-scheduling gradient averaging (epoch ends in %.2f s)",
            self.run_id,
            max(0.0, seconds_left),
        )
        try:
            self.scheduled = self._start(epoch, num_peers)
        except Exception as e:  # e.g. the averager stopped: the epoch end starts a round
            logger.warning("%s: could not pre-schedule gradient averaging: %r", self.run_id, e)
            self.scheduled = None

    async def _load_local(self) -> None:
        def load() -> None:
            self.buffers.load_accumulators_into_averager_()
            self.buffers.reset_accumulated_grads_()

        await self.torch_work.run(load)

    async def begin(
        self, weight: float | None, others_seen: bool, epoch: int, num_peers: int
    ) -> StepControl | None:
        """Load the accumulators into the averaged buffers (then reset them) and let the round
        that ends ``epoch`` run; None when no round runs (the buffers hold the local mean)."""
        control, self.scheduled = self.scheduled, None
        if control is not None and not self._usable(control):
            logger.log(self.status_loglevel, "%s: dropping a used or failed round", self.run_id)
            control = None
        if control is not None and _load_epoch(control.data_for_gather) != epoch:
            control.cancel()
            control = None
        if not others_seen:
            if control is not None:
                control.cancel()
            await self._load_local()
            return None
        try:
            if control is None:
                control = self._start(epoch, num_peers)
            buffers = self.buffers

            def load() -> float:
                buffers.load_accumulators_into_averager_()
                samples = float(buffers.local_samples_accumulated)
                buffers.reset_accumulated_grads_()
                return samples

            samples = await self.torch_work.run(load)
            control.weight = samples if weight is None else weight
        except Exception as e:
            logger.warning(
                "%s: could not start gradient averaging (%r): using the local gradients",
                self.run_id,
                e,
            )
            if control is not None:
                control.cancel()
            await self._load_local()
            return None
        except BaseException:
            if control is not None:
                control.cancel()
            raise
        control.allow_allreduce()
        return control

    async def finish(
        self,
        control: StepControl | None,
        others_seen: bool = True,
        epoch: int | None = None,
        *,
        peers_moved_on: bool = False,
    ) -> dict | None:
        """Wait for the round :meth:`begin` started: the group's ``{peer_id: epoch}``, or None
        if it did not average (the buffers then hold the local mean gradient: all-reduce only
        adds deltas when it completes). ``peers_moved_on``: the round's peers entered the next
        epoch before waiting for it (delayed updates), so the swarm is one epoch past ``epoch``
        while the round still runs."""
        if control is None:
            self.alone += 1
            return None
        try:
            left_at = None if epoch is None else epoch + int(peers_moved_on)
            gathered = await self._wait(control, epoch, left_at)
        except Exception as e:
            control.cancel()
            self.alone += 1
            if self.health is not None:
                self.health.observe_averaging_failure(e)
            logger.log(
                logging.WARNING if others_seen else self.status_loglevel,
                "%s: averaging gradients failed (%r): using the local gradients",
                self.run_id,
                e,
            )
            return None
        except BaseException:
            control.cancel()
            raise
        self.averaged += 1
        self.last_group_size = len(gathered)
        if self.health is not None:
            self.health.observe_averaging_success()
        logger.log(
            self.status_loglevel, "%s: averaged gradients with %d peers", self.run_id, len(gathered)
        )
        return gathered

    async def _wait(self, control: StepControl, epoch: int | None, left_at: int | None) -> Any:
        """The round's result; a round still looking for a group after the swarm went past
        ``left_at`` (the last epoch in which its peers may still run it) is given up after
        ``left_behind_grace`` (at once when no other peer present is in its epoch any more)."""
        swarm_epoch = self.swarm_epoch
        begun_after_left = (
            left_at is not None and swarm_epoch is not None and swarm_epoch() > left_at
        )
        moved_on_at: float | None = None
        with trio.move_on_after(self.averaging_timeout) as waited:
            while True:
                with trio.move_on_after(_POLL_INTERVAL):
                    return await control.wait_result()
                left_behind = (
                    left_at is not None
                    and swarm_epoch is not None
                    and control.stage == AveragingStage.LOOKING_FOR_GROUP
                    and swarm_epoch() > left_at
                )
                if not left_behind:
                    moved_on_at = None
                    continue
                assert left_at is not None and epoch is not None
                now = trio.current_time()
                moved_on_at = now if moved_on_at is None else moved_on_at
                grace = left_behind_grace(
                    self.matchmaking_time, epoch, left_at, self._other_epochs(), begun_after_left
                )
                if now - moved_on_at >= grace:
                    raise TimeoutError(f"the swarm moved past epoch {epoch} without this peer")
        assert waited.cancelled_caught
        raise TimeoutError(f"no result within averaging_timeout={self.averaging_timeout} s")

    def _other_epochs(self) -> Collection[int] | None:
        if self.peer_epochs is None:
            return None
        try:
            return self.peer_epochs()
        except Exception:  # e.g. the tracker closed meanwhile: as if unknown
            return None

    async def tag_along(self) -> None:
        """Leave the scheduled round without disrupting its group: weight 0 if its group is
        already assembled, else cancel it."""
        control, self.scheduled = self.scheduled, None
        if control is None or control.done():
            return
        if control.triggered or control.stage != AveragingStage.AWAITING_TRIGGER:
            control.cancel()
            return
        try:
            control.weight = 0.0
            control.allow_allreduce()
            with trio.fail_after(self.averaging_timeout):
                await control.wait_result()
            logger.log(self.status_loglevel, "%s: tagged along with weight 0", self.run_id)
        except Exception as e:
            control.cancel()
            logger.log(self.status_loglevel, "%s: tagging along failed: %r", self.run_id, e)
        except BaseException:
            control.cancel()
            raise

    def cancel(self) -> None:
        control, self.scheduled = self.scheduled, None
        if control is not None:
            control.cancel()
