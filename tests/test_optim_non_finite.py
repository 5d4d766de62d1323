"""NaN never travels: a peer whose gradients or state hold NaN sends nothing (real peers)."""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarmtrain.dht import DHT
from swarmtrain.optim import Optimizer
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FEATURES, BATCH, TARGET = 8, 4, 32

_generator = torch.Generator().manual_seed(0)
X = torch.randn(300, FEATURES, generator=_generator)
Y = X @ torch.randn(FEATURES, 1, generator=_generator)


@pytest.fixture
def two_dhts():
    first = DHT([], **HOST)
    second = DHT(first.get_visible_maddrs(), **HOST)
    yield first, second
    second.shutdown()
    first.shutdown()
    assert BackgroundRuntime.active_references() == 0


def train(opt: Optimizer, model: torch.nn.Module, epochs: int, poison_at: int | None = None):
    """Train until ``epochs``; with ``poison_at``, that batch's inputs are NaN."""
    stop = time.monotonic() + 60
    step = 0
    while opt.local_epoch < epochs:
        assert time.monotonic() < stop, f"stuck at epoch {opt.local_epoch}"
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
        inputs = X[rows].clone()
        if step == poison_at:
            inputs[0, 0] = math.nan
        torch.nn.functional.mse_loss(model(inputs), Y[rows]).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        time.sleep(0.02)


def test_one_peers_nan_gradients_never_reach_the_other_peer(two_dhts, caplog):
    caplog.set_level(logging.WARNING)
    models, opts = [], []
    for dht in two_dhts:
        torch.manual_seed(0)
        model = torch.nn.Linear(FEATURES, 1)
        models.append(model)
        opts.append(
            Optimizer(
                dht=dht,
                run_id="nan_run",
                target_batch_size=TARGET,
                batch_size_per_step=BATCH,
                params=model.parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                matchmaking_time=1.0,
                averaging_timeout=10.0,
                load_state_timeout=10.0,
                delay_state_averaging=False,
                tracker_opts={"gossip_period": 0.1, "min_refresh_period": 0.2},
            )
        )
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(train, opts[0], models[0], 4),
                pool.submit(train, opts[1], models[1], 4, poison_at=TARGET // BATCH + 2),
            ]
            for future in futures:
                future.result(timeout=90)
        assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())
        assert not all(bool(torch.isfinite(p).all()) for p in models[1].parameters())
        assert opts[0].epochs_averaged >= 1  # they did average before the NaN
        skipped = [r for r in caplog.records if "skips all-reduce" in r.getMessage()]
        assert skipped and all(r.levelno == logging.WARNING for r in skipped)
    finally:
        for opt in opts:
            opt.shutdown()
