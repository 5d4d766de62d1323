"""Sharing the whole training state: what a ``TrainingStateAverager`` serves to newcomers,
how a donor's state is checked before any of it is used, and how it is loaded.

The state: metadata (``epoch``, ``group_bits``, ``optimizer_metadata``, ``scheduler_state``)
and the tensors (the parameters, the extra tensors, then every tensor of the optimizer's state
dict). A donor's metadata is checked by :func:`check_training_state` (a ``StateCheck``: epoch
bounds, group bits, the optimizer's structure and hyperparameters, the scheduler's state), its
tensors against our specs; only then :meth:`TrainingStateSharing._load_downloaded_state` loads
it under the locks (call it off the trio loop).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from swarmtrain.averaging.state_checks import (
    RejectReason,
    StateCheck,
    StateRejected,
    TensorSpec,
)
from swarmtrain.compression import CompressionInfo, TensorRole
from swarmtrain.dht import serialize
from swarmtrain.optim._optimizer_state import (
    dump_optimizer_state,
    encode_tensors,
    load_optimizer_state,
)
from swarmtrain.optim._state_checks import (
    check_epoch,
    check_scheduler_state,
    optimizer_state_specs,
)
from swarmtrain.optim._state_phases import StateTensors

__all__ = ["MAX_GROUP_BITS", "TrainingStateSharing", "check_training_state"]

logger = logging.getLogger("swarmtrain.optim.state_averager")

#: most characters of a donor's group bits
MAX_GROUP_BITS = 1024


def check_training_state(
    metadata: Any,
    *,
    local: list[TensorSpec],
    optimizer_metadata: Any,
    optimizer_specs: list[TensorSpec],
    scheduler_state: Any,
    local_epoch: int,
    swarm_epoch: int | None,
    max_lrs: Sequence[float],
) -> list[TensorSpec]:
    """The specs of a donor's state tensors, after checking its metadata (a ``StateCheck``)."""
    if not isinstance(metadata, dict):
        raise StateRejected(RejectReason.METADATA, "the metadata is not a dict")
    epoch = check_epoch(metadata.get("epoch"), local_epoch, swarm_epoch)
    bits = metadata.get("group_bits")
    if not isinstance(bits, str) or len(bits) > MAX_GROUP_BITS:
        raise StateRejected(RejectReason.METADATA, "group_bits is not a short string")
    specs = optimizer_state_specs(
        optimizer_metadata, optimizer_specs, metadata.get("optimizer_metadata"), max_lrs
    )
    check_scheduler_state(
        scheduler_state, metadata.get("scheduler_state"), epoch, max(max_lrs, default=0.0)
    )
    return [*local, *specs]


