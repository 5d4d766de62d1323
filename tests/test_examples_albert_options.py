"""The ALBERT example's options around its long work: progress (bars or two log lines) for
preprocessing and checkpoints, and the monitor's optional hub upload (no network here: only
that the flag is parsed and that a missing ``huggingface_hub`` is a clear usage error)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from swarmtrain.utils.progress import set_progress_bars

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_examples import load  # noqa: E402

monitor = load(ROOT / "examples" / "albert" / "run_training_monitor.py")
data = monitor.trainer_script.data


@pytest.fixture(autouse=True)
def no_bars():
    previous = set_progress_bars(False)
    yield
    set_progress_bars(previous)


def test_the_hub_upload_is_off_unless_a_repo_is_given():
    parser = monitor.build_parser()
    assert parser.parse_args([]).hub_repo_id is None
    args = parser.parse_args(["--hub_repo_id", "someone/albert-swarm", "--progress_bars", "on"])
    assert args.hub_repo_id == "someone/albert-swarm"
    assert args.progress_bars == "on"
    with pytest.raises(SystemExit):
        parser.parse_args(["--progress_bars", "sometimes"])


def test_a_hub_upload_without_huggingface_hub_is_a_clear_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(monitor.HubUploadUnavailable, match="pip install huggingface_hub"):
        monitor.hub_api()
    with pytest.raises(SystemExit) as exit_info:  # before any DHT or model is made
        monitor.main(["--hub_repo_id", "someone/albert-swarm"])
    assert exit_info.value.code == 2
    assert "--hub_repo_id needs the huggingface_hub package" in capsys.readouterr().err


def _messages(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_a_checkpoint_logs_its_start_and_its_size(tmp_path, caplog, capsys):
    config = transformers.AlbertConfig(
        vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.AlbertForPreTraining(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="albert.monitor"):
        path = monitor.save_checkpoint(model, opt, str(tmp_path), 3)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "optimizer.pt"]
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    started, done = _messages(caplog, "albert.monitor")
    assert started == f"saving the swarm's state at epoch 3 to {path}: started"
    assert done.startswith(f"saving the swarm's state at epoch 3 to {path}: done ")
    assert f"done {size / 1024:.1f} KiB in " in done, done
    assert capsys.readouterr().err == ""  # no bar


def test_preprocessing_logs_two_lines_without_a_bar(caplog, capsys):
    documents = data.stdlib_documents(3)
    tokenizer = data.train_tokenizer(documents, 200)
    with caplog.at_level(logging.INFO, logger="albert.data"):
        examples = data.pretraining_examples(documents, tokenizer, 32)
    assert examples
    started, done = _messages(caplog, "albert.data")
    assert started == f"preprocessing: started ({len(documents)} documents)"
    assert done.startswith(f"preprocessing: done {len(documents)} documents in ")
    assert capsys.readouterr().err == ""
