"""ProcessAverager: the swarm in a helper process, between real peers on loopback (no mocks).

Each test that starts a helper spawns a process that imports torch and libp2p (seconds on a
loaded box), so there are few of them and each checks a whole path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from polling import wait_for

from swarmtrain.averaging import (
    AveragingStage,
    DecentralizedAverager,
    FailureReason,
    MatchmakingError,
)
from swarmtrain.averaging.process_averager import HelperProcessError, ProcessAverager
from swarmtrain.dht import DHT
from swarmtrain.p2p import AddressInUseError
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {"min_matchmaking_time": 1.0, "request_timeout": 0.5}
SHAPES = [(16, 16), (50,)]
pytestmark = pytest.mark.timeout(240)


def random_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in SHAPES]


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not reaped yet) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].startswith("Z")


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (R running, S sleeping, T stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0]


def test_gpu_or_meta_tensors_are_refused_before_any_process_starts():
    with pytest.raises(TypeError, match="CPU tensors"):
        ProcessAverager([torch.zeros(3, device="meta")], prefix="p", start=False)
    averager = ProcessAverager([torch.zeros(3)], prefix="p", start=False)
    assert averager.pid is None and not averager.is_alive()
    with pytest.raises(RuntimeError, match="not running"):
        averager.get_group_bits()
    averager.shutdown()


def test_a_helper_process_peer_averages_with_an_in_process_peer():
    dht = DHT(**HOST)
    mine, theirs = random_tensors(1), random_tensors(2)
    want = [(x + y) / 2 for x, y in zip(mine, theirs, strict=True)]
    local = DecentralizedAverager(theirs, dht, prefix="proc", **FAST)
    shared = [t.clone() for t in mine]
    helper = ProcessAverager(shared, dht, prefix="proc", **FAST)
    pid = helper.pid
    try:
        assert helper.is_alive() and pid != os.getpid()
        assert helper.peer_id != dht.peer_id  # the helper runs a host of its own
        assert helper.schema_hash == local.schema_hash
        assert all(t.is_shared() for t in shared)  # moved in place: the same tensor objects

        results: list = [None]
        thread = threading.Thread(target=lambda: results.__setitem__(0, local.step(timeout=30)))
        thread.start()
        gathered = helper.step(gather={"rank": 1}, timeout=30)
        thread.join(60)
        assert gathered == {helper.peer_id: {"rank": 1}, local.peer_id: None}
        assert results[0] == gathered
        with helper.get_tensors() as tensors:
            assert tensors[0] is shared[0]
            for got, expected in zip(tensors, want, strict=True):
                torch.testing.assert_close(got, expected)
        parts, deltas = helper.bytes_sent
        assert parts > 0 and deltas > 0

        # a triggered step, driven from the trainer's side of the pipe
        control = helper.step(wait=False, require_trigger=True, expected_group_size=2, timeout=30)
        other = local.step(wait=False, expected_group_size=2, timeout=30)
        wait_for(lambda: control.stage == AveragingStage.AWAITING_TRIGGER, 30, "the trigger wait")
        control.allow_allreduce()
        assert control.result(30) == {helper.peer_id: None, local.peer_id: None}
        other.result(30)
        assert control.stage == AveragingStage.FINISHED

        # errors from the helper keep their type and reason
        with pytest.raises(MatchmakingError) as info:
            helper.step(timeout=1.5)  # nobody else steps
        # (DEADLINE while the other peer's last declaration is still in the DHT)
        assert info.value.reason in (FailureReason.TOO_FEW_PEERS, FailureReason.DEADLINE)
        assert info.value.detail in str(info.value)
        cancelled = helper.step(wait=False, timeout=30)
        assert cancelled.cancel()
        with pytest.raises(ValueError, match="wait=False"):
            helper.step(require_trigger=True)

        # asyncio: the same step as an awaitable
        async def aio_step():
            other = asyncio.get_running_loop().run_in_executor(None, lambda: local.step(timeout=30))
            mine = await helper.aio.step(gather="aio", timeout=30)
            await other
            return mine

        assert asyncio.run(aio_step()) == {helper.peer_id: "aio", local.peer_id: None}

        helper.set_group_bits("")
        assert helper.get_group_bits() == ""
        helper.state_sharing_priority = 3.0
        assert helper.state_sharing_priority == 3.0 and helper.allow_state_sharing
        assert helper.banned_peers == frozenset()
        metadata, state = helper.get_current_state()
        assert metadata == {"group_bits": ""} and state[0] is not shared[0]
        torch.testing.assert_close(state[1], want[1])
        loaded = helper.load_state_from_peers(timeout=10)
        assert loaded is not None
        torch.testing.assert_close(loaded[1][1], want[1])
    finally:
        helper.shutdown()
        local.shutdown()
        dht.shutdown()
    assert not helper.is_alive()
    assert helper._process.exitcode == 0  # left the swarm and exited by itself
    assert process_gone(pid)
    with pytest.raises(RuntimeError, match="shut down"):
        helper.get_group_bits()
    assert BackgroundRuntime.active_references() == 0


def test_a_loop_starts_and_drives_a_step_without_waiting_for_the_helper():
    """What a trio loop calls (``start_step``, the weight before the trigger, the trigger, the
    stage) sends without waiting for an answer: all of it returns while the helper is stopped
    (SIGSTOP; a call that waited would time out after ``call_timeout``), and once it runs
    again the helper applies them in order (the weight reaches the average)."""
    dht = DHT(**HOST)
    mine, theirs = random_tensors(3), random_tensors(4)
    want = [(2 * x + y) / 3 for x, y in zip(mine, theirs, strict=True)]
    local = DecentralizedAverager(theirs, dht, prefix="nowait", **FAST)
    helper = ProcessAverager(mine, dht, prefix="nowait", call_timeout=5.0, **FAST)
    try:
        refused = helper.start_step(timeout=-1.0)  # the helper's ValueError fails the step
        with pytest.raises(ValueError, match="timeout must be positive"):
            refused.result(30)
        os.kill(helper.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: process_state(helper.pid) == "T", 10, "the helper to stop")
            control = helper.start_step(require_trigger=True, expected_group_size=2, timeout=30)
            assert control.stage == AveragingStage.IDLE  # nothing reported yet
            control.weight = 2.0
            control.allow_allreduce()
            assert control.triggered and control.weight == 2.0 and not control.done()
            assert process_state(helper.pid) == "T"  # still stopped: nothing waited for it
        finally:
            os.kill(helper.pid, signal.SIGCONT)
        other = local.step(wait=False, expected_group_size=2, timeout=30)
        assert control.result(30) == {helper.peer_id: None, local.peer_id: None}
        other.result(30)
        with helper.get_tensors() as tensors:
            for got, expected in zip(tensors, want, strict=True):
                torch.testing.assert_close(got, expected)
    finally:
        helper.shutdown()
        local.shutdown()
        dht.shutdown()


def test_a_crashed_helper_fails_waiting_steps_and_calls_with_a_clear_error():
    tensors = [torch.ones(10)]
    helper = ProcessAverager(tensors, prefix="crash", dht_kwargs=HOST, **FAST)
    try:
        control = helper.step(wait=False, timeout=60)  # alone: waits for a group
        helper._crash_helper_for_tests(exit_code=7)
        with pytest.raises(HelperProcessError, match=r"pid \d+\) exited \(exit code 7\)"):
            control.result(30)
        assert not helper.is_alive()
        with pytest.raises(HelperProcessError, match="exit code 7"):
            helper.get_group_bits()
        with helper.get_tensors() as local:  # the tensors are still ours
            assert local[0].sum().item() == 10
    finally:
        helper.shutdown()


def test_a_helper_that_cannot_start_raises_its_error_in_the_trainer():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUseError):
            ProcessAverager(
                [torch.ones(4)],
                prefix="bad",
                dht_kwargs={**HOST, "host_maddrs": [f"/ip4/127.0.0.1/tcp/{port}"]},
                **FAST,
            )


TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from swarmtrain.averaging.process_averager import ProcessAverager
    if __name__ == "__main__":
        helper = ProcessAverager(
            [torch.ones(4)], prefix="orphan", dht_kwargs={dht_kwargs!r}, min_matchmaking_time=1.0,
            request_timeout=0.5,
        )
        print(helper.pid, flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
        # "exit": the script ends without shutdown(): swarmtrain shuts the helper down at exit
    """
)


@pytest.mark.parametrize("how", ["killed", "exits without shutdown"])
def test_no_helper_outlives_its_trainer(tmp_path, how):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(dht_kwargs=HOST))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    mode = "hang" if how == "killed" else "exit"
    trainer = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, env=env)
    try:
        line = trainer.stdout.readline()
        assert line, "the trainer failed to start its helper"
        helper_pid = int(line)
        if how == "killed":
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(30)
        else:
            assert trainer.wait(60) == 0
        wait_for(lambda: process_gone(helper_pid), 60, "the helper's exit")
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
