"""The simulation's warm start (``initial_params``) and inner lr schedule, and the quality study."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import pathlib
import sys

import pytest
import torch

from swarmtrain.optim._textdata import stdlib_text
from swarmtrain.optim.diloco_simulation import (
    SimulationConfig,
    TinyTransformer,
    TinyTransformerConfig,
    evaluate,
    run_data_parallel,
    run_diloco,
    warmup_cosine,
)

TINY = TinyTransformerConfig(context=16, d_model=16, n_layers=1, n_heads=2)
CONFIG = SimulationConfig(
    num_workers=2, inner_steps=3, outer_steps=2, batch_size=4, context=16, eval_windows=8
)


def tiny_model() -> TinyTransformer:
    return TinyTransformer(TINY)


@pytest.fixture(scope="module")
def text():
    return stdlib_text(max_bytes=200_000)


@pytest.fixture(scope="module")
def checkpoint(text):
    """A warm start: parameters after a few synchronous steps, different from the fresh init."""
    warm = SimulationConfig(
        num_workers=2, inner_steps=5, outer_steps=1, batch_size=4, context=16, seed=7
    )
    return run_data_parallel(warm, tiny_model, text).params


def test_warmup_cosine_values():
    schedule = warmup_cosine(10, 2, final=0.1)
    values = [schedule(t) for t in range(12)]
    assert values[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert values[9] == pytest.approx(0.1) and values[11] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(values[1:]))  # non-increasing after warm-up
    assert values[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    constant = warmup_cosine(10, 0, final=1.0)
    assert [constant(t) for t in range(10)] == [1.0] * 10


@pytest.mark.parametrize(
    "kwargs", [{"total_steps": 0}, {"warmup_steps": 10}, {"warmup_steps": -1}, {"final": 1.5}]
)
def test_warmup_cosine_rejects_bad_arguments(kwargs):
    arguments = {"total_steps": 10, "warmup_steps": 1, "final": 0.1} | kwargs
    with pytest.raises(ValueError):
        warmup_cosine(**arguments)


def test_zero_lr_schedule_keeps_the_warm_start_exactly(text, checkpoint):
    """lr 0 (weight decay included) leaves both arms at the checkpoint they started from."""
    windows = text.eval_windows(16, 8)
    model = tiny_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), checkpoint, strict=True):
            p.copy_(value)
    start_loss = evaluate(model, windows)
    fresh_loss = evaluate(tiny_model(), windows)
    assert start_loss < fresh_loss - 0.1  # the checkpoint really is warmer than the init

    def frozen(step: int) -> float:
        return 0.0

    sync = run_data_parallel(
        CONFIG, tiny_model, text, initial_params=checkpoint, lr_schedule=frozen
    )
    diloco = run_diloco(CONFIG, tiny_model, text, initial_params=checkpoint, lr_schedule=frozen)
    for result in (sync, diloco):
        assert all(torch.equal(a, b) for a, b in zip(result.params, checkpoint, strict=True))
        assert [loss for _, loss in result.eval_losses] == pytest.approx([start_loss] * 2)


def test_warm_start_and_schedule_change_the_run(text, checkpoint):
    plain = run_diloco(CONFIG, tiny_model, text)
    warm = run_diloco(CONFIG, tiny_model, text, initial_params=checkpoint)
    scheduled = run_diloco(
        CONFIG, tiny_model, text, initial_params=checkpoint, lr_schedule=warmup_cosine(6, 2)
    )
    assert warm.final_eval_loss < plain.final_eval_loss
    assert scheduled.eval_losses != warm.eval_losses
    again = run_diloco(
        CONFIG, tiny_model, text, initial_params=checkpoint, lr_schedule=warmup_cosine(6, 2)
    )
    assert again.eval_losses == scheduled.eval_losses  # still deterministic


def test_lr_schedule_scales_every_step_of_the_baseline(text):
    """A schedule of 0.5 is the same run as half the lr."""
    sgd = functools.partial(torch.optim.SGD, lr=0.2)
    half = functools.partial(torch.optim.SGD, lr=0.1)
    scheduled = run_data_parallel(
        CONFIG, tiny_model, text, optimizer=sgd, lr_schedule=lambda s: 0.5
    )
    direct = run_data_parallel(CONFIG, tiny_model, text, optimizer=half)
    assert all(torch.allclose(a, b) for a, b in zip(scheduled.params, direct.params, strict=True))


def test_bad_initial_params_and_schedule_are_rejected(text, checkpoint):
    with pytest.raises(ValueError, match="tensors"):
        run_diloco(CONFIG, tiny_model, text, initial_params=checkpoint[:-1])
    wrong = [torch.zeros(3), *checkpoint[1:]]
    with pytest.raises(ValueError, match="shape"):
        run_data_parallel(CONFIG, tiny_model, text, initial_params=wrong)
    with pytest.raises(ValueError, match="lr_schedule"):
        run_data_parallel(CONFIG, tiny_model, text, lr_schedule=lambda s: float("nan"))


def test_quality_study_runs_end_to_end(capsys, monkeypatch):
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "_diloco_quality.py"
    spec = importlib.util.spec_from_file_location("_diloco_quality", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_diloco_quality", module)  # for its dataclasses
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        module.main(
            "--d-model 16 --layers 1 --heads 2 --context 16 --workers 2 --batch-size 4 "
            "--warm-steps 4 --steps 4 --H 2,4 --baseline-lrs 1e-3,4e-3 --inner-lrs 4e-3 "
            "--outer 0.7:0.9 --codecs fp16 --eval-windows 8 --max-bytes 200000".split()
        )
    finally:
        torch.set_num_threads(threads)  # the study pins its process to one thread
    out = capsys.readouterr().out
    assert "| 0.001 |" in out and "| 0.004 |" in out  # both baseline lrs
    assert "| 4 | 0.004 | 0.7 | 0.9 |" in out  # DiLoCo H4 row
    assert "4x |" in out and "8x |" in out  # fp32 H4: 4x fewer bytes; fp16: 8x
    with pytest.raises(SystemExit):
        module.main(["--steps", "5", "--H", "2"])
