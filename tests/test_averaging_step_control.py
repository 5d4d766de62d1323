"""``StepControl``'s per-attempt accounting: a step whose first group failed and whose retry
averaged counts both attempts, and the bytes of the failed one apart (no network: the
averager's calls, in its order)."""

from __future__ import annotations

import math

import pytest

from swarmtrain.averaging.control import AveragingStage, StepControl


def _control() -> StepControl:
    return StepControl(
        scheduled_time=0.0,
        deadline=math.inf,
        allow_retries=True,
        weight=1.0,
        gather=b"",
        require_trigger=False,
    )


@pytest.mark.trio
async def test_a_failed_attempt_then_a_successful_one_are_counted_apart():
    control = _control()
    assert (control.attempts, control.failed_attempts) == (0, 0)
    assert control.bytes_sent == control.failed_bytes_sent == (0, 0)

    control._begin_allreduce()  # first group: its all-reduce ran, then failed
    assert control.stage is AveragingStage.RUNNING_ALLREDUCE
    control._count_bytes(1952, 100)
    control._attempt_failed()
    control._begin_allreduce()  # the retry's group averaged
    control._count_bytes(40384, 2000)
    control._finish({"gathered": 1})

    assert (control.attempts, control.failed_attempts) == (2, 1)
    assert control.bytes_sent == (1952 + 40384, 100 + 2000)
    assert control.failed_bytes_sent == (1952, 100)
    assert await control.wait_result() == {"gathered": 1}


@pytest.mark.trio
async def test_an_attempt_that_failed_before_its_bytes_were_counted_adds_no_bytes():
    control = _control()
    control._begin_allreduce()  # the all-reduce raised (a timeout): nothing was counted
    control._attempt_failed()
    control._begin_allreduce()
    control._count_bytes(10, 20)
    assert (control.attempts, control.failed_attempts) == (2, 1)
    assert control.bytes_sent == (10, 20) and control.failed_bytes_sent == (0, 0)
