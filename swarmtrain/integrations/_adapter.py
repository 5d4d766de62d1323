"""What the framework integrations share: a torch optimizer in front of a swarm optimizer,
the swarm's metrics for logs. Imports no framework."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SwarmOptimizerAdapter", "refresh_offloaded_copies", "swarm_metrics"]


def _main_parameters(swarm_optimizer: Any) -> list[torch.Tensor]:
    """The model's parameters (whose ``.grad`` autograd writes) that ``swarm_optimizer`` trains."""
    main = getattr(swarm_optimizer, "main_parameters", None)
    if main is None:  # DiLoCoOptimizer: its inner optimizer holds the model's parameters
        main = [p for group in swarm_optimizer.param_groups for p in group["params"]]
    return list(main)


class SwarmOptimizerAdapter(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` in front of a ``swarmtrain.Optimizer`` or
    ``DiLoCoOptimizer``, for frameworks that accept only torch optimizers.

    :param swarm_optimizer: the collaborative optimizer (its DHT and lifetime are the caller's)
    :param batch_size_per_step: samples per ``step()`` (default: the swarm optimizer's) unless
      :attr:`next_batch_size` is set
      (the framework's hooks set it before every step)
    """

    def __init__(self, swarm_optimizer: Any, batch_size_per_step: int | None = None):
        # torch.optim.Optimizer.__init__ is not called, as in accelerate's wrapper: the state
        # and the param groups are the swarm optimizer's
        if getattr(swarm_optimizer, "reuse_grad_buffers", False):
            raise ValueError(
                "reuse_grad_buffers=True does not work under Trainer: Trainer zeroes the model's "
                "gradients after each step, and they would be the swarm's accumulators"
            )
        for name in ("step", "zero_grad", "state_dict", "load_state_dict", "param_groups"):
            if not hasattr(swarm_optimizer, name):
                raise TypeError(
                    f"{type(swarm_optimizer).__name__} is not a swarmtrain optimizer (no {name})"
                )
        self.swarm_optimizer = swarm_optimizer
        self.parameters = _main_parameters(swarm_optimizer)
        if batch_size_per_step is None:
            batch_size_per_step = getattr(swarm_optimizer, "batch_size_per_step", None)
        self.batch_size_per_step = batch_size_per_step
        self.next_batch_size: int | None = None  #: samples of the next step (then cleared)
        self.samples_stepped = 0  #: samples reported to the swarm since construction

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The swarm optimizer's groups with the model's parameters in them (with
        ``offload_optimizer`` its own hold CPU copies): what AMP unscales and clipping reads.
        A copy: change the LR through the swarm optimizer's scheduler."""
        groups, start = [], 0
        for group in self.swarm_optimizer.param_groups:
            count = len(group["params"])
            groups.append({**group, "params": self.parameters[start : start + count]})
            start += count
        return groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.swarm_optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return getattr(self.swarm_optimizer, "defaults", {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "the swarm's parameters are fixed when the swarm optimizer is made"
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One local step of ``next_batch_size`` (else ``batch_size_per_step``) samples."""
        batch_size = self.next_batch_size or self.batch_size_per_step
        self.next_batch_size = None
        if batch_size is None:
            raise ValueError(
                "no batch size for this step: pass batch_size_per_step= or set next_batch_size"
            )
        self.samples_stepped += batch_size
        return self.swarm_optimizer.step(closure, batch_size=batch_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.swarm_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The swarm optimizer's state dict (inner optimizer, scheduler, swarm epoch)."""
        return self.swarm_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.swarm_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.swarm_optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a TrainerOptimizer holds a running swarm optimizer: it cannot be pickled")


def swarm_metrics(swarm_optimizer: Any) -> dict[str, float]:
    """What Trainer's logs get about the swarm: epoch, peers, samples/s."""
    metrics: dict[str, float] = {"swarm_epoch": swarm_optimizer.local_epoch}
    tracker = getattr(swarm_optimizer, "tracker", None)
    if tracker is not None:
        progress = tracker.global_progress
        metrics["swarm_peers"] = progress.num_peers
        metrics["swarm_samples_per_second"] = round(progress.samples_per_second, 3)
    return metrics


def refresh_offloaded_copies(swarm_optimizer: Any) -> None:
    """With ``offload_optimizer`` the swarm optimizer steps on CPU copies of the parameters;
    after a framework loaded a checkpoint's weights into the model, copy them in (else the next
    step would write the old values back)."""
    if not getattr(swarm_optimizer, "offload_optimizer", False):
        return
    averager = swarm_optimizer.state_averager
    averager.step(wait_for_delayed_updates=True)
    copies = [p for group in swarm_optimizer.param_groups for p in group["params"]]
    with averager.lock_optimizer, torch.no_grad():
        for copy, param in zip(copies, swarm_optimizer.main_parameters, strict=True):
            copy.copy_(param.detach().to(copy.device, copy.dtype))
