"""Make a ``transformers.Trainer`` collaborative: its optimizer steps become a swarm's.

Any Trainer script changes in two lines (``pip install swarmtrain[hf]``)::

    opt = swarmtrain.Optimizer(dht=dht, run_id="my_run", target_batch_size=4096,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                               params=model.parameters(), scheduler=..., ...)
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    make_collaborative(trainer, opt)      # before trainer.train()
    trainer.train()

``opt`` may also be a ``swarmtrain.DiLoCoOptimizer``. What changes under Trainer's loop:

- **Optimizer**: Trainer gets :class:`TrainerOptimizer`, an adapter around ``opt``. It has to
  be a ``torch.optim.Optimizer`` subclass: accelerate (which runs Trainer's optimizer) wraps
  only those in its ``AcceleratedOptimizer``, and an unwrapped optimizer would bypass its AMP
  loss-scaler step, its gradient-accumulation gating and its clipping/unscaling. A callback
  alone cannot do it: Trainer calls ``optimizer.step()`` with no batch size.
- **Gradient accumulation**: Trainer calls ``step()`` once per ``gradient_accumulation_steps``
  micro-batches, with the mean gradient of those micro-batches; the adapter reports
  ``micro-batches x per_device_train_batch_size`` samples to the swarm (counted each step, so
  an epoch's shorter last accumulation counts right).
- **Learning rate**: the schedule follows the swarm's epochs, so it lives in ``opt`` (its
  ``scheduler``); Trainer gets :class:`SwarmScheduler`, which never changes the LR and reports
  ``opt``'s current LR in Trainer's logs.
- **fp16/bf16**: accelerate's own ``GradScaler`` unscales the gradients in place (through the
  adapter's ``param_groups``, which are the model's parameters) and skips the step on inf/NaN,
  before ``opt`` sees them: ``opt`` gets unscaled, finite (and, with ``max_grad_norm``,
  clipped) gradients of each local step, so ``swarmtrain.GradScaler`` is not needed here. A
  batch with inf/NaN is dropped from the swarm's accumulation, not counted.
- **Start**: :class:`SwarmCallback` loads the training state from peers when training begins
  (a newcomer joins the swarm's epoch and parameters; a lone first peer keeps its own).
- **Logs**: ``swarm_epoch``, ``swarm_peers``, ``swarm_samples_per_second`` (the swarm's) and
  ``local_samples_per_second`` are added to each of Trainer's log entries.
- **Checkpoints**: Trainer saves ``optimizer.state_dict()`` in each checkpoint; here that is
  ``opt.state_dict()``: the inner optimizer's state, the scheduler's state and the swarm epoch.
  ``trainer.train(resume_from_checkpoint=...)`` loads it back (and the CPU copies of an
  offloaded optimizer are refreshed from the resumed model); peers, if any, then hand over the
  newer swarm state at train start.

Constraints: one process per peer (no DDP/FSDP/DeepSpeed under the adapter); not
``reuse_grad_buffers`` (Trainer zeroes the model's gradients after each step).
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from swarmtrain.integrations._adapter import (
    SwarmOptimizerAdapter,
    refresh_offloaded_copies,
    swarm_metrics,
)

__all__ = ["SwarmCallback", "SwarmScheduler", "TrainerOptimizer", "make_collaborative"]


class TrainerOptimizer(SwarmOptimizerAdapter):
    """The adapter Trainer steps (see the module docstring and ``SwarmOptimizerAdapter``)."""


class SwarmScheduler:
    """Trainer's LR scheduler when the swarm optimizer schedules the LR by swarm epoch: ``step``
    does nothing; ``get_last_lr`` reads the LR the swarm optimizer uses now."""

    def __init__(self, optimizer: TrainerOptimizer):
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.swarm_optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {}  # the swarm optimizer's state dict holds its scheduler's

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class SwarmCallback(TrainerCallback):
    """Trainer's side of the swarm: loads the state from peers at train start, counts the
    samples of each step, adds the swarm's progress to the logs (see the module docstring).

    :param optimizer: the adapter that Trainer steps
    :param load_state_from_peers: download the swarm's state when training begins
    """

    def __init__(self, optimizer: TrainerOptimizer, load_state_from_peers: bool = True):
        self.optimizer = optimizer
        self.load_state_from_peers = load_state_from_peers
        self.loaded_state_from_peers: bool | None = None  #: None: not tried
        self._micro_batches = 0
        self._start: tuple[float, int] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        swarm = self.optimizer.swarm_optimizer
        if state.global_step > 0:  # resumed from a checkpoint: the model's weights are newer
            refresh_offloaded_copies(swarm)
        if self.load_state_from_peers:
            self.loaded_state_from_peers = bool(swarm.load_state_from_peers())
        self._micro_batches = 0
        self._start = (time.monotonic(), self.optimizer.samples_stepped)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._micro_batches += 1  # a micro-batch without an optimizer step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        micro_batches = self._micro_batches + 1
        self._micro_batches = 0
        self.optimizer.next_batch_size = micro_batches * args.per_device_train_batch_size

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        metrics = swarm_metrics(self.optimizer.swarm_optimizer)
        if self._start is not None:
            started, samples = self._start
            elapsed = time.monotonic() - started
            if elapsed > 0:
                rate = (self.optimizer.samples_stepped - samples) / elapsed
                metrics["local_samples_per_second"] = round(rate, 3)
        if logs is not None:
            logs.update(metrics)
        if state.log_history:  # Trainer appended a copy of `logs` before calling us
            state.log_history[-1].update(metrics)


def make_collaborative(
    trainer: Any, swarm_optimizer: Any, *, load_state_from_peers: bool = True
) -> SwarmCallback:
    """Make ``trainer`` (a ``transformers.Trainer``, before ``train()``) step through
    ``swarm_optimizer`` (see the module docstring); returns the callback it added."""
    args = trainer.args
    if getattr(args, "world_size", 1) > 1:
        raise ValueError(
            "make_collaborative runs one process per peer: launch each peer as a single "
            "process (no torchrun/DDP), with one swarm optimizer each"
        )
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise ValueError(
            "the Trainer already has an optimizer or scheduler: the swarm optimizer replaces "
            "both (give its scheduler to the swarm optimizer)"
        )
    optimizer = TrainerOptimizer(
        swarm_optimizer,
        batch_size_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,
    )
    trainer.optimizer = optimizer
    trainer.lr_scheduler = SwarmScheduler(optimizer)
    callback = SwarmCallback(optimizer, load_state_from_peers=load_state_from_peers)
    # first in line, so that the loggers and printers after it see the swarm's metrics
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
