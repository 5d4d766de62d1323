"""The trio ``Optimizer`` (``async with Optimizer.create(...)``, ``AsyncOptimizer``): real peers on
loopback, each a trio task of one test run, training a regression with ``await opt.step()``.

No background loop thread is involved (``BackgroundRuntime`` stays unused), and the loop is
never blocked by the optimizer's tensor work: a thread holding the optimizer's lock makes a
step wait, and the loop keeps running meanwhile.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time

import pytest
import torch
import trio
from swarm_util import open_dhts
from test_optim_optimizer import BATCH, FAST, FEATURES, X, Y, full_loss, make_model, params_of

from swarmtrain.averaging.state_checks import RejectReason
from swarmtrain.optim import (
    AsyncOptimizer,
    GradScaler,
    Optimizer,
    PowerSGDGradientAverager,
    ProcessGradientAverager,
)
from swarmtrain.utils.background import BackgroundRuntime

TARGET = 48


def max_gap(states: list[list[torch.Tensor]]) -> float:
    """The largest difference between the first state and any other, over all values."""
    return max(
        (a - b).abs().max().item()
        for state in states[1:]
        for a, b in zip(states[0], state, strict=True)
    )


def options(model: torch.nn.Module, **opts) -> dict:
    return {
        "run_id": "trio_regression",
        "target_batch_size": TARGET,
        "batch_size_per_step": BATCH,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
        "params": model.parameters(),
        **FAST,
        **opts,
    }


class Trainer:
    """One peer's model, its shard, and what it saw at each epoch."""

    def __init__(self, index: int, peers: int, model: torch.nn.Module | None = None) -> None:
        self.model = make_model() if model is None else model
        self.shard = torch.arange(index, len(X), peers)
        self.position = 0
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.partners = 0  #: round partners the tracker knew at the end of training
        self.final_group: dict | None = None  #: the group of train_together's final sync

    def backward(self) -> None:
        rows = self.shard[self.position : self.position + BATCH]
        self.position = (self.position + BATCH) % (len(self.shard) - BATCH)
        torch.nn.functional.mse_loss(self.model(X[rows]), Y[rows]).backward()

    async def train_until(self, opt: AsyncOptimizer, epoch: int, pause: float = 0.02) -> None:
        while opt.local_epoch < epoch:
            before = opt.local_epoch
            self.backward()
            await opt.step()
            opt.zero_grad()
            if opt.local_epoch != before:
                self.snapshots[opt.local_epoch] = params_of(self.model)
            await trio.sleep(pause)  # the trainer's own compute, elsewhere


async def train_together(
    trainers: list[Trainer],
    dhts,
    epochs: int,
    pause: float = 0.02,
    final_sync: bool = False,
    **opts,
) -> list:
    """Each trainer in its own task with its own optimizer; the optimizers after training.
    ``final_sync``: once all have trained, one state round of all of them (its group in
    ``trainer.final_group``)."""
    opts_seen: list = [None] * len(trainers)

    async def run(i: int) -> None:
        async with Optimizer.create(dht=dhts[i], **options(trainers[i].model, **opts)) as opt:
            opts_seen[i] = opt
            await opt.wait_for_peers(len(trainers), timeout=10)
            await trainers[i].train_until(opt, epochs, pause)
            await opt.wait_for_delayed_updates()
            trainers[i].partners = opt.tracker.statistics().live_partners
            trained[i].set()
            if final_sync:
                for event in trained:
                    await event.wait()
                trainers[i].final_group = await opt.average_state()
            ready[i].set()
            for event in ready:  # stay in the swarm until everyone is done
                await event.wait()

    ready = [trio.Event() for _ in trainers]
    trained = [trio.Event() for _ in trainers]
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            for i in range(len(trainers)):
                nursery.start_soon(run, i)
    return opts_seen


