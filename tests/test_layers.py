"""The layer graph of DESIGN.md holds: each package imports only from the layers before it.

    proto, utils -> p2p -> dht -> compression -> averaging -> optim -> monitor, integrations, cli

Every import statement counts, also the lazy ones inside functions (they are still a
dependency), and relative imports are resolved to their package. Only `swarmtrain.p2p`
imports py-libp2p itself (`libp2p`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import swarmtrain

PACKAGE_ROOT = Path(swarmtrain.__file__).parent

# Each layer may import the layers listed before it (and itself).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("proto", "utils"),
    ("p2p",),
    ("dht",),
    ("compression",),
    ("averaging",),
    ("optim",),
    ("monitor", "integrations", "cli"),
)
TOP_LEVEL = "(top-level module)"  # swarmtrain/__init__.py and friends re-export everything


def allowed_imports(package: str) -> set[str]:
    allowed: set[str] = set()
    for layer in LAYERS:
        allowed.update(layer)
        if package in layer:
            return allowed
    raise AssertionError(f"swarmtrain.{package} is in no layer: add it to LAYERS in {__file__}")


def imported_modules(source: str, module_parts: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, lazy ones included.

    `module_parts`: the file's path inside swarmtrain without the suffix, e.g. ("dht", "node").
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module or ""))
                continue
            base = ["swarmtrain", *module_parts[:-1]]
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # `from . import a, b` imports submodules a and b
                found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, module))
    return found


def package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT).parts
    return parts[0] if len(parts) > 1 else TOP_LEVEL


SOURCE_FILES = sorted(PACKAGE_ROOT.rglob("*.py"))


def test_the_scan_sees_the_package():
    packages = {package_of(path) for path in SOURCE_FILES}
    assert {"p2p", "dht", "compression", "averaging", "optim", "cli", TOP_LEVEL} <= packages


@pytest.mark.parametrize(
    "path",
    [p for p in SOURCE_FILES if package_of(p) != TOP_LEVEL],
    ids=lambda p: str(p.relative_to(PACKAGE_ROOT)),
)
def test_imports_follow_the_layers(path: Path):
    package = package_of(path)
    allowed = allowed_imports(package)
    violations = []
    source = path.read_text(encoding="utf-8")
    parts = path.relative_to(PACKAGE_ROOT).with_suffix("").parts
    for line, module in imported_modules(source, parts):
        names = module.split(".")
        if names[0] == "swarmtrain" and len(names) > 1:
            target = names[1]
            if target != package and target not in allowed:
                violations.append(f"line {line}: imports {module} (layer of {target!r})")
        elif names[0] == "libp2p" and package != "p2p":
            violations.append(f"line {line}: imports {module} (only swarmtrain.p2p uses libp2p)")
    assert not violations, f"swarmtrain.{package} may import only {sorted(allowed)}:\n" + "\n".join(
        violations
    )


def test_the_checker_resolves_relative_and_lazy_imports():
    source = (
        "from ..optim import optimizer\n"
        "from . import node\n"
        "def later():\n"
        "    import swarmtrain.averaging.matchmaking\n"
    )
    assert [m for _, m in imported_modules(source, ("dht", "probe"))] == [
        "swarmtrain.optim",
        "swarmtrain.dht.node",
        "swarmtrain.averaging.matchmaking",
    ]
    assert not {"optim", "averaging"} & allowed_imports("dht")
