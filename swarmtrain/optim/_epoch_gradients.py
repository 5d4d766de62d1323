"""The gradient round of ``Optimizer``'s epochs: pre-scheduled matchmaking, start and finish.

``GradientRounds`` owns at most one pre-scheduled ``StepControl`` of the gradient averager:

- :meth:`maybe_schedule` starts matchmaking once the swarm is expected to reach
  ``target_batch_size`` within ``matchmaking_time`` (the tracker's ETA; ``EpochCore`` decides
  when), so that the group is assembled while the peers still compute (hivemind's
  pre-scheduling);
- :meth:`begin` loads the accumulated gradients into the averaged buffers, resets the
  accumulators and lets all-reduce run in that control (or in a new one); alone, it only
  loads the local mean gradient;
- :meth:`finish` waits for the round: afterwards the averaged buffers hold the group's mean
  gradient, or the local mean gradient if the round failed (logged);
- after the first successful round, every round tells matchmaking how many peers to expect
  (the tracker's count, or the last group's size if larger: auxiliary peers publish no
  progress), so a leader assembles as soon as they are all in instead of waiting out
  ``matchmaking_time``;
- every round matches under group bits made from its epoch (``epoch_group_bits``), so a late
  peer still finishing epoch ``e`` never averages with peers already in ``e + 1``'s round;
- :meth:`tag_along` lets a scheduled round whose group is already assembled run with weight 0
  (so the others are not disrupted), and cancels one that is still looking for a group.

Thread safety: :meth:`finish` may run in the state averager's worker thread (delayed gradient
averaging); every other method runs in the trainer's thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from swarmtrain.averaging import StepControl
from swarmtrain.averaging.control import AveragingStage
from swarmtrain.dht import deserialize

__all__ = ["GradientRounds"]

logger = logging.getLogger(__name__)


_POLL_INTERVAL = 0.1  # seconds between looks at the swarm's epoch while a round runs
_LATE_START_GRACE = 0.3  # how long a round started after the swarm left its epoch may look

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


class GradientRounds:
    """Runs the gradient rounds of one ``Optimizer`` (see the module docstring)."""

    def __init__(
        self,
        grad_averager: Any,
        *,
        run_id: str,
        matchmaking_time: float,
        averaging_timeout: float,
        status_loglevel: int,
        health: Any = None,
        swarm_epoch: Callable[[], int] | None = None,
    ):
        self.averager = grad_averager
        self.run_id = run_id
        self.matchmaking_time = matchmaking_time
        self.averaging_timeout = averaging_timeout
        self.status_loglevel = status_loglevel
        self.health = health  # a SwarmHealth fed with each round's outcome (optional)
        self.swarm_epoch = swarm_epoch  # the swarm's epoch (the tracker's), optional
        self.scheduled: StepControl | None = None
        self.averaged = 0  #: rounds that averaged with a group
        self.alone = 0  #: epochs that used the local gradients
        self.last_group_size = 0  #: members of the last group we averaged with

    def expected_group_size(self, num_peers: int) -> int | None:
        """Peers to expect in a round: ``num_peers`` (present, counting us) or the last group's
        size, if larger (auxiliary peers are not counted by the tracker). None (no early
        assembly) until a round succeeded: at start-up the trackers' counts still grow, and a
        leader that assembled on a low count would leave the late peers out of step."""
        if not self.last_group_size:
            return None
        return max(num_peers, self.last_group_size)

    def _usable(self, control: StepControl | None) -> bool:
        return control is not None and not (control.triggered or control.done())

    def maybe_schedule(self, seconds_left: float, epoch: int, num_peers: int) -> None:
        """Start matchmaking for the round that ends ``epoch`` (in ``seconds_left``; the epoch
        core decided it is time) unless a usable round is scheduled already (``num_peers``:
        peers present, counting us)."""
        if self._usable(self.scheduled):
            return
        logger.log(
            self.status_loglevel,
            "%s: pre-scheduling gradient averaging (epoch ends in %.2f s)",
            self.run_id,
            max(0.0, seconds_left),
        )
        try:
            self.scheduled = self.averager.schedule_step(
                gather=epoch,
                timeout=self.averaging_timeout,
                expected_group_size=self.expected_group_size(num_peers),
                group_bits=epoch_group_bits(epoch),
            )
        except Exception as e:  # e.g. the averager stopped: the epoch update starts a round
            logger.warning("%s: could not pre-schedule gradient averaging: %r", self.run_id, e)
            self.scheduled = None

    def begin(
        self, weight: float | None, others_seen: bool, epoch: int, num_peers: int
    ) -> StepControl | None:
        """Load the accumulators into the averaged buffers (then reset them) and start the
        round that ends ``epoch`` with ``weight`` (None: the samples accumulated). None when no
        round runs: the buffers then hold the local mean gradient. ``num_peers``: peers
        present, counting us."""
        control, self.scheduled = self.scheduled, None
        if control is not None and not self._usable(control):
            logger.log(self.status_loglevel, "%s: dropping a used or failed round", self.run_id)
            control = None
        if control is not None and _load_epoch(control.data_for_gather) != epoch:
            control.cancel()  # scheduled in an epoch we left since (e.g. by loading state)
            control = None
        if not others_seen:
            if control is not None:
                control.cancel()
            self._load_local()
            return None
        try:
            extra: dict[str, Any] = {}
            if control is None:
                expected = self.expected_group_size(num_peers)
                extra = {
                    "gather": epoch,
                    "expected_group_size": expected,
                    "group_bits": epoch_group_bits(epoch),
                }
            return self.averager.step(
                weight=weight,
                control=control,
                reset_accumulators=True,
                wait=False,
                timeout=self.averaging_timeout,
                **extra,
            )
        except Exception as e:
            logger.warning(
                "%s: could not start gradient averaging (%r): using the local gradients",
                self.run_id,
                e,
            )
            if control is not None:
                control.cancel()
            self._load_local()
            return None

    def _load_local(self) -> None:
        self.averager.load_accumulators_into_averager_()
        self.averager.reset_accumulated_grads_()

    def finish(
        self, control: StepControl | None, others_seen: bool = True, epoch: int | None = None
    ) -> dict | None:
        """Wait for the round started by :meth:`begin` for ``epoch``: the group's
        ``{peer_id: epoch}``, or None if it did not average (no round, or it failed). A round
        still looking for a group ``matchmaking_time`` after the swarm went past ``epoch`` is
        given up (the others averaged without us: a late peer steps on its own gradients
        rather than wait out ``averaging_timeout``)."""
        if control is None:
            self.alone += 1
            return None
        try:
            gathered = self._wait(control, epoch)
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
        self.averaged += 1
        self.last_group_size = len(gathered)
        if self.health is not None:
            self.health.observe_averaging_success()
        logger.log(
            self.status_loglevel, "%s: averaged gradients with %d peers", self.run_id, len(gathered)
        )
        return gathered

    def _wait(self, control: StepControl, epoch: int | None) -> Any:
        deadline = time.monotonic() + self.averaging_timeout
        moved_on_at = None  # when we saw the swarm past ``epoch`` while still looking
        # Started after the swarm had already left ``epoch``: only a peer as late as us could
        # still be looking, so wait briefly. (Waiting matchmaking_time here locked a late peer
        # and the others, who waited for it in their next round, one epoch apart: each epoch
        # took matchmaking_time until something broke the symmetry.)
        grace = self.matchmaking_time
        if epoch is not None and self.swarm_epoch is not None and self.swarm_epoch() > epoch:
            grace = min(grace, _LATE_START_GRACE)
        while True:
            remaining = deadline - time.monotonic()
            try:
                return control.result(max(0.0, min(_POLL_INTERVAL, remaining)))
            except concurrent.futures.TimeoutError:
                if remaining <= _POLL_INTERVAL:
                    raise TimeoutError(
                        f"no result within averaging_timeout={self.averaging_timeout} s"
                    ) from None
            if (
                epoch is not None
                and self.swarm_epoch is not None
                and control.stage == AveragingStage.LOOKING_FOR_GROUP
                and self.swarm_epoch() > epoch
            ):
                # after a grace of matchmaking_time: peers whose own rounds failed (e.g. over
                # a model mismatch) move on too, and then our round should fail by itself
                now = time.monotonic()
                moved_on_at = now if moved_on_at is None else moved_on_at
                if now - moved_on_at >= grace:
                    raise TimeoutError(f"the swarm moved past epoch {epoch} without this peer")
            else:
                moved_on_at = None

    def tag_along(self) -> None:
        """Leave the scheduled round without disrupting its group (see the module docstring)."""
        control, self.scheduled = self.scheduled, None
        if control is None or control.done():
            return
        if control.triggered or control.stage != AveragingStage.AWAITING_TRIGGER:
            control.cancel()
            return
        try:
            control.weight = 0.0
            control.allow_allreduce()
            control.result(self.averaging_timeout)
            logger.log(self.status_loglevel, "%s: tagged along with weight 0", self.run_id)
        except Exception as e:
            control.cancel()
            logger.log(self.status_loglevel, "%s: tagging along failed: %r", self.run_id, e)

    def cancel(self) -> None:
        """Cancel the scheduled round, if any."""
        control, self.scheduled = self.scheduled, None
        if control is not None:
            control.cancel()
