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


def node_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmtrain.cli.main", "node", *args]


def test_node_prints_dialable_addresses_and_reports_its_tables():
    proc = subprocess.Popen(
        node_command("--refresh_period", "1"),  # default: all interfaces
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    joiner = None
    try:
        output = read_until(proc, "all addresses of this node:", timeout=60)
        join_line = next(line for line in output if line.startswith("others can join with:"))
        join_address = join_line.split("--initial_peers ")[1].strip()
        assert join_address.startswith("/ip4/") and "/p2p/" in join_address
        assert "0.0.0.0" not in join_address
        listed = read_until(proc, "/ip4/127.0.0.1/", timeout=10)  # loopback is listed last
        assert not any("0.0.0.0" in line for line in listed), listed
        from swarmtrain.dht import DHT

        joiner = DHT(initial_peers=[join_address])  # another process dials the printed address
        status = read_until(proc, "1 peers in the routing table", timeout=30)[-1]
        assert re.match(r"up \d+ s: 1 peers in the routing table, 1 connected, \d+ records", status)
    finally:
        if joiner is not None:
            joiner.shutdown()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def test_node_on_a_port_in_use_fails_with_one_line():
    first = subprocess.Popen(
        node_command("--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--refresh_period", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = read_until(first, "/ip4/127.0.0.1/tcp/", timeout=60)
        taken = re.search(r"/ip4/127\.0\.0\.1/tcp/\d+", "".join(output))[0]
        second = subprocess.run(
            node_command("--host-maddrs", taken), capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1, second.stdout + second.stderr
        assert second.stderr.strip() == (
            f"swarmtrain node: cannot listen on {taken}: the address is already in use "
            "(another peer or process listens there); stop it, or pick another port "
            "(tcp/0 picks a free one)"
        )
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=30)


def test_version_and_help_without_markup(capsys):
    import swarmtrain
    from swarmtrain.cli.main import build_parser

    with pytest.raises(SystemExit) as raised:
        main(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.strip() == f"swarmtrain {swarmtrain.__version__}"
    assert "``" not in build_parser().format_help()


def subcommand_parsers():
    from swarmtrain.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return {name: sub for name, sub in commands.choices.items() if name != "dht"}


def test_every_option_is_spelled_with_underscores_and_accepts_dashes():
    for command, parser in subcommand_parsers().items():
        for action in parser._actions:
            long_names = [o for o in action.option_strings if o.startswith("--")]
            if not long_names or action.help == "==SUPPRESS==":
                continue
            assert "-" not in long_names[0][2:], (command, long_names)
    from swarmtrain.cli.main import build_parser

    parse = build_parser().parse_args
    assert parse(["demo", "--target-batch-size", "128"]).target_batch_size == 128
    assert parse(["demo", "--target_batch_size", "64"]).target_batch_size == 64
    assert parse(["node", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/x"]).initial_peers == [
        "/ip4/1.2.3.4/tcp/1/p2p/x"
    ]
