"""swarmtrain: train one model together on GPUs scattered across the internet.

This module only re-exports the public API; implementations live in the subpackages. The
re-exports load on first use (PEP 562), so ``import swarmtrain.dht`` or ``swarmtrain.p2p``
does not import torch: a DHT-only process (a bootstrap node, a monitor) starts in a fraction of
the time, and its cyclic garbage collector walks far fewer objects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from swarmtrain.utils.logs import show_logs_from_environment

__version__ = "0.1.0.dev0"
show_logs_from_environment()

_EXPORTS = {
    "DecentralizedAverager": "swarmtrain.averaging",
    "ProcessAverager": "swarmtrain.averaging",
    "BlockwiseQuantization": "swarmtrain.compression",
    "CompressionInfo": "swarmtrain.compression",
    "Float16Compression": "swarmtrain.compression",
    "NoCompression": "swarmtrain.compression",
    "PerTensorCompression": "swarmtrain.compression",
    "Quantile8BitQuantization": "swarmtrain.compression",
    "RoleAdaptiveCompression": "swarmtrain.compression",
    "ScaledFloat16Compression": "swarmtrain.compression",
    "SizeAdaptiveCompression": "swarmtrain.compression",
    "TensorRole": "swarmtrain.compression",
    "Uniform8BitQuantization": "swarmtrain.compression",
    "DHT": "swarmtrain.dht",
    "get_dht_time": "swarmtrain.dht",
    "DiLoCoOptimizer": "swarmtrain.optim",
    "GradientAverager": "swarmtrain.optim",
    "GradScaler": "swarmtrain.optim",
    "Optimizer": "swarmtrain.optim",
    "PowerSGDGradientAverager": "swarmtrain.optim",
    "ProgressTracker": "swarmtrain.optim",
    "TrainingStateAverager": "swarmtrain.optim",
    "P2P": "swarmtrain.p2p",
}
_SUBPACKAGES = ("averaging", "cli", "compression", "dht", "optim", "p2p", "proto", "utils")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"swarmtrain.{name}")
    raise AttributeError(f"module 'swarmtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_SUBPACKAGES])


if TYPE_CHECKING:
    from swarmtrain.averaging import DecentralizedAverager as DecentralizedAverager
    from swarmtrain.averaging import ProcessAverager as ProcessAverager
    from swarmtrain.compression import BlockwiseQuantization as BlockwiseQuantization
    from swarmtrain.compression import CompressionInfo as CompressionInfo
    from swarmtrain.compression import Float16Compression as Float16Compression
    from swarmtrain.compression import NoCompression as NoCompression
    from swarmtrain.compression import PerTensorCompression as PerTensorCompression
    from swarmtrain.compression import Quantile8BitQuantization as Quantile8BitQuantization
    from swarmtrain.compression import RoleAdaptiveCompression as RoleAdaptiveCompression
    from swarmtrain.compression import ScaledFloat16Compression as ScaledFloat16Compression
    from swarmtrain.compression import SizeAdaptiveCompression as SizeAdaptiveCompression
    from swarmtrain.compression import TensorRole as TensorRole
    from swarmtrain.compression import Uniform8BitQuantization as Uniform8BitQuantization
    from swarmtrain.dht import DHT as DHT
    from swarmtrain.dht import get_dht_time as get_dht_time
    from swarmtrain.optim import DiLoCoOptimizer as DiLoCoOptimizer
    from swarmtrain.optim import GradientAverager as GradientAverager
    from swarmtrain.optim import GradScaler as GradScaler
    from swarmtrain.optim import Optimizer as Optimizer
    from swarmtrain.optim import PowerSGDGradientAverager as PowerSGDGradientAverager
    from swarmtrain.optim import ProgressTracker as ProgressTracker
    from swarmtrain.optim import TrainingStateAverager as TrainingStateAverager
    from swarmtrain.p2p import P2P as P2P
