"""Give one py-libp2p object a method that reads some module constants differently.

py-libp2p reads a few tunables as module globals inside its methods (e.g. the happy-eyeballs
delay inside ``Swarm.dial_peer``). Assigning the module attribute would change every host in
the process. Instead, :func:`override_method_globals` binds, on one instance only, a copy of
the method whose global namespace is the module's own namespace seen through an overlay: the
names given are read from the overlay, every other name from the live module (so later
changes to the module stay visible), and functions defined inside the method inherit the
overlay. The class and the module stay as imported.

Two more forms of the same idea: :func:`subclass_with_globals` builds a subclass whose own
methods read some globals from an overlay (e.g. ``SwarmConn``'s ``logging.debug(...)`` calls,
which use the root logger), and :func:`override_method_imports` binds on one instance a copy of
a method whose function-local ``from module import Name`` gets our replacement for ``Name``
(e.g. the class ``Swarm.add_conn`` instantiates).
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
    setattr(obj, method_name, types.MethodType(_copy(function, overrides), obj))


def _copy(
    function: types.FunctionType,
    overrides: dict[str, Any],
    builtins: dict[str, Any] | None = None,
) -> types.FunctionType:
    """``function`` with its globals seen through an overlay of ``overrides`` (and, if given,
    ``builtins`` as its builtins)."""
    module_namespace = function.__globals__
    namespace = _Overlay(module_namespace, overrides)
    # builtins are looked up directly, not through the overlay's __missing__
    if builtins is None:
        builtins = module_namespace["__builtins__"]
    namespace["__builtins__"] = builtins
    # so are the names a relative import resolves against
    for name in ("__name__", "__package__", "__spec__"):
        if name in module_namespace:
            namespace.setdefault(name, module_namespace[name])
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
    return copy


def subclass_with_globals(cls: type, **overrides: Any) -> type:
    """A subclass of ``cls`` in which each method defined by ``cls`` itself (functions and
    property accessors) that reads one of the global names in ``overrides`` reads it from
    there; ``cls`` and its module stay as imported. Raises ``RuntimeError`` (libp2p internals
    changed) when no method of ``cls`` reads any of those names."""

    def reads_override(function: Any) -> bool:
        return isinstance(function, types.FunctionType) and bool(
            _names_used(function.__code__) & overrides.keys()
        )

    def scoped(function: Any) -> Any:
        return _copy(function, overrides) if reads_override(function) else function

    namespace: dict[str, Any] = {}
    for name, attribute in vars(cls).items():
        if reads_override(attribute):
            namespace[name] = _copy(attribute, overrides)
        elif isinstance(attribute, property) and any(
            reads_override(f) for f in (attribute.fget, attribute.fset, attribute.fdel)
        ):
            namespace[name] = property(
                scoped(attribute.fget),
                scoped(attribute.fset),
                scoped(attribute.fdel),
                attribute.__doc__,
            )
    if not namespace:
        raise RuntimeError(
            f"libp2p internals changed: no method of {cls.__name__} reads {sorted(overrides)}"
        )
    namespace["__module__"] = __name__
    namespace["__qualname__"] = f"Scoped{cls.__name__}"
    return type(cls)(f"Scoped{cls.__name__}", (cls,), namespace)


class _ModuleView:
    """A module as seen by one ``from module import ...``: some names replaced."""

    def __init__(self, module: types.ModuleType, replacements: dict[str, Any]):
        self.__name__ = module.__name__
        self._module = module
        self._replacements = replacements

    def __getattr__(self, name: str) -> Any:
        if name in self._replacements:
            return self._replacements[name]
        return getattr(self._module, name)


def override_method_imports(
    obj: Any, method_name: str, module_name: str, **replacements: Any
) -> None:
    """Bind on ``obj`` a copy of its class's ``method_name`` in which ``from <module_name>
    import X`` (a function-local import, relative or absolute) gives ``replacements[X]`` for
    the names given; every other import is the normal one. Raises ``RuntimeError`` (libp2p
    internals changed) when the method does not read those names."""
    function = getattr(type(obj), method_name, None)
    if not isinstance(function, types.FunctionType):
        raise RuntimeError(
            f"libp2p internals changed: {type(obj).__name__}.{method_name} is not a function"
        )
    missing = sorted(set(replacements) - _names_used(function.__code__))
    if missing:
        raise RuntimeError(
            f"libp2p internals changed: {type(obj).__name__}.{method_name} no longer imports "
            f"{missing}"
        )
    real_builtins = function.__globals__["__builtins__"]
    if isinstance(real_builtins, types.ModuleType):
        real_builtins = vars(real_builtins)
    real_import = real_builtins["__import__"]

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if fromlist and getattr(module, "__name__", None) == module_name:
            return _ModuleView(module, replacements)
        return module

    builtins = {**real_builtins, "__import__": scoped_import}
    setattr(obj, method_name, types.MethodType(_copy(function, {}, builtins), obj))
