"""The ``swarmtrain`` command: the training demo runs real peer processes that learn together,
stops cleanly on Ctrl+C and fails loudly; the RPC demo really talks; ``node`` stops on SIGINT."""

import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from swarmtrain.cli.main import main
from swarmtrain.cli.progress_display import PeerView, ProgressDisplay
from swarmtrain.cli.rpc_demo import run_demo


@pytest.mark.trio
async def test_demo_peers_find_each_other_and_talk():
    lines = []
    summary = await run_demo(3, out=lines.append)
    assert summary == {"calls": 6, "streamed": 5}
    assert any("peer 2 -> peer 1" in line for line in lines)


def test_node_prints_its_addresses_and_stops_on_ctrl_c(tmp_path):
    key = tmp_path / "node.key"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmtrain.cli.main",
            "node",
            "--host_maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--identity_path",
            str(key),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            output.append(line)
            if "/p2p/" in line:
                break
        assert any("/ip4/127.0.0.1/tcp/" in line for line in output), output
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, "".join(output) + rest
        assert "shutting down" in rest
        assert oct(os.stat(key).st_mode & 0o777) == "0o600"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def demo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmtrain.cli.main", "demo", *args]


def peer_pids(parent_pid: int) -> dict[int, int]:
    """Live demo peers of the demo run by ``parent_pid``: {peer index: pid} (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "swarmtrain.cli.demo_peer" in argv and f"demo{parent_pid}" in argv:
            found[int(argv[argv.index("--index") + 1])] = int(entry)
    return found


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    output = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        if marker in line:
            return output
    raise AssertionError(f"no {marker!r} in time:\n" + "".join(output))


def test_training_demo_peers_learn_together_and_agree():
    result = subprocess.run(
        demo_command("--peers", "2", "--epochs", "3", "--target-batch-size", "128"),
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "epoch 1/3" in out and "epoch 3/3" in out  # plain lines: stdout is not a TTY
    assert "\x1b[" not in out
    loss = re.search(r"eval loss ([\d.]+) -> ([\d.]+)", out)
    assert loss and float(loss[2]) < float(loss[1]), out
    assert "peers agree: all at epoch 3" in out, out


@contextmanager
def running_demo(*args: str) -> Iterator[subprocess.Popen]:
    """``swarmtrain demo`` in a process (stdout and stderr together); killed if still running."""
    proc = subprocess.Popen(
        demo_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_training_demo_stops_cleanly_on_ctrl_c():
    with running_demo("--peers", "2", "--epochs", "1000") as proc:
        read_until(proc, "epoch 1/1000", timeout=90)
        assert len(peer_pids(proc.pid)) == 2
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=40)
        assert proc.returncode == 130, rest
        assert "stopped; no peer is left running" in rest
        assert "Traceback" not in rest
        assert peer_pids(proc.pid) == {}


def test_training_demo_fails_when_a_peer_dies():
    with running_demo("--peers", "2", "--epochs", "1000") as proc:
        read_until(proc, "epoch 1/1000", timeout=90)
        os.kill(peer_pids(proc.pid)[1], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=40)
        assert proc.returncode == 1, rest
        assert "FAILED: peer 1 exited with code -9" in rest, rest
        assert peer_pids(proc.pid) == {}


def test_demo_rejects_bad_options():
    with pytest.raises(SystemExit) as raised:
        main(["demo", "--peers", "0"])
    assert "--peers must be between 1 and 16" in str(raised.value.code)


def test_progress_display_redraws_on_a_terminal_and_prints_epoch_lines_otherwise():
    peers = [PeerView(), PeerView()]
    for peer in peers:
        peer.epoch, peer.samples = 1, 128
        peer.history.append((1, 1.5, 0.5))
    live, plain = io.StringIO(), io.StringIO()
    live_display = ProgressDisplay(live, live=True, target=256, epochs=3)
    live_display.update(peers, force=True)
    live_display.update(peers, force=True)
    assert live.getvalue().count("\x1b[4F\x1b[J") == 1  # the second draw replaces the first
    assert "peer  epoch  train loss" in live.getvalue()
    ProgressDisplay(plain, live=False, target=256, epochs=3).update(peers)
    assert plain.getvalue().startswith("epoch 1/3  eval loss 1.500  accuracy 50.0%")
    assert "\x1b[" not in plain.getvalue()
