"""Where the monitor also sends each run's swarm-level numbers: TensorBoard, Weights & Biases,
or any callable. The libraries are imported when a sink is made (``ImportError`` naming the
package to install if missing), never by ``import swarmtrain``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["MetricsSink", "SwarmPoint", "TensorBoardSink", "WandbSink"]


@dataclass(frozen=True)
class SwarmPoint:
    """One refresh of one run, as the dashboard's curves show it."""

    run_id: str
    time: float  #: DHT time of the read
    step: int  #: refreshes of this run so far (the x axis of sinks that need an integer)
    mean_loss: float | None
    samples_per_second: float
    alive_peers: int
    epoch: int | None


class MetricsSink(Protocol):
    def log(self, point: SwarmPoint) -> None: ...

    def close(self) -> None: ...


def _require(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this sink needs {package}: pip install {package}") from e


def _scalars(point: SwarmPoint) -> dict[str, float]:
    values = {"samples_per_second": point.samples_per_second, "alive_peers": point.alive_peers}
    if point.mean_loss is not None:
        values["loss"] = point.mean_loss
    if point.epoch is not None:
        values["epoch"] = point.epoch
    return values


class TensorBoardSink:
    """Scalars ``{run_id}/loss``, ``/samples_per_second``, ``/alive_peers``, ``/epoch`` in
    ``logdir`` (needs ``tensorboard``; uses torch's ``SummaryWriter``)."""

    def __init__(self, logdir: str):
        _require("tensorboard", "tensorboard")
        writer_module = _require("torch.utils.tensorboard", "tensorboard")
        self._writer = writer_module.SummaryWriter(logdir)

    def log(self, point: SwarmPoint) -> None:
        for name, value in _scalars(point).items():
            self._writer.add_scalar(f"{point.run_id}/{name}", value, point.step, point.time)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One wandb run per monitor (``project``), a ``{run_id}/...`` metric per value (needs
    ``wandb``; log in first with ``wandb login``)."""

    def __init__(self, project: str, **init_kwargs: Any):
        wandb = _require("wandb", "wandb")
        self._run = wandb.init(project=project, **init_kwargs)

    def log(self, point: SwarmPoint) -> None:
        self._run.log({f"{point.run_id}/{k}": v for k, v in _scalars(point).items()})

    def close(self) -> None:
        self._run.finish()
