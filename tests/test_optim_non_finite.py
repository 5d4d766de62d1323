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


def train(
    opt: Optimizer,
    model: torch.nn.Module,
    epochs: int,
    poison_at: int | None = None,
    zero_grad: bool = True,
):
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
        if zero_grad:
            opt.zero_grad()
        step += 1
        time.sleep(0.02)


MODES = {
    "default": {},
    "local_updates": {"use_local_updates": True},
    "reuse_grad_buffers": {"reuse_grad_buffers": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_one_peers_nan_gradients_never_reach_the_other_peer(two_dhts, caplog, mode):
    """A batch whose gradients hold NaN is dropped with a warning by the peer that computed it
    (no GradScaler needed), so neither peer's parameters ever become NaN."""
    caplog.set_level(logging.WARNING)
    models, opts = [], []
    for dht in two_dhts:
        torch.manual_seed(0)
        model = torch.nn.Linear(FEATURES, 1)
        models.append(model)
        opts.append(
            Optimizer(
                dht=dht,
                run_id=f"nan_run_{mode}",
                target_batch_size=TARGET,
                batch_size_per_step=BATCH,
                params=model.parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                matchmaking_time=1.0,
                averaging_timeout=10.0,
                load_state_timeout=10.0,
                delay_state_averaging=False,
                tracker_opts={"gossip_period": 0.1, "min_refresh_period": 0.2},
                **MODES[mode],
            )
        )
    zero_grad = mode != "reuse_grad_buffers"
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(train, opts[0], models[0], 4, zero_grad=zero_grad),
                pool.submit(train, opts[1], models[1], 4, TARGET // BATCH + 2, zero_grad=zero_grad),
            ]
            for future in futures:
                future.result(timeout=90)
        for model in models:
            assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        assert (opts[0].skipped_batches, opts[1].skipped_batches) == (0, 1)
        dropped = [r for r in caplog.records if "hold NaN or inf" in r.getMessage()]
        assert len(dropped) == 1 and dropped[0].levelno == logging.WARNING
    finally:
        for opt in opts:
            opt.shutdown()