@pytest.mark.trio
async def test_three_trio_peers_average_gradients_and_agree():
    async with open_dhts(3) as dhts:
        trainers = [Trainer(i, 3) for i in range(3)]
        initial_loss = full_loss(trainers[0].model)
        # synchronous state rounds: the models agree exactly (test_optim_optimizer.py's reason)
        opts = await train_together(trainers, dhts, 4, final_sync=True, delay_state_averaging=False)
    assert BackgroundRuntime.active_references() == 0  # no background loop was involved
    assert all(opt.local_epoch == 4 for opt in opts)
    assert all(opt.epochs_averaged >= 2 for opt in opts), [o.epochs_averaged for o in opts]
    assert all(opt.offload_optimizer for opt in opts)  # the default with a factory
    assert all(t.partners >= 1 for t in trainers)  # rounds told the trackers who averaged
    common = set.intersection(*(set(t.snapshots) for t in trainers))
    assert common
    # a final state round of all three (whether every training round averaged or one failed
    # under load, logged): the same model everywhere
    assert all(t.final_group is not None and len(t.final_group) == 3 for t in trainers)
    assert max_gap([[p.detach() for p in t.model.parameters()] for t in trainers]) <= 1e-5
    assert full_loss(trainers[0].model) < 0.6 * initial_loss


@pytest.mark.trio
async def test_local_updates_with_delayed_state_rounds_on_trio():
    async with open_dhts(2) as dhts:
        trainers = [Trainer(i, 2) for i in range(2)]
        initial_loss = full_loss(trainers[0].model)
        opts = await train_together(
            trainers,
            dhts,
            5,
            pause=0.1,  # epochs of ~0.6 s: the delayed rounds (>= matchmaking_time) finish
            use_local_updates=True,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        )
    assert all(opt.local_epoch == 5 for opt in opts)
    assert all(not opt.offload_optimizer and opt.delay_state_averaging for opt in opts)
    assert full_loss(trainers[0].model) < 0.6 * initial_loss
    # the delayed state rounds pulled the two models together (they differ by the local steps
    # since the last applied round only)
    assert all(opt.state_rounds_averaged >= 1 for opt in opts)
    assert max_gap([params_of(t.model) for t in trainers]) < 0.5


@pytest.mark.trio
async def test_a_newcomer_loads_the_state_on_trio():
    async with open_dhts(2) as dhts:
        donor = Trainer(0, 1)
        async with Optimizer.create(
            dht=dhts[0], **options(donor.model, target_batch_size=BATCH)
        ) as donor_opt:
            with trio.fail_after(30):
                await donor.train_until(donor_opt, 2, pause=0.0)
            newcomer = Trainer(1, 2)
            newcomer.model.weight.data.add_(1.0)  # another starting point
            async with Optimizer.create(dht=dhts[1], **options(newcomer.model)) as opt:
                with trio.fail_after(30):
                    assert await opt.load_state_from_peers()
                assert opt.local_epoch == donor_opt.local_epoch == 2
                for a, b in zip(params_of(donor.model), params_of(newcomer.model), strict=True):
                    torch.testing.assert_close(a, b)


@pytest.mark.trio
async def test_state_dict_round_trip_on_trio():
    async with open_dhts(2) as dhts:
        trainer = Trainer(0, 1)
        adam = {"optimizer": lambda params: torch.optim.Adam(params, lr=0.01)}
        opts = options(trainer.model, target_batch_size=BATCH, **adam)
        async with Optimizer.create(dht=dhts[0], **opts) as opt:
            with trio.fail_after(30):
                await trainer.train_until(opt, 2, pause=0.0)
            checkpoint = await opt.state_dict()
        assert checkpoint["swarmtrain_local_epoch"] == 2
        other = make_model(seed=1)
        async with Optimizer.create(dht=dhts[1], **options(other, **adam)) as fresh:
            await fresh.load_state_dict(checkpoint)
            assert fresh.local_epoch == 2 and fresh.tracker.local_progress.epoch == 2
            loaded = fresh.optimizer.state_dict()["state"]
            for key, value in checkpoint["state"].items():
                torch.testing.assert_close(loaded[key]["exp_avg"], value["exp_avg"])
            with pytest.raises(ValueError, match="invalid epoch"):
                await fresh.load_state_dict({**checkpoint, "swarmtrain_local_epoch": -1})


class HostileOptimizer(AsyncOptimizer):
    """Serves its state with a NaN in the first parameter."""

    def _current_state(self):
        metadata, tensors, _ = super()._current_state()
        tensors[0][0, 0] = float("nan")  # a copy: its own parameters stay as they are
        return metadata, tensors


