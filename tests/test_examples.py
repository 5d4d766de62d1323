"""The examples run: quickstart peers train in lockstep and improve."""

import importlib.util
from pathlib import Path

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
