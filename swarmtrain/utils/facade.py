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
generated per facade class from every ``forward`` it has, plus its ``_aio_methods`` mapping
(``{"step": AsyncImpl.step}``) for methods whose blocking form is written by hand because it
keeps a hivemind flag that changes the return type (``wait=False``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "AioNamespace",
    "ThreadAioNamespace",
    "close_aio_worker",
    "run_in_worker_thread",
    "thread_aio_property",
    "aio_namespace",
    "aio_property",
    "forward",
]

_FORWARD_ATTR = "__swarmtrain_forward__"


def _service_method_name(impl: Callable[..., Any]) -> str:
    return impl.__name__


def _set_signature(func: Callable[..., Any], signature: inspect.Signature) -> None:
    """Make ``inspect.signature(func)`` return ``signature``: drop the ``__wrapped__`` that
    ``functools.update_wrapper`` set (inspect would follow it to the implementation)."""
    target: Any = func  # a function takes any attribute; its type declares neither of these
    del target.__wrapped__
    target.__signature__ = signature


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
) -> Callable[..., Any]:
    """A blocking method calling ``await service.<impl's name>(...)`` on the background loop.

    :param impl: the async method of the service class (its name, docstring and signature are
      used); the facade's ``_running()`` gives ``(runtime, service)``
    :param future_keyword: a keyword-only flag (hivemind's ``return_future``) that, when true,
      returns a ``concurrent.futures.Future`` at once instead of blocking
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
    _set_signature(blocking_method, blocking_sig)  # not the async impl's
    if future_keyword and blocking_method.__doc__ is not None:
        blocking_method.__doc__ += (
            f"\n\nBlocking; with ``{future_keyword}=True`` returns a "
            "``concurrent.futures.Future``. From asyncio: ``await obj.aio."
            f"{name}(...)``."
        )
    setattr(blocking_method, _FORWARD_ATTR, impl)
    return blocking_method


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
    aio.__name__ = name
    _set_signature(aio, inspect.signature(impl))
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
        found.update(vars(klass).get("_aio_methods", {}))
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
            target: Any = owner  # a class takes new attributes; `type` declares none
            target._aio_class = cls
        if obj is None:
            return cls
        return cls(obj)


# ----------------------------------------------------------------- thread-based facades


class ThreadAioNamespace:
    """Base of the generated ``obj.aio`` classes of blocking objects that run their own threads
    (``Optimizer``, ``DiLoCoOptimizer``): each awaitable runs the blocking method in the
    object's one ``swarmtrain-aio`` worker thread, so calls run one at a time and in order.

    Cancelling the awaiting asyncio task does not interrupt a call already running (a step
    half-applied would corrupt the training state): it finishes in the worker, and the next
    call waits for it.
    """

    __slots__ = ("_owner",)

    def __init__(self, owner: Any):
        self._owner = owner

    def __repr__(self) -> str:
        return f"<asyncio methods of {self._owner!r}>"


def _worker(owner: Any) -> Any:
    worker = owner.__dict__.get("_aio_worker")
    if worker is None:
        from concurrent.futures import ThreadPoolExecutor

        worker = owner.__dict__.setdefault(
            "_aio_worker", ThreadPoolExecutor(1, thread_name_prefix="swarmtrain-aio")
        )
    return worker


def close_aio_worker(owner: Any) -> None:
    """Let ``owner``'s aio worker thread end (call it from the owner's ``shutdown``)."""
    worker = owner.__dict__.get("_aio_worker")
    if worker is not None:
        worker.shutdown(wait=False)


def _serve_asyncio(obj: Any) -> None:
    """Tell the background runtime of ``obj`` (if it runs) that an asyncio loop calls in."""
    runtime = getattr(obj, "_runtime", None)
    if runtime is None or getattr(obj, "_shut_down", False):
        return
    if getattr(obj, "_pid", None) != os.getpid():
        return
    with contextlib.suppress(RuntimeError):  # its loop stopped: the call itself will say so
        runtime.serve_asyncio()


def _thread_aio_function(name: str, blocking: Callable[..., Any]) -> Callable[..., Any]:
    async def aio(self: ThreadAioNamespace, *args: Any, **kwargs: Any) -> Any:
        import asyncio

        _serve_asyncio(self._owner)
        method = getattr(self._owner, name)
        call = functools.partial(method, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(_worker(self._owner), call)

    functools.update_wrapper(aio, blocking)
    _set_signature(aio, inspect.signature(blocking))
    aio.__doc__ = (blocking.__doc__ or "") + (
        f"\n\nFrom asyncio: ``await obj.aio.{name}(...)`` runs this in the object's worker "
        "thread; the asyncio loop is never blocked."
    )
    return aio


class thread_aio_property:
    """Class attribute ``aio = thread_aio_property("step", ...)``: ``obj.aio`` has an awaitable
    per named blocking method (see :class:`ThreadAioNamespace`)."""

    def __init__(self, *names: str):
        self._names = names

    def __set_name__(self, owner: type, name: str) -> None:
        methods: dict[str, Any] = {
            n: _thread_aio_function(n, getattr(owner, n)) for n in self._names
        }
        methods["__doc__"] = (
            f"asyncio awaitables over a :class:`{owner.__name__}` (reach them as ``obj.aio``)."
        )
        methods["__module__"] = owner.__module__
        methods["__slots__"] = ()
        self._class = type(f"Asyncio{owner.__name__}", (ThreadAioNamespace,), methods)

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self._class
        return self._class(obj)


async def run_in_worker_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """From asyncio: ``fn(*args, **kwargs)`` in a fresh daemon thread (for constructors that
    block for seconds); the loop is never blocked. Cancelling the await does not stop ``fn``:
    if it was cancelled, the object it made is shut down when it is ready."""
    import asyncio
    import threading
    from concurrent.futures import Future, InvalidStateError

    future: Future = Future()  # cancelled by wrap_future when the awaiting task is

    def run() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(e)
            return
        _serve_asyncio(result)
        try:
            future.set_result(result)
        except InvalidStateError:  # the caller is gone: nobody else can close it
            shutdown = getattr(result, "shutdown", None)
            if shutdown is not None:
                shutdown()

    threading.Thread(target=run, name="swarmtrain-aio-create", daemon=True).start()
    return await asyncio.wrap_future(future)