@pytest.mark.trio
async def test_a_trio_newcomer_skips_a_hostile_donor_for_an_honest_one(caplog):
    """The state checks are wired through the trio load path: the donor asked first serves
    NaN, is rejected (and banned), and the honest donor's state is loaded."""
    async with open_dhts(3) as dhts:
        honest = Trainer(0, 1)
        opts = options(honest.model, target_batch_size=BATCH)
        async with Optimizer.create(dht=dhts[0], **opts) as honest_opt:
            with trio.fail_after(30):
                await honest.train_until(honest_opt, 2, pause=0.0)
            hostile_model = make_model(seed=3)
            async with HostileOptimizer.create(dht=dhts[1], **options(hostile_model)) as hostile:
                hostile._state.local_epoch = 2
                assert hostile._state_service is not None
                hostile._state_service.state_sharing_priority = 1e9  # asked first
                newcomer_model = make_model(seed=2)
                async with Optimizer.create(dht=dhts[2], **options(newcomer_model)) as opt:
                    with trio.fail_after(30):
                        await opt.tracker.wait_global_epoch(2)
                        caplog.clear()
                        with caplog.at_level(logging.WARNING):
                            assert await opt.load_state_from_peers()
                    assert opt.local_epoch == 2
                    for mine, theirs in zip(
                        params_of(newcomer_model), params_of(honest.model), strict=True
                    ):
                        assert torch.equal(mine, theirs)
    hostile_id = str(hostile.dht.peer_id)
    assert any(
        hostile_id in r.getMessage() and RejectReason.NON_FINITE.value in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


@pytest.mark.trio
@pytest.mark.parametrize("lock", ["optimizer", "averaged_gradients"])
async def test_a_step_waiting_for_a_lock_does_not_block_the_loop(lock):
    """By construction: the epoch end takes the state averager's ``lock_optimizer`` (the
    optimizer step) and the gradient averager's lock (its averaged buffers) in worker threads.
    A thread holds one of them for ``hold`` s while a lone peer ends an epoch: the step waits
    for it, and a ticker task keeps running meanwhile (taking it on the loop would freeze it)."""
    hold = 1.0
    async with open_dhts(1) as dhts:
        trainer = Trainer(0, 1)
        async with Optimizer.create(
            dht=dhts[0], **options(trainer.model, target_batch_size=BATCH)
        ) as opt:
            trainer.backward()
            ticks: list[float] = []
            locked, release = threading.Event(), threading.Event()

            held = (
                opt._state.lock_optimizer
                if lock == "optimizer"
                else opt._grads.lock_averaged_tensors
            )

            def hold_lock() -> None:
                with held:
                    locked.set()
                    release.wait(hold)

            async def ticker() -> None:
                while True:
                    await trio.sleep(0.01)
                    ticks.append(time.perf_counter())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, hold_lock)
                await trio.to_thread.run_sync(locked.wait)
                nursery.start_soon(ticker)
                started = time.perf_counter()
                with trio.fail_after(30):
                    await opt.step()  # a lone peer's every step ends an epoch
                ended = time.perf_counter()
                nursery.cancel_scope.cancel()
            assert opt.local_epoch == 1
            assert ended - started >= 0.5 * hold  # it did wait for the lock
            during = [t for t in ticks if started <= t <= ended]
            assert len(during) >= 5, (len(during), ended - started)


@pytest.mark.trio
@pytest.mark.parametrize(
    "delays",
    [
        {"delay_optimizer_step": True},
        {"delay_optimizer_step": True, "delay_grad_averaging": True},
    ],
    ids=["delay_optimizer_step", "delay_grad_averaging"],
)
async def test_delayed_optimizer_steps_run_as_jobs_of_the_optimizer(delays):
    """The optimizer step (and the wait for the round, and the state round) run in the
    optimizer's task group while the trainer goes on; a later step applies them."""
    async with open_dhts(2) as dhts:
        trainers = [Trainer(i, 2) for i in range(2)]
        initial_loss = full_loss(trainers[0].model)
        # epochs of ~1.2 s: the round's matchmaking, pre-scheduled matchmaking_time ahead,
        # has assembled the group by the epoch's end (a job that finds its round still
        # looking for a group after the swarm moved on gives it up, as the blocking class)
        opts = await train_together(trainers, dhts, 4, pause=0.2, **delays)
    assert all(opt.delay_optimizer_step and opt.offload_optimizer for opt in opts)
    assert all(opt.local_epoch == 4 for opt in opts)
    assert all(opt.epochs_averaged + opt.epochs_alone == 4 for opt in opts)
    assert all(opt.epochs_averaged >= 1 for opt in opts), [o.epochs_averaged for o in opts]
    assert full_loss(trainers[0].model) < 0.6 * initial_loss


