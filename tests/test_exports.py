"""Every public name a package offers resolves, and DESIGN's public API is at the top level."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

import swarmtrain

PACKAGES = [
    "swarmtrain.averaging",
    "swarmtrain.compression",
    "swarmtrain.dht",
    "swarmtrain.monitor",
    "swarmtrain.optim",
    "swarmtrain.p2p",
    "swarmtrain.utils",
]

# /work/shared/DESIGN.md, "Public API": the names a hivemind user reaches as ``swarmtrain.X``
DESIGN_PUBLIC_API = [
    "DHT",
    "DecentralizedAverager",
    "Optimizer",
    "GradientAverager",
    "PowerSGDGradientAverager",
    "TrainingStateAverager",
    "ProgressTracker",
    "GradScaler",
    "DiLoCoOptimizer",
    "NoCompression",
    "Float16Compression",
    "ScaledFloat16Compression",
    "Uniform8BitQuantization",
    "Quantile8BitQuantization",
    "BlockwiseQuantization",
    "SizeAdaptiveCompression",
    "RoleAdaptiveCompression",
    "PerTensorCompression",
    "get_dht_time",
]


def reexported_names(package) -> list[str]:
    """The names ``package/__init__.py`` re-exports (``from x import Y as Y``) or lists in
    ``__all__``."""
    tree = ast.parse(inspect.getsource(package))
    names = [
        alias.asname
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname is not None and alias.asname == alias.name
    ]
    return sorted({*names, *getattr(package, "__all__", ())})


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_a_package_exports_resolves(name):
    package = importlib.import_module(name)
    names = reexported_names(package)
    missing = [n for n in names if not hasattr(package, n)]
    assert not missing, f"{name} exports names that do not resolve: {missing}"
    if hasattr(package, "__all__"):
        assert set(package.__all__) >= set(names), f"{name}.__all__ misses names it re-exports"


def test_top_level_lazy_exports_resolve_to_the_subpackages_objects():
    for name, module in swarmtrain._EXPORTS.items():
        assert getattr(swarmtrain, name) is getattr(importlib.import_module(module), name), name
    assert set(swarmtrain.__all__) == set(swarmtrain._EXPORTS)


@pytest.mark.parametrize("name", DESIGN_PUBLIC_API)
def test_designs_public_api_is_at_the_top_level(name):
    assert name in swarmtrain.__all__
    assert getattr(swarmtrain, name) is not None
