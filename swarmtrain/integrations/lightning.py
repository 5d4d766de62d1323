"""Train a LightningModule with a swarm: :class:`SwarmStrategy` (``pip install
swarmtrain[lightning]``)::

    strategy = SwarmStrategy(dht=dht, run_id="my_run", target_batch_size=4096, batch_size=32)
    trainer = lightning.Trainer(strategy=strategy, accelerator="gpu", devices=1, ...)
    trainer.fit(model, dataloader)

The LightningModule stays as it is: ``configure_optimizers`` returns a torch optimizer (and
optionally an LR scheduler); the strategy hands both to a ``swarmtrain.Optimizer`` (the
``optimizer_opts`` keywords go to it), which steps the optimizer once per swarm epoch of
``target_batch_size`` samples and the scheduler once per swarm epoch; Lightning steps an adapter
(``SwarmOptimizerAdapter``) that accumulates each batch into the swarm's epoch.

- **Batch size**: ``batch_size`` is the samples of one training batch; with
  ``accumulate_grad_batches=k`` each optimizer step reports ``k * batch_size`` samples.
- **Scheduler**: stepped by the swarm optimizer at each swarm epoch, not by Lightning (an
  ``interval``/``frequency`` given in ``configure_optimizers`` is ignored).
- **Mixed precision**: Lightning's precision plugin unscales the gradients in place through
  the adapter's ``param_groups`` (the model's parameters) and skips the step on inf/NaN, before
  the swarm optimizer accumulates them.
- **Start**: the state is loaded from peers when training starts (``load_state_from_peers``).
- **Logs**: ``swarm_epoch``, ``swarm_peers``, ``swarm_samples_per_second`` (the swarm's) and
  ``local_samples_per_second`` go to the LightningModule's loggers (CSV, TensorBoard, ...) every
  ``log_every_n_steps`` optimizer steps (at ``step=global_step``) and when training ends
  (``log_swarm_metrics=False``: never). They are written to the loggers directly rather than
  through ``self.log``: Lightning's ``log_dict`` costs ~10 ms per call on a busy 2-core box, at
  every step, while this costs nothing between writes.
- **Checkpoints**: Lightning saves the adapter's state dict: the swarm optimizer's (inner
  optimizer, scheduler, swarm epoch); resuming loads it back.
- **Lifetime**: the strategy builds the swarm optimizer in ``setup`` and shuts it down in
  ``teardown``; the DHT is the caller's. One process per peer, one optimizer.

The optimizer is given to the swarm optimizer as an instance, so ``offload_optimizer`` and the
delayed modes (which need a factory) are off unless ``optimizer_factory`` is given: then
``configure_optimizers``' optimizer only provides the parameter groups' settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from swarmtrain.integrations._adapter import (
    SwarmOptimizerAdapter,
    refresh_offloaded_copies,
    swarm_metrics,
)
from swarmtrain.optim import Optimizer

__all__ = ["SwarmStrategy"]


class SwarmStrategy(SingleDeviceStrategy):
    """A single-device strategy whose optimizer steps are a swarm's (see the module docstring).

    :param dht: a running ``swarmtrain.DHT`` (the caller's)
    :param run_id: the training run's name, the same on every peer
    :param target_batch_size: samples of the whole swarm per optimizer step
    :param batch_size: samples of one training batch on this peer
    :param device: this peer's device (default: CPU)
    :param optimizer_factory: builds the optimizer from param groups (enables
      ``offload_optimizer`` and the delayed modes); default: use ``configure_optimizers``' one
    :param load_state_from_peers: download the swarm's state when training starts
    :param wait_for_peers: when training starts, wait (up to ``load_state_timeout``) until this
      many peers are seen (``swarmtrain.Optimizer.wait_for_peers``), for peers started together
    :param log_swarm_metrics: write the swarm's progress to the loggers (module docstring)
    :param optimizer_opts: more ``swarmtrain.Optimizer`` keywords
    """

    strategy_name = "swarmtrain"

    def __init__(
        self,
        *,
        dht: Any,
        run_id: str,
        target_batch_size: int,
        batch_size: int,
        device: str | torch.device = "cpu",
        optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
        load_state_from_peers: bool = True,
        wait_for_peers: int = 0,
        log_swarm_metrics: bool = True,
        **optimizer_opts: Any,
    ):
        super().__init__(device=device)
        for name in ("optimizer", "params", "scheduler", "batch_size_per_step"):
            if name in optimizer_opts:
                raise TypeError(f"SwarmStrategy sets {name} itself (from configure_optimizers)")
        self.dht, self.run_id = dht, run_id
        self.target_batch_size, self.batch_size = target_batch_size, batch_size
        self.optimizer_factory = optimizer_factory
        self.load_state_from_peers = load_state_from_peers
        self.wait_for_peers = wait_for_peers
        self.log_swarm_metrics = log_swarm_metrics
        self._start: tuple[float, int] | None = None  # (time, samples stepped) at train start
        self._logged_step: int | None = None  #: the global step of the last metrics written
        self.optimizer_opts = optimizer_opts
        self.swarm_optimizer: Optimizer | None = None
        self.loaded_state_from_peers: bool | None = None  #: None: not tried

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"SwarmStrategy trains with one optimizer, configure_optimizers gave "
                f"{len(self.optimizers)}"
            )
        if len(self.lr_scheduler_configs) > 1:
            raise ValueError("SwarmStrategy takes at most one LR scheduler")
        if self.swarm_optimizer is not None:  # a second fit() with the same strategy
            self.swarm_optimizer.shutdown()
        optimizer = self.optimizers[0]
        scheduler = self.lr_scheduler_configs[0].scheduler if self.lr_scheduler_configs else None
        accumulation = getattr(trainer, "accumulate_grad_batches", 1)
        common = {
            "dht": self.dht,
            "run_id": self.run_id,
            "target_batch_size": self.target_batch_size,
            "batch_size_per_step": self.batch_size * accumulation,
            **self.optimizer_opts,
        }
        if self.optimizer_factory is None:
            self.swarm_optimizer = Optimizer(optimizer=optimizer, scheduler=scheduler, **common)
        else:
            if scheduler is not None:
                raise ValueError(
                    "with optimizer_factory, pass the scheduler as a factory in optimizer_opts "
                    "(scheduler=...) rather than from configure_optimizers"
                )
            self.swarm_optimizer = Optimizer(
                optimizer=self.optimizer_factory,
                params=optimizer.param_groups,
                **common,
            )
        self.optimizers = [SwarmOptimizerAdapter(self.swarm_optimizer)]
        self.lr_scheduler_configs = []  # the swarm optimizer steps it, once per swarm epoch

    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.swarm_optimizer is not None
        if self.lightning_module is not None and self.lightning_module.trainer.global_step > 0:
            refresh_offloaded_copies(self.swarm_optimizer)  # resumed: the weights are newer
        if self.wait_for_peers:
            swarm = self.swarm_optimizer
            swarm.wait_for_peers(self.wait_for_peers, timeout=swarm.load_state_timeout)
        if self.load_state_from_peers:
            self.loaded_state_from_peers = bool(self.swarm_optimizer.load_state_from_peers())
        self._start = (time.monotonic(), self._adapter().samples_stepped)
        self._logged_step = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        trainer = self._trainer_or_none()
        if trainer is not None and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._write_swarm_metrics(trainer)
        return output

    def on_train_end(self) -> None:
        super().on_train_end()
        trainer = self._trainer_or_none()
        if trainer is not None:
            self._write_swarm_metrics(trainer)  # the swarm's progress when training ended

    def _trainer_or_none(self) -> Any:
        module = self.lightning_module
        if not self.log_swarm_metrics or self.swarm_optimizer is None or module is None:
            return None
        return module.trainer

    def _write_swarm_metrics(self, trainer: Any) -> None:
        """Write the swarm's metrics to the loggers, once per global step."""
        step = trainer.global_step
        if step == self._logged_step or not trainer.loggers:
            return
        self._logged_step = step
        metrics = self.swarm_metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _adapter(self) -> SwarmOptimizerAdapter:
        adapter = self.optimizers[0]
        assert isinstance(adapter, SwarmOptimizerAdapter)
        return adapter

    def swarm_metrics(self) -> dict[str, float]:
        """The swarm's epoch, peers and samples/s, and this peer's samples/s since train start
        (what ``log_swarm_metrics`` logs)."""
        assert self.swarm_optimizer is not None
        metrics = swarm_metrics(self.swarm_optimizer)
        if self._start is not None:
            started, samples = self._start
            elapsed = time.monotonic() - started
            if elapsed > 0:
                rate = (self._adapter().samples_stepped - samples) / elapsed
                metrics["local_samples_per_second"] = round(rate, 3)
        return metrics

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.swarm_optimizer is not None:
                self.swarm_optimizer.shutdown()
