"""An asyncio trainer: ``DHT.aio_create``, ``Optimizer.aio_create`` and ``await opt.aio.step()``
with two real peers on loopback, while a ticker task watches the asyncio loop.

The loop-lag assertion is structural, not a latency bound: the ticker must keep running
*during* the longest ``aio.step`` call (an epoch end, with its averaging round), and no single
stall may last as long as that call. A blocking ``opt.step()`` on the loop fails both.
asyncio tests use anyio's plugin (asyncio backend); this module does not use pytest-trio.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarmtrain.dht import DHT
from swarmtrain.optim import Optimizer
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FEATURES, BATCH, TARGET, EPOCHS = 8, 4, 32, 2
FAST = {
    "matchmaking_time": 1.0,
    "averaging_timeout": 15.0,
    "load_state_timeout": 15.0,
    "tracker_opts": {"gossip_period": 0.1, "min_refresh_period": 0.2},
}
TICK = 0.005

_generator = torch.Generator().manual_seed(0)
X = torch.randn(256, FEATURES, generator=_generator)
Y = X @ torch.randn(FEATURES, 1, generator=_generator)


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Ticker:
    """Wakes every ``TICK`` s and records (wake-up time, lateness)."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            self.ticks.append((now, now - start - TICK))

    def during(self, start: float, end: float) -> list[float]:
        return [lag for woke, lag in self.ticks if start <= woke <= end]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


async def train(
    opt: Optimizer, model: torch.nn.Module, index: int, calls: list[tuple[float, float]]
) -> None:
    shard = torch.arange(index, len(X), 2)
    position = 0
    while opt.local_epoch < EPOCHS:
        rows = shard[position % len(shard) : position % len(shard) + BATCH]
        position += BATCH
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X[rows]), Y[rows])
        loss.backward()
        started = time.perf_counter()
        await opt.aio.step()
        calls.append((started, time.perf_counter()))
        await asyncio.sleep(0.01)


async def start_two_peers(
    run_id: str, models: list[torch.nn.Module], dhts: list[DHT], opts: list[Optimizer]
) -> None:
    """Two DHTs and Optimizers made from asyncio, appended to ``dhts`` and ``opts`` as they
    start (so that the caller shuts down whatever started)."""
    dhts.append(await DHT.aio_create(**HOST))
    dhts.append(await DHT.aio_create(dhts[0].get_visible_maddrs(), **HOST))
    for dht, model in zip(dhts, models, strict=True):
        opts.append(
            await Optimizer.aio_create(
                dht=dht,
                run_id=run_id,
                target_batch_size=TARGET,
                batch_size_per_step=BATCH,
                params=model.parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                **FAST,
            )
        )


@pytest.mark.anyio
async def test_two_asyncio_peers_train_through_aio_without_blocking_the_loop():
    ticker = Ticker()
    ticking = asyncio.create_task(ticker.run())
    dhts: list[DHT] = []
    opts: list[Optimizer] = []
    models = [make_model(), make_model()]
    try:
        created = time.perf_counter()
        await start_two_peers("aio_regression", models, dhts, opts)
        startup = (created, time.perf_counter())
        seen = await asyncio.gather(*(opt.aio.wait_for_peers(2, timeout=20) for opt in opts))
        assert seen == [2, 2]

        calls: list[list[tuple[float, float]]] = [[], []]
        await asyncio.wait_for(
            asyncio.gather(*(train(opts[i], models[i], i, calls[i]) for i in range(2))), 90
        )
        assert [opt.local_epoch for opt in opts] >= [EPOCHS, EPOCHS]
        if opts[0].local_epoch == opts[1].local_epoch:  # averaged gradients, same start
            for a, b in zip(*(model.parameters() for model in models), strict=True):
                assert torch.allclose(a, b, atol=1e-5)

        # the loop went on while the peers started (seconds) and during the longest step
        for start, end in [
            startup,
            max((c for cs in calls for c in cs), key=lambda c: c[1] - c[0]),
        ]:
            lags = ticker.during(start, end)
            assert len(lags) >= 2, f"the loop did not run during a {end - start:.2f} s call"
            assert max(lags) < end - start
    finally:
        for opt in opts:
            await opt.aio.shutdown()
        for dht in reversed(dhts):
            await asyncio.to_thread(dht.shutdown)
        ticking.cancel()
    assert BackgroundRuntime.active_references() == 0


async def _until(condition, timeout: float, what: str) -> None:
    """asyncio: poll ``condition`` (no event to wait on: another thread's state)."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 (a lock of another thread: no event)
            await asyncio.sleep(0.01)
    assert condition(), what


@pytest.mark.anyio
async def test_a_cancelled_aio_step_finishes_on_the_loop_and_frees_the_optimizer():
    """A trainer task cancelled while ``aio.step`` waits for an epoch end (an averaging round)
    does not cut the step short: the epoch ends without another call, the optimizer is free
    again, and both peers go on to agree exactly."""
    dhts: list[DHT] = []
    opts: list[Optimizer] = []
    models = [make_model(), make_model()]
    try:
        await start_two_peers("aio_cancel", models, dhts, opts)
        assert await asyncio.gather(*(o.aio.wait_for_peers(2, timeout=20) for o in opts)) == [2, 2]
        other = asyncio.create_task(train(opts[1], models[1], 1, []))
        opt, model = opts[0], models[0]
        ended_by_a_cancelled_call = None
        for position in range(0, 40 * BATCH, BATCH):
            rows = torch.arange(0, len(X), 2)[position % 128 : position % 128 + BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X[rows]), Y[rows]).backward()
            epoch = opt.local_epoch
            try:
                await asyncio.wait_for(opt.aio.step(), 0.02)
                continue
            except TimeoutError:
                pass
            # cancelled while its loop part ran: that part goes on and then frees the facade
            await _until(lambda: not opt._calls.locked(), 30, "the optimizer is free again")
            if opt.local_epoch > epoch:
                ended_by_a_cancelled_call = epoch
                break
        assert ended_by_a_cancelled_call is not None, "no call was cancelled at an epoch end"
        await train(opt, model, 0, [])
        await asyncio.wait_for(other, 60)
        # a final synchronous state round of both peers
        groups = await asyncio.gather(*(asyncio.to_thread(o.average_state) for o in opts))
        assert all(group is not None and len(group) == 2 for group in groups), groups
        for a, b in zip(*(m.parameters() for m in models), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    finally:
        for o in opts:
            await o.aio.shutdown()
        for dht in reversed(dhts):
            await asyncio.to_thread(dht.shutdown)
    assert BackgroundRuntime.active_references() == 0