@pytest.mark.trio
async def test_an_auxiliary_peer_keeps_up_on_trio():
    """Two trainers and an auxiliary peer (no data: ``await opt.step()`` in a loop): it
    averages with weight 0, steps on the group's gradients, and catches up when it misses a
    round, so its model follows the swarm's."""
    async with open_dhts(3) as dhts:
        trainers = [Trainer(i, 2) for i in range(2)]
        helper_model = make_model()
        initial_loss = full_loss(helper_model)
        trained = trio.Event()

        async def helper() -> AsyncOptimizer:
            opts = options(helper_model, auxiliary=True, batch_size_per_step=None)
            async with Optimizer.create(dht=dhts[2], **opts) as opt:
                while not trained.is_set():
                    await opt.step()
                    await trio.sleep(0.05)
                return opt

        async with trio.open_nursery() as nursery:
            result: list = []

            async def run_helper() -> None:
                result.append(await helper())

            nursery.start_soon(run_helper)
            opts = await train_together(trainers, dhts[:2], 4, delay_state_averaging=False)
            trained.set()
        (aux,) = result
    assert aux.auxiliary and aux.local_epoch >= 3, aux.local_epoch
    assert full_loss(helper_model) < 0.6 * initial_loss
    assert all(opt.local_epoch == 4 for opt in opts)


@pytest.mark.trio
async def test_a_step_cancelled_in_its_gradient_round_leaves_the_optimizer_usable():
    """Cancelling ``await opt.step()`` while its epoch end waits for a group (the other peer
    is present but never steps) cancels the round; once that peer left, the next steps end
    the epoch alone."""
    async with open_dhts(2) as dhts:
        trainer = Trainer(0, 1)
        quiet_model = make_model()
        left, gone = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:

            async def quiet_peer() -> None:
                async with Optimizer.create(dht=dhts[1], **options(quiet_model)) as quiet:
                    await quiet.wait_for_peers(2, timeout=10)
                    await left.wait()
                gone.set()  # its goodbye is stored

            nursery.start_soon(quiet_peer)
            opts = options(trainer.model, target_batch_size=BATCH)
            async with Optimizer.create(dht=dhts[0], **opts) as opt:
                assert await opt.wait_for_peers(2, timeout=10) == 2
                trainer.backward()
                with trio.move_on_after(0.5) as waited:
                    await opt.step()  # the epoch ends: a round with a peer that never comes
                assert waited.cancelled_caught and opt.local_epoch == 0
                assert opt.scheduled_grads is None
                left.set()  # the quiet peer says goodbye
                with trio.fail_after(30):
                    await gone.wait()
                    assert (await opt.tracker.refresh()).num_peers == 1
                    opt.zero_grad()
                    await trainer.train_until(opt, 2, pause=0.0)
                assert opt.local_epoch == 2 and opt.epochs_alone >= 2


