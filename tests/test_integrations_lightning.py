"""swarmtrain.integrations.lightning: two Lightning Trainers (threads, real DHTs on loopback)
train one regression model with SwarmStrategy, in lockstep."""

from __future__ import annotations

import csv as csv_module
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarmtrain.dht import DHT
from swarmtrain.utils.background import BackgroundRuntime

lightning = pytest.importorskip("lightning")  # CI installs the lightning extra (.ci/run)

from swarmtrain.integrations.lightning import SwarmStrategy  # noqa: E402

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {
    "matchmaking_time": 1.0,
    "averaging_timeout": 15.0,
    "load_state_timeout": 15.0,
    "tracker_opts": {"gossip_period": 0.1, "min_refresh_period": 0.2},
}
FEATURES, BATCH, TARGET = 8, 4, 32
_generator = torch.Generator().manual_seed(0)
TRUE_W = torch.randn(FEATURES, 1, generator=_generator)
X = torch.randn(512, FEATURES, generator=_generator)
Y = X @ TRUE_W + 0.01 * torch.randn(512, 1, generator=_generator)


class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial parameters on every peer
        self.layer = torch.nn.Linear(FEATURES, 1)

    def training_step(self, batch, batch_index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def full_loss(model: Regression) -> float:
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model.layer(X), Y).item()


class StopAtEpoch(lightning.Callback):
    """Stops when the swarm reaches ``epoch``; snapshots the parameters at each swarm epoch."""

    def __init__(self, epoch: int, final_sync: bool = False):
        self.epoch = epoch
        self.final_sync = final_sync
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.lrs: dict[int, float] = {}
        self.final_group: dict | None = None
        self.final: list[torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        swarm = trainer.strategy.swarm_optimizer
        epoch = swarm.local_epoch
        if epoch not in self.snapshots:
            self.snapshots[epoch] = [p.detach().clone() for p in module.parameters()]
            self.lrs[epoch] = swarm.param_groups[0]["lr"]
        if epoch >= self.epoch and not trainer.should_stop:
            trainer.should_stop = True
            if self.final_sync:  # one state round of every peer, before teardown
                self.final_group = swarm.average_state()
                self.final = [p.detach().clone() for p in module.parameters()]


@pytest.fixture
def dhts() -> Iterator[Callable[[int], list[DHT]]]:
    made: list[DHT] = []

    def make(n: int) -> list[DHT]:
        for _ in range(n):
            made.append(DHT(made[0].get_visible_maddrs() if made else [], **HOST))
        return made[-n:]

    yield make
    for dht in reversed(made):
        dht.shutdown()
    assert BackgroundRuntime.active_references() == 0


def make_trainer(strategy: SwarmStrategy, stop: StopAtEpoch, **opts) -> lightning.Trainer:
    return lightning.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=50,  # StopAtEpoch ends training earlier
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[stop],
        **opts,
    )


def loader(index: int) -> torch.utils.data.DataLoader:
    rows = torch.arange(index, len(X), 2)
    dataset = torch.utils.data.TensorDataset(X[rows], Y[rows])
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)


def test_two_lightning_peers_learn_in_lockstep(dhts):
    peers = []
    for index, dht in enumerate(dhts(2)):
        module = Regression()
        strategy = SwarmStrategy(
            dht=dht,
            run_id="lightning_regression",
            target_batch_size=TARGET,
            batch_size=BATCH,
            wait_for_peers=2,
            delay_state_averaging=False,  # lockstep: peers agree exactly after each epoch
            **FAST,
        )
        stop = StopAtEpoch(epoch=4, final_sync=True)
        # peer 1 accumulates 2 batches per optimizer step: it reports 2 x BATCH samples
        trainer = make_trainer(strategy, stop, accumulate_grad_batches=1 + index)
        peers.append((module, strategy, trainer, stop))
    initial = full_loss(peers[0][0])

    def fit(peer):
        module, _, trainer, _ = peer
        trainer.fit(module, loader(peers.index(peer)))

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(fit, peer) for peer in peers]:
            future.result(timeout=90)

    swarms = [strategy.swarm_optimizer for _, strategy, _, _ in peers]
    assert [s.batch_size_per_step for s in swarms] == [BATCH, 2 * BATCH]
    assert {s.local_epoch for s in swarms} == {4}
    assert all(s.epochs_averaged >= 2 for s in swarms)
    common = set(peers[0][3].snapshots) & set(peers[1][3].snapshots)
    assert {1, 2, 3, 4} <= common
    # a final state round of both (whether every training round averaged or one failed under
    # load, logged): the same model on both
    assert all(p[3].final_group is not None and len(p[3].final_group) == 2 for p in peers)
    for a, b in zip(peers[0][3].final, peers[1][3].final, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the scheduler follows the swarm's epochs (StepLR, gamma 0.9 per epoch), not local steps
    for epoch in (1, 2, 3):
        assert peers[0][3].lrs[epoch] == pytest.approx(0.1 * 0.9**epoch)
    assert full_loss(peers[0][0]) < 0.5 * initial
    assert all(not s.state_averager.is_alive() for s in swarms)  # teardown shut them down
    assert all(strategy.loaded_state_from_peers is not None for _, strategy, _, _ in peers)


def test_the_swarms_progress_reaches_lightnings_logger(dhts, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    peers = []
    for index, dht in enumerate(dhts(2)):
        strategy = SwarmStrategy(
            dht=dht,
            run_id="lightning_metrics",
            target_batch_size=TARGET,
            batch_size=BATCH,
            wait_for_peers=2,
            **FAST,
        )
        stop = StopAtEpoch(epoch=3)
        csv = CSVLogger(tmp_path, name=f"peer{index}")
        trainer = make_trainer(stop=stop, strategy=strategy, log_every_n_steps=1)
        trainer.loggers = [csv]  # make_trainer turns loggers off
        peers.append((Regression(), trainer, csv))

    def fit(index):
        module, trainer, _ = peers[index]
        trainer.fit(module, loader(index))

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(fit, index) for index in range(2)]:
            future.result(timeout=90)

    for _, trainer, csv in peers:
        with open(os.path.join(csv.log_dir, "metrics.csv")) as f:
            rows = list(csv_module.DictReader(f))
        assert rows, csv.log_dir
        columns = {"swarm_epoch", "swarm_peers", "swarm_samples_per_second"}
        assert columns | {"local_samples_per_second", "step"} <= set(rows[0])
        logged = [r for r in rows if r["swarm_epoch"]]
        steps = [int(r["step"]) for r in logged]
        # every optimizer step (log_every_n_steps=1), once, and once more when training ended
        assert steps == list(range(trainer.global_step + 1)), steps
        epochs = [float(r["swarm_epoch"]) for r in logged]
        assert epochs == sorted(epochs) and epochs[-1] >= 3  # the swarm's epoch, as it grew
        assert max(float(r["swarm_peers"]) for r in logged) == 2
        assert max(float(r["swarm_samples_per_second"]) for r in logged) > 0
        assert all(float(r["local_samples_per_second"]) > 0 for r in logged[1:])
