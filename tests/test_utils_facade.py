"""``swarmtrain.utils.facade``: blocking and asyncio methods generated from one trio service.

A tiny trio service runs on the real background loop (no mocks): the generated methods must
keep signatures and docstrings, propagate errors with their own types, and cancel the trio call
when the awaiting asyncio task is cancelled. asyncio tests use anyio's plugin (asyncio backend);
this module does not use pytest-trio.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager

import pytest
import trio

from swarmtrain.utils.background import BackgroundRuntime, BackgroundService
from swarmtrain.utils.facade import (
    AioNamespace,
    ThreadAioNamespace,
    aio_property,
    forward,
    run_in_worker_thread,
    thread_aio_property,
)


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Echo:
    """The trio side."""

    def __init__(self) -> None:
        self.hang_started = threading.Event()
        self.hang_cancelled = threading.Event()

    async def add(self, a: int, b: int = 1) -> int:
        """Add ``b`` to ``a``."""
        await trio.lowlevel.checkpoint()
        return a + b

    async def fail(self, key: str) -> None:
        """Raise KeyError(key)."""
        raise KeyError(key)

    async def hang(self) -> None:
        self.hang_started.set()
        try:
            await trio.sleep_forever()
        finally:
            self.hang_cancelled.set()

    async def wait_twice(self) -> str:
        return "waited"


@asynccontextmanager
async def serve_echo() -> AsyncIterator[Echo]:
    yield Echo()


class EchoFacade(BackgroundService):
    add = forward(Echo.add, future_keyword="return_future")
    fail = forward(Echo.fail)
    hang = forward(Echo.hang)
    aio = aio_property()
    _aio_methods = {"wait_twice": Echo.wait_twice}

    def __init__(self) -> None:
        self.echo: Echo = self._start_in_background(serve_echo)


@pytest.fixture
def facade():
    with EchoFacade() as echo:
        yield echo
    assert BackgroundRuntime.active_references() == 0


# ------------------------------------------------------------------ generated surface


def test_blocking_methods_copy_name_docstring_and_signature():
    assert EchoFacade.add.__name__ == "add"
    assert EchoFacade.add.__doc__.startswith("Add ``b`` to ``a``.")
    assert "return_future=True" in EchoFacade.add.__doc__
    params = inspect.signature(EchoFacade.add).parameters
    assert list(params) == ["self", "a", "b", "return_future"]
    assert params["b"].default == 1 and params["return_future"].default is False
    assert list(inspect.signature(EchoFacade.fail).parameters) == ["self", "key"]
    assert not inspect.iscoroutinefunction(EchoFacade.add)


def test_aio_namespace_has_awaitables_with_the_implementations_signatures():
    aio = EchoFacade.aio
    assert issubclass(aio, AioNamespace) and aio.__name__ == "AsyncioEchoFacade"
    assert sorted(n for n in vars(aio) if not n.startswith("_")) == [
        "add",
        "fail",
        "hang",
        "wait_twice",
    ]
    assert inspect.iscoroutinefunction(aio.add)
    assert inspect.signature(aio.add) == inspect.signature(Echo.add)
    assert aio.add.__doc__ == Echo.add.__doc__
    assert "return_future" not in inspect.signature(aio.add).parameters


def test_forward_needs_an_async_implementation():
    with pytest.raises(TypeError, match="async function"):
        forward(lambda self: None)


def test_thread_aio_copies_the_blocking_signature():
    class Blocking:
        def work(self, x: int, *, scale: float = 2.0) -> float:
            """Scale x."""
            return x * scale

        aio = thread_aio_property("work")

    assert issubclass(Blocking.aio, ThreadAioNamespace)
    assert inspect.signature(Blocking.aio.work) == inspect.signature(Blocking.work)
    assert Blocking.aio.work.__doc__.startswith("Scale x.")


# -------------------------------------------------------------------- blocking calls


def test_blocking_calls_return_results_futures_and_raise_the_same_errors(facade):
    assert facade.add(2) == 3
    assert facade.add(2, b=5) == 7
    future = facade.add(2, 3, True)  # hivemind passes return_future positionally too
    assert isinstance(future, Future) and future.result(10) == 5
    assert facade.add(1, return_future=True).result(10) == 2
    with pytest.raises(KeyError, match="missing"):
        facade.fail("missing")
    with pytest.raises(TypeError):
        facade.add(1, 2, False, 4)  # checked in the caller's thread


def test_calls_after_shutdown_raise_runtime_error():
    echo = EchoFacade()
    echo.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        echo.add(1)


# ---------------------------------------------------------------------- asyncio calls


@pytest.mark.anyio
async def test_aio_calls_return_and_raise_the_same_errors(facade):
    assert await facade.aio.add(2, b=2) == 4
    assert await facade.aio.wait_twice() == "waited"
    with pytest.raises(KeyError, match="missing"):
        await facade.aio.fail("missing")
    with pytest.raises(TypeError):
        await facade.aio.add()


@pytest.mark.anyio
async def test_cancelling_an_aio_call_cancels_the_trio_call(facade):
    task = asyncio.create_task(facade.aio.hang())
    assert await asyncio.to_thread(facade.echo.hang_started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(facade.echo.hang_cancelled.wait, 10)
    assert await facade.aio.add(1) == 2  # the service goes on


@pytest.mark.anyio
async def test_aio_timeouts_cancel_the_trio_call(facade):
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(facade.aio.hang(), 0.2)
    assert await asyncio.to_thread(facade.echo.hang_cancelled.wait, 10)


@pytest.mark.anyio
async def test_a_blocking_constructor_runs_off_the_loop():
    release = threading.Event()
    loop_ran = asyncio.Event()

    def slow_constructor(value: int) -> int:
        assert release.wait(10)
        return value

    async def tick() -> None:
        loop_ran.set()
        release.set()

    creating = asyncio.create_task(run_in_worker_thread(slow_constructor, 7))
    await asyncio.gather(tick(), asyncio.sleep(0))
    assert loop_ran.is_set() and await creating == 7


@pytest.mark.anyio
async def test_an_abandoned_construction_is_shut_down():
    started, release, closed = threading.Event(), threading.Event(), threading.Event()

    class Made:
        def __init__(self) -> None:
            started.set()
            assert release.wait(10)

        def shutdown(self) -> None:
            closed.set()

    creating = asyncio.create_task(run_in_worker_thread(Made))
    assert await asyncio.to_thread(started.wait, 10)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    release.set()
    assert await asyncio.to_thread(closed.wait, 10)


# ------------------------------------------------------------------ shutdown timeout


class HangingClose(BackgroundService):
    """A service whose close never finishes by itself (a goodbye to a peer that is gone)."""

    def __init__(self) -> None:
        self.close_cancelled = threading.Event()

        @asynccontextmanager
        async def serve() -> AsyncIterator[None]:
            try:
                yield None
            finally:
                try:
                    await trio.sleep_forever()
                finally:
                    self.close_cancelled.set()

        self._start_in_background(serve)


def test_shutdown_timeout_cancels_a_close_that_hangs(caplog):
    service = HangingClose()
    service.shutdown(timeout=0.2)
    assert service.close_cancelled.is_set()  # cut short (and waited for), not left running
    assert "cancelled it" in caplog.text
    assert BackgroundRuntime.active_references() == 0


class Serving(BackgroundService):
    """A service that runs until stopped, and says when its task ended."""

    def __init__(self) -> None:
        self.ended = threading.Event()

        @asynccontextmanager
        async def serve() -> AsyncIterator[None]:
            try:
                yield None
            finally:
                self.ended.set()

        self._start_in_background(serve)


def test_the_last_release_cancels_a_service_whose_shutdown_was_interrupted():
    # An exception that lands inside shutdown() (pytest-timeout's signal, Ctrl-C) after the
    # reference is dropped but before the service was told to stop: the loop's last release
    # used to wait for that service forever (a hung test teardown).
    orphan = Serving()
    runtime = orphan._runtime
    assert runtime is not None
    orphan._shut_down = True  # what shutdown() did before the exception
    done = threading.Event()

    def release() -> None:
        runtime.release()  # the shutdown's `finally`, without the stop
        done.set()

    threading.Thread(target=release, daemon=True).start()
    assert done.wait(10), "the last release waited for the orphaned service"
    assert orphan.ended.is_set()
    assert BackgroundRuntime.active_references() == 0
