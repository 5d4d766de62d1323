"""The monitor's checkpoints of the shared state: schedule and retention (pure), a real donor
averager on loopback (then a donor with another state), and a real ``swarmtrain monitor``
subprocess saving checkpoints with bounded retention."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import trio
from polling import wait_until
from swarm_util import FAST, FAST_DHT, open_dhts

from swarmtrain.averaging import DecentralizedAverager
from swarmtrain.dht import DHT
from swarmtrain.monitor.checkpoints import (
    CheckpointSchedule,
    checkpoint_loop,
    checkpoints_to_delete,
)

# ---------------------------------------------------------------- pure


def test_the_schedule_waits_every_interval_and_retries_sooner():
    schedule = CheckpointSchedule(every=600.0)
    assert schedule.due(0.0) == 0.0
    schedule.attempted(0.0, saved=True)
    assert schedule.due(1.0) == 599.0
    schedule.attempted(600.0, saved=False)
    assert schedule.due(600.0) == 30.0
    with pytest.raises(ValueError):
        CheckpointSchedule(every=math.nan)


def test_retention_deletes_only_the_oldest_checkpoints():
    names = [f"state_{t:013d}.pt" for t in (30, 10, 20, 40)]
    names += ["notes.txt", "state_0000000000050.pt.partial", "state_x.pt"]
    assert checkpoints_to_delete(names, keep=2) == [
        "state_0000000000010.pt",
        "state_0000000000020.pt",
    ]
    assert checkpoints_to_delete(names, keep=10) == []
    with pytest.raises(ValueError):
        checkpoints_to_delete(names, keep=0)


# ---------------------------------------------------------------- real peers


def honest_state() -> list[torch.Tensor]:
    return [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.full((5,), 2.0)]


@pytest.mark.trio
async def test_the_monitor_saves_the_shared_state_and_refuses_another_shape(tmp_path):
    """A donor averager shares its state; the monitor (a client that serves nothing) saves it
    every 0.2 s and keeps the newest two. The donor leaves and a donor with a state of another
    shape takes its place: nothing it sends is saved."""
    async with open_dhts(3) as (monitor_dht, donor_dht, other_dht):
        async with trio.open_nursery() as nursery:
            async with DecentralizedAverager.create(
                honest_state(), donor_dht, prefix="run_state_averager", **FAST
            ):
                loop = await nursery.start(
                    lambda task_status: checkpoint_loop(
                        monitor_dht,
                        "run",
                        str(tmp_path),
                        every=0.2,
                        keep=2,
                        download_timeout=10.0,
                        task_status=task_status,
                    )
                )
                with trio.fail_after(30):
                    await wait_until(lambda: loop.saved >= 3)
            files = sorted(os.listdir(tmp_path / "run"))
            assert len(files) == 2 and all(f.endswith(".pt") for f in files)
            saved = torch.load(tmp_path / "run" / files[-1], weights_only=False)
            assert saved["run_id"] == "run" and saved["prefix"] == "run_state_averager"
            for got, expected in zip(saved["tensors"], honest_state(), strict=True):
                assert torch.equal(got, expected)
            before = loop.saved, loop.failed
            other = [torch.zeros(1000, 1000)]  # another model, 1000x the size
            async with DecentralizedAverager.create(
                other, other_dht, prefix="run_state_averager", **FAST
            ):
                with trio.fail_after(30):
                    await wait_until(lambda: loop.failed >= before[1] + 2)
            assert loop.saved == before[0]
            assert loop.rejected_donors == {other_dht.peer_id.to_base58()}
            for name in os.listdir(tmp_path / "run"):
                tensors = torch.load(tmp_path / "run" / name, weights_only=False)["tensors"]
                assert [t.shape for t in tensors] == [t.shape for t in honest_state()]
            nursery.cancel_scope.cancel()


def test_the_monitor_command_saves_checkpoints_with_bounded_retention(tmp_path):
    donor_dht = DHT(**FAST_DHT)
    donor = DecentralizedAverager(honest_state(), donor_dht, prefix="ckpt_state_averager", **FAST)
    proc = None
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmtrain.cli.main",
                "monitor",
                "--initial_peers",
                donor_dht.get_visible_maddrs()[0],
                "--run_id",
                "ckpt",
                "--port",
                "0",
                "--checkpoint_dir",
                str(tmp_path),
                "--checkpoint_every",
                "0.3",
                "--checkpoint_keep",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline, saved, output = time.monotonic() + 60, [], []
        while len(saved) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            output.append(line)
            if line.startswith("saved checkpoint "):
                saved.append(line.split(" ", 2)[2].strip())
        assert len(saved) == 3, output
        files = sorted(os.listdir(tmp_path / "ckpt"))
        assert len(files) <= 2 and os.path.basename(saved[-1]) in files
        tensors = torch.load(saved[-1], weights_only=False)["tensors"]
        assert torch.equal(tensors[0], honest_state()[0])
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, rest
        donor.shutdown()
        donor_dht.shutdown()
