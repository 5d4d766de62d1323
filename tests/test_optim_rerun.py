"""A run that ends (its script returns, with or without ``shutdown()``) leaves no record that
steers the next run of the same ``run_id``: its peers publish their departure at exit, and a
fresh run started at once begins at epoch 0 without loading state from the peers that left."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from dead_hosts import silent_port

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


KILLED_RUN_SCRIPT = """
    import logging, sys, time, torch
    import swarmtrain
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("swarmtrain.optim.progress_tracker").setLevel(logging.INFO)
    host = {"use_relay": False, "relay_service": False, "use_autonat": False}
    dht = swarmtrain.DHT([sys.argv[1]], **host)
    print("ADDRS", *dht.get_visible_maddrs(), flush=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = swarmtrain.Optimizer(
        dht=dht, run_id="killed_run", target_batch_size=32, batch_size_per_step=16,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        matchmaking_time=0.5, averaging_timeout=2.0,
    )
    print("START EPOCH", opt.local_epoch, "SWARM EPOCH", opt.global_epoch, flush=True)
    started, epoch, stop_at = time.monotonic(), opt.local_epoch, int(sys.argv[2])
    while opt.local_epoch < stop_at and time.monotonic() < started + 60:
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if opt.local_epoch != epoch:
            epoch = opt.local_epoch
            print("EPOCH", epoch, "after", round(time.monotonic() - started, 2), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no goodbye: only the killed run's test peers get here (after 60 s)
""".replace("import logging,", "import os, logging,")


class PeerProcess:
    """A peer script in its own process; its output lines are read by a thread."""

    def __init__(self, bootstrap: str, epochs: int):
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(KILLED_RUN_SCRIPT), bootstrap, str(epochs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, condition, timeout: float) -> str:
        """The first output line (from now on) for which ``condition(line)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("timed out; output:\n" + "\n".join(self.output)) from None
            if line is None:
                raise AssertionError("the peer exited; output:\n" + "\n".join(self.output))
            self.output.append(line)
            if condition(line):
                return line

    def text(self) -> str:
        self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.output.append(line)
        return "\n".join(self.output)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self._reader.join(timeout=10)
            self.process.stdout.close()


@pytest.mark.timeout(240)  # four peer processes; each starts slowly on a loaded 2-core box
@pytest.mark.parametrize("dead_hosts", ["refuse", "drop"])
def test_a_killed_runs_records_do_not_steer_a_rerun(dead_hosts):
    """A run SIGKILLed (no goodbye) leaves progress records and state offers in the DHT; a rerun
    of its run_id at once on the same bootstrap node starts at epoch 0 and trains at once,
    whether the dead peers' ports refuse connections (loopback) or drop them (a host gone from
    the network: each dial hangs). Before, it took the dead run's epoch, tried to load state
    from the dead peers, and waited ~60 s for their records to expire."""
    bootstrap = DHT(**HOST)  # outlives both runs, as a `swarmtrain node` would
    maddr = str(bootstrap.get_visible_maddrs()[0])
    killed = [PeerProcess(maddr, 10**6) for _ in range(2)]
    traps: list[socket.socket] = []
    rerun = None
    try:
        ports = []
        for peer in killed:
            line = peer.wait_for(lambda line: line.startswith("ADDRS"), timeout=60)
            ports += [int(p) for p in re.findall(r"/ip4/127\.0\.0\.1/tcp/(\d+)", line)]
        for peer in killed:
            peer.wait_for(lambda line: line.startswith("EPOCH") and int(line.split()[1]) >= 3, 60)

        def records_at_epoch_3():
            progress = bootstrap.get("killed_run_progress", latest=True)
            return progress is not None and any(
                item.value is not None and item.value["epoch"] >= 3
                for item in progress.value.values()
            )

        # a tracker stores its record a moment after it enters the epoch: the killed run's
        # records must be in the DHT (as in a real crash) before the kill
        deadline = time.monotonic() + 30
        while not records_at_epoch_3():
            assert time.monotonic() < deadline, "the peers' epoch-3 records never reached the DHT"
            time.sleep(0.1)
        for peer in killed:
            peer.kill()
        if dead_hosts == "drop":
            for port in ports:
                traps += silent_port(port)

        rerun = PeerProcess(maddr, 1)
        rerun.wait_for(lambda line: line.startswith("START"), timeout=60)
        output = rerun.text()
        assert "START EPOCH 0 SWARM EPOCH 0" in output, output
        assert "loading state from peers" not in output, output
        assert "could not load" not in output, output
        assert re.search("ignoring the progress record|no known address for peer", output), output
        took = float(re.search(r"EPOCH 1 after ([0-9.]+)", output).group(1))
        assert took < 10.0, output  # before: ~50-60 s, until the dead peers' records expired
    finally:
        for peer in killed:
            peer.kill()
        if rerun is not None:
            rerun.kill()
        for sock in traps:
            sock.close()
        bootstrap.shutdown()
