"""The top-level package loads its exports lazily: DHT-only processes never import torch."""

import subprocess
import sys

import pytest


def run_python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()


@pytest.mark.parametrize(
    "module",
    [
        "swarmtrain",
        "swarmtrain.dht",
        "swarmtrain.dht.owned_keys",
        "swarmtrain.p2p",
        "swarmtrain.cli.main",
        "swarmtrain.cli.node",
    ],
)
def test_networking_modules_do_not_import_torch(module):
    assert run_python(f"import sys, {module}; print('torch' in sys.modules)") == "False"


def test_top_level_names_resolve_on_first_use():
    code = (
        "import swarmtrain, sys; "
        "print(swarmtrain.DHT.__module__, swarmtrain.Optimizer.__module__, "
        "swarmtrain.optim.DiLoCoOptimizer.__name__, 'torch' in sys.modules, "
        "sorted(set(swarmtrain.__all__) - set(dir(swarmtrain))))"
    )
    assert (
        run_python(code) == "swarmtrain.dht.dht swarmtrain.optim.optimizer DiLoCoOptimizer True []"
    )
    with pytest.raises(subprocess.CalledProcessError):
        run_python("import swarmtrain; swarmtrain.NoSuchThing")
