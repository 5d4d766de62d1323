"""What a DiLoCo optimizer records: its statistics (``DiLoCoStatistics``, one
``RoundStatistics`` per finished round), a round in flight (``PendingRound``) and what an inner
step leaves to do on the loop (``StepPlan``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarmtrain.averaging import StepControl
from swarmtrain.optim.diloco_core import ApplyOuter

__all__ = ["DiLoCoStatistics", "PendingRound", "RoundStatistics", "StepPlan", "round_statistics"]


@dataclass(frozen=True)
class RoundStatistics:
    """One finished round of one fragment.

    :param fragment: the fragment it synced
    :param start_step: the inner step at which it started
    :param group_size: peers (us included) whose average was applied; 1: we stepped alone
    :param attempts: all-reduce attempts (a group that failed and another one found within
      the round's deadline make two); 0: no all-reduce ran
    :param failed_attempts: of them, the attempts that failed
    :param bytes_sent_as_sender: parts we sent in this round, failed attempts included
    :param bytes_sent_as_reducer: averaged parts we returned, failed attempts included
    :param failed_bytes_as_sender: of ``bytes_sent_as_sender``, those of failed attempts
    :param failed_bytes_as_reducer: of ``bytes_sent_as_reducer``, those of failed attempts
    """

    fragment: int
    start_step: int
    group_size: int
    attempts: int = 0
    failed_attempts: int = 0
    bytes_sent_as_sender: int = 0
    bytes_sent_as_reducer: int = 0
    failed_bytes_as_sender: int = 0
    failed_bytes_as_reducer: int = 0


@dataclass(frozen=True)
class DiLoCoStatistics:
    """What one peer's optimizer has done so far.

    :param inner_step: inner steps counted since the start of the run (adopted from the donor
      by :meth:`~AsyncDiLoCoOptimizer.load_state_from_peers`)
    :param outer_step: outer updates applied to the shared parameters (likewise); with F
      fragments each fragment's update counts once, so F per H inner steps
    :param rounds_averaged: rounds (of any fragment) in which we averaged with another peer
    :param rounds_alone: rounds that failed, in which we applied our own pseudo-gradient
    :param last_group_size: peers (us included) in the last round; 1 if it failed
    :param bytes_sent: pseudo-gradient payload we sent, ``bytes_sent_as_sender +
      bytes_sent_as_reducer``
    :param bytes_sent_as_sender: payload of the parts we sent to other reducers (framing
      excluded), in every all-reduce attempt, failed ones included
    :param bytes_sent_as_reducer: payload of the averaged parts we returned to other senders
      (likewise)
    :param seconds_waiting: wall time ``step()`` spent waiting for averaging results
    :param states_caught_up: times we fell a round behind the others and loaded their state
      to rejoin their rounds
    :param allreduce_attempts: all-reduce attempts over all rounds (see
      :class:`RoundStatistics`)
    :param failed_allreduce_attempts: of them, those that failed (the round retried or
      stepped alone)
    :param failed_bytes_as_sender: of ``bytes_sent_as_sender``, those of failed attempts
    :param failed_bytes_as_reducer: of ``bytes_sent_as_reducer``, those of failed attempts
    :param last_round: the last finished round (None before the first)
    """

    inner_step: int
    outer_step: int
    rounds_averaged: int
    rounds_alone: int
    last_group_size: int
    bytes_sent: int
    bytes_sent_as_sender: int
    bytes_sent_as_reducer: int
    seconds_waiting: float
    states_caught_up: int = 0
    allreduce_attempts: int = 0
    failed_allreduce_attempts: int = 0
    failed_bytes_as_sender: int = 0
    failed_bytes_as_reducer: int = 0
    last_round: RoundStatistics | None = None


@dataclass
class PendingRound:
    """A round of one fragment whose sync started and whose result is not applied yet."""

    fragment: int
    round: int
    start_step: int
    weight: float
    local_pseudo_gradient: list[torch.Tensor]
    fingerprint: list[float]  # of the fragment's shared parameters the round started from
    outer_step: int
    control: StepControl | None = None
    others: int = 0  # other peers of the run present at launch


@dataclass
class StepPlan:
    """What an inner step left to do on the loop: rounds to launch, rounds to apply."""

    started: list[PendingRound] = field(default_factory=list)
    apply: list[ApplyOuter] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.started or self.apply)


def round_statistics(pending: PendingRound, group_size: int) -> RoundStatistics:
    control = pending.control
    if control is None:
        return RoundStatistics(pending.fragment, pending.start_step, group_size)
    return RoundStatistics(
        pending.fragment,
        pending.start_step,
        group_size,
        attempts=control.attempts,
        failed_attempts=control.failed_attempts,
        bytes_sent_as_sender=control.bytes_sent[0],
        bytes_sent_as_reducer=control.bytes_sent[1],
        failed_bytes_as_sender=control.failed_bytes_sent[0],
        failed_bytes_as_reducer=control.failed_bytes_sent[1],
    )