@pytest.mark.trio
@pytest.mark.parametrize("reuse", [False, True], ids=["accumulators", "reuse_grad_buffers"])
async def test_a_grad_scaler_drops_non_finite_batches_on_trio(reuse):
    """``await scaler.step(opt)``: an inf batch is dropped (or, with ``reuse_grad_buffers``,
    the epoch's gradients are dropped at its end), the scale backs off, training goes on."""
    async with open_dhts(1) as dhts:
        model = make_model()
        scaler = GradScaler("cpu", init_scale=64.0)
        opts = options(model, reuse_grad_buffers=reuse, target_batch_size=2 * BATCH)
        async with Optimizer.create(dht=dhts[0], **opts) as opt:
            scaler.scale(model(X[:BATCH]).sum() * float("inf")).backward()
            await scaler.step(opt)
            scaler.update()
            if not reuse:
                assert opt.skipped_batches == 1 and opt.local_samples_accumulated == 0
                assert scaler.get_scale() == 32.0
                opt.zero_grad()
            initial_loss = full_loss(model)
            position = 0
            with trio.fail_after(30):
                while opt.local_epoch < 6:
                    rows = slice(position, position + BATCH)
                    position = (position + BATCH) % (len(X) - BATCH)
                    loss = torch.nn.functional.mse_loss(model(X[rows]), Y[rows])
                    scaler.scale(loss).backward()
                    await scaler.step(opt)
                    scaler.update()
                    if not reuse:
                        opt.zero_grad()
    assert scaler.get_scale() < 64.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert full_loss(model) < 0.8 * initial_loss


def two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Linear(16, 1))


@pytest.mark.trio
async def test_a_power_sgd_averager_plugs_in_on_trio():
    """``grad_averager_factory``: PowerSGD's trio averager (two all-reduce rounds per step)
    runs on the trainer's loop (``PowerSGDGradientAverager.open_async``)."""
    factory = functools.partial(PowerSGDGradientAverager, averager_rank=2)
    async with open_dhts(2) as dhts:
        trainers = [Trainer(i, 2, model=two_layers()) for i in range(2)]
        initial_loss = full_loss(trainers[0].model)
        opts = await train_together(trainers, dhts, 3, pause=0.1, grad_averager_factory=factory)
    assert all(isinstance(opt._grads, PowerSGDGradientAverager) for opt in opts)
    assert all(opt.local_epoch == 3 for opt in opts)
    assert all(opt.epochs_averaged >= 1 for opt in opts), [o.epochs_averaged for o in opts]
    assert full_loss(trainers[0].model) < 0.7 * initial_loss


@pytest.mark.trio
async def test_a_process_gradient_averager_plugs_in_on_trio():
    """``ProcessGradientAverager``: one peer's gradient all-reduce runs in a helper process
    (its own host, bootstrapped from the trio DHT's addresses); its controls are awaited on
    the trainer's loop, and the helper is stopped when the optimizer's block ends."""
    async with open_dhts(2) as dhts:
        trainers = [Trainer(i, 2) for i in range(2)]
        initial_loss = full_loss(trainers[1].model)
        done = [trio.Event(), trio.Event()]
        seen: dict = {}

        async def run(i: int, **extra) -> None:
            opts = options(trainers[i].model, delay_state_averaging=False, **extra)
            async with Optimizer.create(dht=dhts[i], **opts) as opt:
                await opt.wait_for_peers(2, timeout=20)
                await trainers[i].train_until(opt, 3, 0.05)
                if extra:
                    seen.update(opt=opt, helper=opt._grads.helper)
                    seen["bytes"] = opt._grads.helper.bytes_sent
                done[i].set()
                for event in done:
                    await event.wait()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, 0)
                nursery.start_soon(
                    functools.partial(run, 1, grad_averager_factory=ProcessGradientAverager)
                )
    opt, helper = seen["opt"], seen["helper"]
    assert opt.local_epoch == 3
    assert opt.epochs_averaged >= 1, opt.epochs_averaged
    parts_sent, deltas_sent = seen["bytes"]  # the rounds that averaged went through the helper
    assert parts_sent > 0 and deltas_sent > 0
    assert not helper.is_alive() and helper._process.exitcode == 0
    assert full_loss(trainers[1].model) < initial_loss


@pytest.mark.trio
async def test_a_blocking_dht_is_refused():
    model = make_model()
    with pytest.raises(TypeError, match="trio swarmtrain DHT"):
        async with Optimizer.create(dht=object(), **options(model)):
            pass


def test_create_shows_the_optimizer_keywords():
    parameters = inspect.signature(Optimizer.create).parameters
    assert list(parameters)[:3] == ["dht", "run_id", "target_batch_size"]
    assert Optimizer.create.__self__ is AsyncOptimizer  # the trio class behind the name
