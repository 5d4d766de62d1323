"""Blocking and asyncio facades generated from one async (trio) implementation.

A facade (``DHT``, ``DecentralizedAverager``, ...) is a :class:`~swarmtrain.utils.background.
BackgroundService` whose running service object lives on the background trio loop. Instead of
writing each method twice more by hand (blocking, asyncio), declare it once::

    class DHT(BackgroundService):
        store = forward(AsyncDHT.store, future_keyword="return_future")

- ``dht.store(...)`` blocks the calling thread until ``AsyncDHT.store`` returns on the loop
  (with ``return_future=True``: a ``concurrent.futures.Future`` at once);
- ``await dht.aio.store(...)`` awaits it from an asyncio loop without blocking that loop;
  cancelling the asyncio task cancels the trio call.

Both copy the implementation's docstring and signature (``inspect.signature``, ``help()``), so
IDEs show the real parameters. Errors propagate with their own types. ``aio`` namespaces are
generated per facade class from every ``forward`` (and :func:`aio_method`) it has.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["AioNamespace", "aio_method", "aio_namespace", "aio_property", "forward"]

_FORWARD_ATTR = "__swarmtrain_forward__"


def _service_method_name(impl: Callable[..., Any]) -> str:
    return impl.__name__


def _with_keyword(sig: inspect.Signature, name: str, default: Any) -> inspect.Signature:
    """``sig`` plus parameter ``name`` after the named ones (positional if they all are)."""
    params = list(sig.parameters.values())
    kinds = {p.kind for p in params}
    kind = (
        inspect.Parameter.KEYWORD_ONLY
        if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY}
        else inspect.Parameter.POSITIONAL_OR_KEYWORD
    )
    extra = inspect.Parameter(name, kind, default=default)
    var_kw = [i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD]
    params.insert(var_kw[0] if var_kw else len(params), extra)
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def forward(
    impl: Callable[..., Any],
    *,
    future_keyword: str | None = None,
    blocking: bool = True,
) -> Callable[..., Any]:
    """A blocking method calling ``await service.<impl's name>(...)`` on the background loop.

    :param impl: the async method of the service class (its name, docstring and signature are
      used); the facade's ``_running()`` gives ``(runtime, service)``
    :param future_keyword: a keyword-only flag (hivemind's ``return_future``) that, when true,
      returns a ``concurrent.futures.Future`` at once instead of blocking
    :param blocking: if False, return only a marker for the ``aio`` namespace (the facade keeps
      a hand-written blocking method of that name, e.g. one with hivemind's ``wait=`` flag)
    """
    if not inspect.iscoroutinefunction(impl):
        raise TypeError(f"forward() needs an async function, got {impl!r}")
    name = _service_method_name(impl)
    sig = inspect.signature(impl)

    blocking_sig = _with_keyword(sig, future_keyword, False) if future_keyword else sig

    def blocking_method(self, *args: Any, **kwargs: Any) -> Any:
        as_future = False
        if future_keyword:
            bound = blocking_sig.bind(self, *args, **kwargs)  # a TypeError here, not on the loop
            as_future = bool(bound.arguments.pop(future_keyword, False))
            args, kwargs = bound.args[1:], bound.kwargs
        runtime, service = self._running()
        call = functools.partial(getattr(service, name), *args, **kwargs)
        if as_future:
            return runtime.portal.start_task_soon(call)
        return runtime.call(call)

    functools.update_wrapper(blocking_method, impl)
    del blocking_method.__wrapped__  # inspect must use __signature__, not the async impl
    blocking_method.__signature__ = blocking_sig
    if future_keyword and blocking_method.__doc__ is not None:
        blocking_method.__doc__ += (
            f"\n\nBlocking; with ``{future_keyword}=True`` returns a "
            "``concurrent.futures.Future``. From asyncio: ``await obj.aio."
            f"{name}(...)``."
        )
    setattr(blocking_method, _FORWARD_ATTR, impl)
    if not blocking:
        return _AioOnly(impl)
    return blocking_method


class _AioOnly:
    """Marker for :func:`aio_method`: adds ``impl`` to ``aio`` only; not visible on instances."""

    def __init__(self, impl: Callable[..., Any]):
        setattr(self, _FORWARD_ATTR, impl)
        self._name = impl.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        raise AttributeError(f"{self._name} is only available as `await obj.aio.{self._name}()`")


def aio_method(impl: Callable[..., Any]) -> Any:
    """Declare ``impl`` for the ``aio`` namespace only (under the attribute name it gets)."""
    return forward(impl, blocking=False)


class AioNamespace:
    """Base of the generated ``obj.aio`` classes: asyncio awaitables over one facade object."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Any):
        self._owner = owner

    def __repr__(self) -> str:
        return f"<asyncio methods of {self._owner!r}>"


def _aio_function(name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
    async def aio(self: AioNamespace, *args: Any, **kwargs: Any) -> Any:
        await self._owner._aio_wait_ready()
        runtime, service = self._owner._running()
        return await runtime.call_asyncio(
            functools.partial(getattr(service, impl.__name__), *args, **kwargs)
        )

    functools.update_wrapper(aio, impl)
    del aio.__wrapped__
    aio.__name__ = name
    aio.__signature__ = inspect.signature(impl)
    return aio


def _collect(cls: type) -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            impl = getattr(value, _FORWARD_ATTR, None)
            if impl is not None:
                found[attr] = impl
            elif attr in found:
                del found[attr]  # overridden by a plain attribute
    return found


def aio_namespace(cls: type, *, name: str | None = None, doc: str | None = None) -> type:
    """The ``AioNamespace`` subclass with one awaitable per forwarded method of ``cls``."""
    methods = {attr: _aio_function(attr, impl) for attr, impl in _collect(cls).items()}
    namespace: dict[str, Any] = dict(methods)
    namespace["__doc__"] = doc or (
        f"asyncio awaitables over a :class:`{cls.__name__}` (reach them as ``obj.aio``); "
        "they never block the asyncio loop, and cancelling the awaiting task cancels the call."
    )
    namespace["__module__"] = cls.__module__
    namespace["__slots__"] = ()
    return type(name or f"Asyncio{cls.__name__}", (AioNamespace,), namespace)


class aio_property:
    """Class attribute ``aio = aio_property()``: ``obj.aio`` is the generated namespace."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = name

    def __get__(self, obj: Any, owner: type) -> Any:
        cls = owner.__dict__.get("_aio_class")
        if cls is None:
            cls = aio_namespace(owner)
            owner._aio_class = cls
        if obj is None:
            return cls
        return cls(obj)
