"""A run that ends (its script returns, with or without ``shutdown()``) leaves no record that
steers the next run of the same ``run_id``: its peers publish their departure at exit, and a
fresh run started at once begins at epoch 0 without loading state from the peers that left."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swarmtrain.dht import DHT

REPO = Path(__file__).resolve().parents[1]
HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}

PEER_SCRIPT = """
    import logging, sys, torch
    import swarmtrain
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    host = {"use_relay": False, "relay_service": False, "use_autonat": False}
    dht = swarmtrain.DHT([sys.argv[1]], **host)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = swarmtrain.Optimizer(
        dht=dht, run_id="rerun_test", target_batch_size=32, batch_size_per_step=16,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        matchmaking_time=0.5, averaging_timeout=2.0,
    )
    print("START EPOCH", opt.local_epoch, "SWARM EPOCH", opt.global_epoch, flush=True)
    while opt.local_epoch < int(sys.argv[2]):
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    print("END EPOCH", opt.local_epoch, flush=True)
    # the script ends here: no opt.shutdown(), no dht.shutdown()
"""


def run_peer(bootstrap: str, epochs: int) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PEER_SCRIPT), bootstrap, str(epochs)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


TRACKER_SCRIPT = """
    import sys
    from swarmtrain.dht import DHT
    from swarmtrain.optim import ProgressTracker
    host = {"use_relay": False, "relay_service": False, "use_autonat": False}
    dht = DHT([sys.argv[1]], **host)
    tracker = ProgressTracker(dht, "exit_test", 1000)
    tracker.report_local_progress(5, 100)
    print("reported", flush=True)
    # the script ends here: no tracker.shutdown(), no dht.shutdown()
"""


def test_a_script_that_ends_without_shutdown_still_publishes_its_departure():
    bootstrap = DHT(**HOST)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent(TRACKER_SCRIPT),
                bootstrap.get_visible_maddrs()[0],
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0 and "reported" in result.stdout, result.stderr
        found = bootstrap.get("exit_test_progress", latest=True)
        assert found is not None and len(found.value) == 1, found
        assert [item.value for item in found.value.values()] == [None], found
    finally:
        bootstrap.shutdown()


@pytest.mark.slow
def test_a_finished_run_does_not_steer_the_next_run_of_its_run_id():
    bootstrap = DHT(**HOST)  # outlives both runs, as a `swarmtrain node` would
    try:
        first = run_peer(bootstrap.get_visible_maddrs()[0], epochs=4)
        assert "END EPOCH 4" in first, first
        progress = bootstrap.get("rerun_test_progress", latest=True)
        assert progress is not None and progress.value, "the first run published no progress"
        assert all(item.value is None for item in progress.value.values()), progress.value

        second = run_peer(bootstrap.get_visible_maddrs()[0], epochs=1)
        assert "START EPOCH 0 SWARM EPOCH 0" in second, second
        assert "loading state from peers" not in second, second
        assert "could not load state" not in second, second
        assert "END EPOCH 1" in second
    finally:
        bootstrap.shutdown()
