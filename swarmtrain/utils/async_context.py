"""Async context managers that say how to use them when awaited instead.

hivemind creates its objects with ``await X.create(...)``; ours are trio async context managers
(``async with X.create(...) as x:``), which own their background tasks. Awaiting one used to
fail with Python's generic "object _AsyncGeneratorContextManager can't be used in 'await'
expression"; :func:`async_context_only` makes it a ``TypeError`` naming our form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

__all__ = ["async_context_only"]

T = TypeVar("T")


class _AsyncContextOnly(AbstractAsyncContextManager):
    """An async context manager (delegating to ``manager``) that refuses ``await``."""

    __slots__ = ("_hint", "_manager")

    def __init__(self, manager: AbstractAsyncContextManager, hint: str):
        self._manager = manager
        self._hint = hint

    async def __aenter__(self) -> Any:
        return await self._manager.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._manager.__aexit__(*exc_info)

    def __await__(self) -> Any:
        raise TypeError(self._hint)


def async_context_only(
    hint: str,
) -> Callable[[Callable[..., AbstractAsyncContextManager[T]]], Callable[..., Any]]:
    """Decorate a function returning an async context manager (put it above
    ``@asynccontextmanager``): ``await f(...)`` raises ``TypeError(hint)``."""

    def decorate(function: Callable[..., AbstractAsyncContextManager[T]]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> AbstractAsyncContextManager[T]:
            return _AsyncContextOnly(function(*args, **kwargs), hint)

        return wrapper

    return decorate
