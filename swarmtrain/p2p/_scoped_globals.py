"""Give one py-libp2p object a method that reads some module constants differently.

py-libp2p reads a few tunables as module globals inside its methods (e.g. the happy-eyeballs
delay inside ``Swarm.dial_peer``). Assigning the module attribute would change every host in
the process. Instead, :func:`override_method_globals` binds, on one instance only, a copy of
the method whose global namespace is the module's own namespace seen through an overlay: the
names given are read from the overlay, every other name from the live module (so later
changes to the module stay visible), and functions defined inside the method inherit the
overlay. The class and the module stay as imported.
"""

from __future__ import annotations

import types
from typing import Any


class _Overlay(dict):
    """A global namespace: the overrides first, then the module's live namespace."""

    def __init__(self, module_namespace: dict[str, Any], overrides: dict[str, Any]):
        super().__init__(overrides)
        self._module_namespace = module_namespace

    def __missing__(self, name: str) -> Any:
        return self._module_namespace[name]


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def override_method_globals(obj: Any, method_name: str, **overrides: Any) -> None:
    """Bind on ``obj`` a copy of its class's ``method_name`` that reads the global names in
    ``overrides`` from there. Raises ``RuntimeError`` (libp2p internals changed) when the
    method no longer reads one of those names or the module no longer defines it."""
    function = getattr(type(obj), method_name, None)
    if not isinstance(function, types.FunctionType):
        raise RuntimeError(
            f"libp2p internals changed: {type(obj).__name__}.{method_name} is not a function"
        )
    module_namespace = function.__globals__
    missing = [
        name
        for name in overrides
        if name not in module_namespace or name not in _names_used(function.__code__)
    ]
    if missing:
        raise RuntimeError(
            f"libp2p internals changed: {type(obj).__name__}.{method_name} no longer reads "
            f"the module global(s) {missing}"
        )
    namespace = _Overlay(module_namespace, overrides)
    # builtins are looked up directly, not through the overlay's __missing__
    namespace["__builtins__"] = module_namespace["__builtins__"]
    copy = types.FunctionType(
        function.__code__,
        namespace,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__wrapped__ = function  # type: ignore[attr-defined]
    setattr(obj, method_name, types.MethodType(copy, obj))