class TrainingStateSharing(StateTensors):
    """Base of ``TrainingStateAverager``: the state it serves and loads (module docstring)."""

    max_donor_lrs: tuple[float, ...]
    _service: Any

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], list]:
        """``(metadata, tensors, infos)`` for newcomers: metadata holds ``epoch``,
        ``group_bits``, ``optimizer_metadata`` and ``scheduler_state``; the tensors are the
        parameters, the extra tensors, then every tensor of the optimizer's state dict."""
        with torch.no_grad(), self.lock_optimizer, self.lock_averaged_tensors:
            params = [p.detach().to("cpu", copy=True) for p in self._opt_params()]
            extras = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
            optimizer_metadata, optimizer_tensors = dump_optimizer_state(self.optimizer)
            scheduler_state = self._scheduler_state()
            epoch = self.local_epoch
        infos = [
            CompressionInfo.from_tensor(p, key=n, role=TensorRole.PARAMETER)
            for p, n in zip(params, self.parameter_names, strict=True)
        ]
        infos += [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(extras)]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
            for i, t in enumerate(optimizer_tensors)
        ]
        service = self._service
        metadata = {
            "epoch": epoch,
            "group_bits": service.get_group_bits() if service is not None else "",
            "optimizer_metadata": optimizer_metadata,
            "scheduler_state": scheduler_state,
        }
        return metadata, [*params, *extras, *optimizer_tensors], infos

    def _scheduler_state(self) -> dict | None:
        if self.scheduler is None:
            return None
        state = self.scheduler.state_dict()
        try:
            serialize(state, max_size=None)
        except ValueError:
            return None  # e.g. callables inside: the newcomer fast-forwards its own instead
        return state

    def _load_downloaded_state(
        self, loaded: tuple[Any, list[torch.Tensor]], min_epoch: int | None = None
    ) -> bool:
        """Load a donor's ``(metadata, tensors)`` that passed :meth:`_state_check` (takes the
        locks: call it off the trio loop); False if it no longer fits."""
        metadata, tensors = loaded
        epoch, least = metadata["epoch"], max(self.local_epoch, min_epoch or 0)
        if epoch < least:  # we moved on during the download
            logger.warning("not loading the state of a donor behind us (%d < %d)", epoch, least)
            return False
        local = [*self._opt_params(), *self.extra_tensors]
        with torch.no_grad(), self.lock_optimizer, self.lock_averaged_tensors:
            statistics = self._averaged_statistics()
            try:
                load_optimizer_state(
                    self.optimizer, metadata.get("optimizer_metadata"), tensors[len(local) :]
                )
            except (ValueError, KeyError, TypeError, IndexError) as e:
                logger.error("the donor's optimizer state does not fit ours: %s", e)
                return False
            self._restore_statistics(statistics)
            for local_tensor, loaded_tensor in zip(local, tensors, strict=False):
                local_tensor.copy_(loaded_tensor)
            if self.offload_optimizer:
                self._apply_optimizer_parameters_()
            if not self.reuse_tensors:
                self._copy_local_into_averaged(self._averaged_tensors)
            self.local_epoch = epoch
            self._load_scheduler_state(metadata.get("scheduler_state"))
            self._update_scheduler()
        logger.log(self.status_loglevel, "loaded the training state of epoch %d", epoch)
        return True

    def _state_check(self, swarm_epoch: int | None, min_epoch: int | None = None) -> StateCheck:
        """A snapshot of what a donor's state must look like (ours, now), as a check."""
        with self.lock_optimizer:
            local = [TensorSpec.of(t) for t in (*self._opt_params(), *self.extra_tensors)]
            tensors: list[torch.Tensor] = []
            optimizer_metadata = encode_tensors(self.optimizer.state_dict(), tensors, copy=False)
            return functools.partial(
                check_training_state,
                local=local,
                optimizer_metadata=optimizer_metadata,
                optimizer_specs=[TensorSpec.of(t) for t in tensors],
                scheduler_state=self._scheduler_state(),
                local_epoch=max(self.local_epoch, min_epoch or 0),
                swarm_epoch=swarm_epoch,
                max_lrs=self.max_donor_lrs,
            )

    def _averaged_statistics(self) -> dict[tuple[int, str], torch.Tensor]:
        """The statistic tensors averaged in place (``reuse_tensors``), to keep across a load."""
        if not self.reuse_tensors:
            return {}
        return {
            (i, key): self.optimizer.state[param][key]
            for key in self.opt_keys_for_averaging
            for i, param in enumerate(self._opt_params())
        }

    def _restore_statistics(self, statistics: dict[tuple[int, str], torch.Tensor]) -> None:
        """``load_state_dict`` made new tensors: copy them into the averaged ones, put those in."""
        params = self._opt_params()
        for (i, key), tensor in statistics.items():
            state = self.optimizer.state[params[i]]
            tensor.copy_(state[key])
            state[key] = tensor

    def _load_scheduler_state(self, state: Any) -> None:
        if self.scheduler is None or not isinstance(state, dict):
            return
        try:
            self.scheduler.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("the donor's scheduler state does not fit ours: %s", e)
