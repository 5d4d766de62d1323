"""The ``swarmtrain`` command: the demo really runs peers; ``node`` stops cleanly on SIGINT."""

import os
import signal
import subprocess
import sys
import time

import pytest

from swarmtrain.cli.demo import run_demo


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
