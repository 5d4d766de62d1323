"""The examples run: quickstart peers train in lockstep and improve, as threads of one process
or one process per peer; examples use only public modules."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_peers_train_in_lockstep():
    quickstart = load(ROOT / "examples" / "quickstart" / "train.py")
    results = quickstart.main(["--peers", "2", "--epochs", "3"])
    first, second = results[0], results[1]
    assert [epoch for epoch, _, _ in first] == [1, 2, 3]
    final_a, final_b = first[-1], second[-1]
    assert abs(final_a[1] - final_b[1]) < 1e-3  # same weights on both peers
    assert first[-1][1] < first[0][1]  # eval loss falls


def test_trio_quickstart_peers_train_in_lockstep():
    quickstart = load(ROOT / "examples" / "quickstart" / "train_trio.py")
    results = quickstart.main(["--peers", "2", "--epochs", "3", "--target_batch_size", "128"])
    first, second = results[0], results[1]
    assert [epoch for epoch, _, _ in first] == [1, 2, 3]
    assert abs(first[-1][1] - second[-1][1]) < 1e-3  # same weights on both peers
    assert first[-1][1] < first[0][1]  # eval loss falls


def quickstart_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "quickstart" / "train.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_quickstart_one_process_per_peer_joins_with_the_printed_command():
    common = ["--peers", "2", "--epochs", "3"]
    first = quickstart_process("--first_peer", *common)
    joiner = None
    try:
        lines = [first.stdout.readline(), first.stdout.readline()]
        assert lines[0].strip() == "join this swarm with:", lines
        command = lines[1].split()
        assert command[:3] == ["python", "examples/quickstart/train.py", "--initial_peers"]
        joiner = quickstart_process(*command[2:], *common)
        outputs = [proc.communicate(timeout=90)[0] for proc in (first, joiner)]
    finally:
        for proc in (first, joiner):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode == 0 and joiner.returncode == 0, outputs
    epochs = [re.findall(r"epoch (\d) +eval loss ([\d.]+)", out) for out in outputs]
    assert [e for e, _ in epochs[0]] == ["1", "2", "3"], outputs
    assert epochs[0] == epochs[1], outputs  # one swarm: the same weights, epoch by epoch
    assert "2 peer(s) in the swarm" in outputs[1]


def test_examples_import_no_private_modules():
    for script in (ROOT / "examples").rglob("*.py"):
        for line in script.read_text().splitlines():
            if line.startswith(("import ", "from ")):
                module = line.split()[1]
                private = [p for p in module.split(".") if p.startswith("_") and p != "__future__"]
                assert not private, (script, line)


def test_example_help_keeps_the_docstrings_layout():
    for script in ("quickstart/train.py", "diloco/train_lm.py"):
        result = subprocess.run(
            [sys.executable, str(ROOT / "examples" / script), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert result.returncode == 0, result.stderr
        assert "\n    python examples/" in result.stdout, result.stdout  # indented commands kept


ALBERT_TINY = [
    "--lockstep",
    "--max_files", "6",
    "--vocab_size", "400",
    "--seq_len", "32",
    "--target_batch_size", "32",
    "--per_device_train_batch_size", "8",
    "--learning_rate", "3e-3",
    "--warmup_epochs", "1",
    "--max_epochs", "4",
    "--matchmaking_time", "1.0",
    "--averaging_timeout", "15",
    "--wait_for_peers", "2",
]  # fmt: skip


def test_albert_recipe_two_peers_learn_and_agree(tmp_path):
    pytest.importorskip("transformers")  # the hf extra; CI installs it (.ci/run)
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from swarmtrain.dht import DHT

    albert = load(ROOT / "examples" / "albert" / "run_trainer.py")
    monitor = load(ROOT / "examples" / "albert" / "run_training_monitor.py")
    host = {"use_relay": False, "relay_service": False, "use_autonat": False}
    first = DHT(**host)
    second = DHT(first.get_visible_maddrs(), **host)
    third = DHT(first.get_visible_maddrs(), **host)
    checkpoints = tmp_path / "checkpoints"
    monitor_args = ["--save_every", "1", "--max_checkpoints", "1", "--max_seconds", "60"]
    monitor_args += ["--refresh_period", "0.2", "--checkpoint_dir", str(checkpoints)]
    # after training, the second peer downloads the first's state while the first still
    # serves it: whatever rounds failed on the way (logged), both then hold the swarm's state
    trained, synchronised = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)
    loaded: dict[int, bool] = {}

    def synchronise(index: int):
        def on_trained(opt) -> None:
            trained.wait()
            try:
                if index == 1:
                    loaded[index] = opt.load_state_from_peers(timeout=30)
            finally:
                synchronised.wait()

        return on_trained

    try:
        with ThreadPoolExecutor(3) as pool:
            saved = pool.submit(monitor.main, [*ALBERT_TINY, *monitor_args], third)
            futures = [
                pool.submit(
                    albert.main,
                    [*ALBERT_TINY, "--output_dir", str(tmp_path / str(i)), "--seed", str(i)],
                    dht,
                    synchronise(i),
                )
                for i, dht in enumerate((first, second))
            ]
            results = [f.result(timeout=100) for f in futures]
            saved = saved.result(timeout=100)
    finally:
        third.shutdown()
        second.shutdown()
        first.shutdown()
    assert [r["epoch"] for r in results] == [4, 4]
    # the monitor followed the run and saved a checkpoint of the swarm's state
    assert len(saved) == 1 and (Path(saved[0]) / "optimizer.pt").exists(), saved
    assert torch.load(Path(saved[0]) / "optimizer.pt")["swarmtrain_local_epoch"] >= 1
    for result in results:
        losses = [loss for _, loss in result["epoch_losses"]]
        assert result["finite"] and len(losses) >= 3, result["epoch_losses"]
        assert losses[-1] < losses[0], result["epoch_losses"]  # the loss falls
    assert loaded == {1: True}
    pairs = zip(*(r["model"].parameters() for r in results), strict=True)
    # the state travels in fp16 (state_averaging_compression): the downloaded parameters are
    # the donor's within an fp16 rounding (2**-11)
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-4, rtol=2**-10)
