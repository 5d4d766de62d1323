"""An ``Optimizer``'s checkpoint: the inner optimizer's state dict plus epoch and scheduler.

Shared by the blocking ``Optimizer`` and the trio ``AsyncOptimizer``; both call these with no
delayed work running (they wait for it first). The functions take ``lock_optimizer``, so the
trio optimizer calls them in a worker thread.
"""

from __future__ import annotations

from typing import Any

from swarmtrain.optim.state_averager import TrainingStateAverager

__all__ = ["load_checkpoint", "make_checkpoint"]

EPOCH_KEY = "swarmtrain_local_epoch"
SCHEDULER_KEY = "swarmtrain_scheduler"


def make_checkpoint(state: TrainingStateAverager) -> dict[str, Any]:
    """The inner optimizer's state dict, plus the epoch and the scheduler's state."""
    with state.lock_optimizer:
        checkpoint = dict(state.optimizer.state_dict())
        checkpoint[EPOCH_KEY] = state.local_epoch
        if state.scheduler is not None:
            checkpoint[SCHEDULER_KEY] = state.scheduler.state_dict()
    return checkpoint


def load_checkpoint(state: TrainingStateAverager, checkpoint: dict[str, Any]) -> int | None:
    """Load what :func:`make_checkpoint` returned (a plain torch optimizer state works too);
    the epoch it held (None: none), which the caller announces."""
    checkpoint = dict(checkpoint)
    epoch = checkpoint.pop(EPOCH_KEY, None)
    scheduler_state = checkpoint.pop(SCHEDULER_KEY, None)
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise ValueError(f"invalid epoch in the state dict: {epoch!r}")
    with state.lock_optimizer:
        state.optimizer.load_state_dict(checkpoint)
        if scheduler_state is not None and state.scheduler is not None:
            state.scheduler.load_state_dict(scheduler_state)
        if epoch is not None:
            state.local_epoch = epoch
    return epoch
