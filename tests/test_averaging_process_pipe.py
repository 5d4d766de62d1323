"""``HelperPipe``: the trainer's end of a helper process's pipe, over a real pipe whose other
end the test plays (no process: the helper's side is ``_process_child``, tested with
``ProcessAverager`` in ``test_averaging_process_averager.py``)."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest

from swarmtrain.averaging.control import AveragingStage
from swarmtrain.averaging.process_pipe import HelperPipe, HelperProcessError

pytestmark = pytest.mark.timeout(30)
WAIT = 10.0  # seconds any answer may take (a thread hop on a busy box)


class Step:
    """Collects a step's reports (as ``ProcessStepControl`` does)."""

    def __init__(self, step_id: int):
        self._step_id = step_id
        self.stages: list[Any] = []
        self.done = threading.Event()
        self.result: tuple[bool, Any] | None = None

    def _on_stage(self, stage: Any) -> None:
        self.stages.append(stage)

    def _finish(self, ok: bool, value: Any) -> None:
        self.result = (ok, value)
        self.done.set()


@pytest.fixture
def pipes():
    """A reading ``HelperPipe`` and the helper's end of its connection."""
    ours, helper = multiprocessing.Pipe(duplex=True)
    pipe = HelperPipe(ours, lambda what: f"the test's helper {what} (exit code 7)")
    helper.send(("ready", {"peer_id": b"me"}))
    assert pipe.wait_ready(WAIT) == {"peer_id": b"me"}
    pipe.start_reading()
    yield pipe, helper
    pipe.begin_shutdown()  # the helper's end closing below is then no failure to log
    helper.close()
    pipe.close()


def test_calls_get_their_own_answers_and_errors_keep_their_type(pipes):
    pipe, helper = pipes
    first, second = pipe.send("get", "banned_peers"), pipe.send("call", "get_group_bits", ())
    (id1, op1, args1), (id2, op2, args2) = helper.recv(), helper.recv()
    assert (op1, args1, op2, args2) == ("get", ("banned_peers",), "call", ("get_group_bits", ()))
    helper.send(("reply", id2, False, KeyError("no bits")))  # answers may come in any order
    helper.send(("reply", id1, True, frozenset()))
    assert first.result(WAIT) == frozenset()
    with pytest.raises(KeyError, match="no bits"):
        second.result(WAIT)


def test_a_call_that_gets_no_answer_times_out_and_a_later_call_still_works(pipes):
    pipe, helper = pipes
    with pytest.raises(TimeoutError, match=r"did not answer 'get' within 0\.1 s"):
        pipe.call("get", "steps_started", timeout=0.1)
    helper.recv()  # the unanswered call
    answer = pipe.send("get", "steps_started")
    call_id, _, _ = helper.recv()
    helper.send(("reply", call_id, True, 3))
    assert answer.result(WAIT) == 3


def test_a_step_gets_its_stages_and_its_end_and_a_forgotten_step_gets_nothing(pipes):
    pipe, helper = pipes
    step, forgotten = Step(0), Step(1)
    pipe.send("start_step", 0, {}, step=step)
    pipe.send("start_step", 1, {}, step=forgotten)
    pipe.forget_step(1)
    helper.send(("step_stage", 0, AveragingStage.LOOKING_FOR_GROUP))
    helper.send(("step_stage", 1, AveragingStage.LOOKING_FOR_GROUP))
    helper.send(("step_done", 1, True, {"x": 1}))
    helper.send(("step_done", 0, True, {"y": 2}))
    assert step.done.wait(WAIT)
    assert step.stages == [AveragingStage.LOOKING_FOR_GROUP] and step.result == (True, {"y": 2})
    assert forgotten.stages == [] and forgotten.result is None  # (handled before step 0's end)


def test_when_the_helper_goes_everything_waiting_and_every_later_call_fails_with_its_exit(
    pipes,
):
    pipe, helper = pipes
    waiting, step = pipe.send("get", "banned_peers"), Step(0)
    pipe.send("start_step", 0, {}, step=step)
    helper.send(("failed", MemoryError("out of memory")))  # what a dying helper reports
    helper.close()
    with pytest.raises(HelperProcessError, match="exited \\(exit code 7\\): MemoryError") as e:
        waiting.result(WAIT)
    assert isinstance(e.value.__cause__, MemoryError)
    assert step.done.wait(WAIT) and step.result == (False, e.value)
    assert pipe.gone is e.value
    with pytest.raises(HelperProcessError):
        pipe.send("get", "banned_peers")


def test_after_shutdown_begins_only_shutdown_goes_out_and_the_end_is_no_failure(pipes):
    pipe, helper = pipes
    waiting = pipe.send("get", "banned_peers")
    pipe.begin_shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pipe.send("get", "banned_peers")
    shutdown = pipe.send("shutdown")
    helper.recv()
    call_id, op, _ = helper.recv()
    assert op == "shutdown"
    helper.send(("reply", call_id, True, None))
    assert shutdown.result(WAIT) is None
    helper.close()
    with pytest.raises(RuntimeError, match="the averager was shut down"):
        waiting.result(WAIT)
    assert not isinstance(pipe.gone, HelperProcessError)


def test_a_helper_that_fails_to_start_raises_its_own_error():
    ours, helper = multiprocessing.Pipe(duplex=True)
    pipe = HelperPipe(ours, lambda what: f"helper {what}")
    helper.send(("failed", ValueError("bad prefix")))
    with pytest.raises(ValueError, match="bad prefix"):
        pipe.wait_ready(WAIT)
    helper.close()
    with pytest.raises(HelperProcessError, match="helper died while starting"):
        pipe.wait_ready(WAIT)
    pipe.close()


def test_a_helper_that_stays_silent_fails_the_start_after_its_timeout():
    ours, helper = multiprocessing.Pipe(duplex=True)
    pipe = HelperPipe(ours, lambda what: f"helper {what}")
    with pytest.raises(HelperProcessError, match=r"did not start within 0\.05 s"):
        pipe.wait_ready(0.05)
    helper.close()
    pipe.close()
