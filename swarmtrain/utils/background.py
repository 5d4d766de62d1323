"""One background trio loop per process, for plain (blocking) code and asyncio code.

swarmtrain is written once, as trio/anyio coroutines. Code that is not running trio reaches it
through ``BackgroundRuntime``: a daemon thread running a trio loop behind an anyio blocking
portal, shared by every swarmtrain object of the process and stopped when the last one releases
it (so a clean shutdown leaves no thread behind).

- ``runtime.call(fn, *args)`` blocks the calling thread until ``fn`` finishes on the loop. A
  ``KeyboardInterrupt`` (or any exception) while waiting cancels the trio task before it
  propagates, so Ctrl-C never leaves work running in the background.
- ``await runtime.call_asyncio(fn, *args)`` is the same for asyncio code: the asyncio loop is
  never blocked, and cancelling the awaiting asyncio task (``wait_for`` timeouts included)
  cancels the trio task.
- After ``fork()`` (DataLoader workers) the child has no loop thread: every call raises a clear
  ``RuntimeError`` instead of hanging.
- Once an asyncio caller appears (``serve_asyncio``, called by the ``.aio`` ways in), the loop
  hands the GIL to the process's other threads during long busy stretches
  (``utils/gil_handoff.py``), so the asyncio loop is not held back for a whole epoch end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError as FutureCancelledError
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import AbstractAsyncContextManager, ExitStack, contextmanager
from typing import Any, TypeVar

import anyio
import trio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from swarmtrain.utils import exit_shutdown, gil_handoff

T = TypeVar("T")
logger = logging.getLogger(__name__)
#: seconds ``stop(timeout)`` still waits after cancelling a close that overran its timeout
_CANCEL_GRACE = 2.0


class BackgroundRuntime:
    """A refcounted trio loop in a daemon thread. Use ``acquire()`` / ``release()``."""

    _lock = threading.Lock()
    _instance: BackgroundRuntime | None = None

    def __init__(self) -> None:
        self._stack = ExitStack()
        self.portal: BlockingPortal = self._stack.enter_context(
            start_blocking_portal(backend="trio", name="swarmtrain-background-loop")
        )
        self._pid = os.getpid()
        self._refs = 0
        self._hand_off_lock = threading.Lock()
        self.hand_off: gil_handoff.GILHandOff | None = None

    # ------------------------------------------------------------ lifetime

    @classmethod
    def acquire(cls) -> BackgroundRuntime:
        """The process's runtime (started on first use); pair every call with ``release()``."""
        with cls._lock:
            runtime = cls._instance
            if runtime is None or runtime._pid != os.getpid():
                runtime = cls._instance = cls()
            runtime._refs += 1
            return runtime

    def release(self) -> None:
        """Drop one reference; the last one stops the loop and joins its thread."""
        with self._lock:
            self._refs -= 1
            if self._refs > 0:
                return
            if BackgroundRuntime._instance is self:
                BackgroundRuntime._instance = None
        if os.getpid() == self._pid:
            # Nothing holds the loop now, so a task still on it is orphaned (a shutdown that an
            # exception interrupted before it stopped its service, e.g. pytest-timeout's signal):
            # cancel it instead of waiting for it forever.
            try:
                self.portal.call(self.portal.stop, True)
            except RuntimeError:
                pass  # the loop already stopped
            self._stack.close()

    @classmethod
    def active_references(cls) -> int:
        runtime = cls._instance
        return runtime._refs if runtime is not None else 0

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                "this swarmtrain object was created in another process (before a fork, e.g. "
                "in a DataLoader worker); create swarmtrain objects in the process that uses them"
            )

    # --------------------------------------------------------------- calls

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``await fn(*args)`` on the loop and block until it returns (Ctrl-C safe)."""
        self._check_process()
        future = self.portal.start_task_soon(fn, *args)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # the portal cancels the trio task when its future is cancelled
            raise

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a plain function on the loop thread (for state that only the loop may touch)."""
        self._check_process()
        return self.portal.call(fn, *args)

    def serve_asyncio(self) -> None:
        """An asyncio loop in this process calls in: from now on the loop hands the GIL over
        during long busy stretches (``gil_handoff.GILHandOff``). Idempotent, never blocks."""
        if self.hand_off is not None or gil_handoff.disabled():
            return
        with self._hand_off_lock:
            if self.hand_off is not None:
                return
            self.hand_off = gil_handoff.GILHandOff()
        self.portal.start_task_soon(self._add_instrument, self.hand_off)

    @staticmethod
    async def _add_instrument(instrument: trio.abc.Instrument) -> None:
        trio.lowlevel.add_instrument(instrument)

    async def call_asyncio(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From asyncio: ``await`` ``fn(*args)`` running on the trio loop, without blocking."""
        self._check_process()
        self.serve_asyncio()
        future: Future = self.portal.start_task_soon(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except (asyncio.CancelledError, FutureCancelledError):
            future.cancel()
            raise

    def start_service(
        self, factory: Callable[[], AbstractAsyncContextManager[T]]
    ) -> tuple[T, Callable[..., None]]:
        """Enter ``factory()`` in its own task on the loop; return (value, stop).

        ``stop(timeout=None)`` leaves the context and waits for it; after ``timeout`` seconds
        it cancels the closing task, waits at most ``_CANCEL_GRACE`` seconds more, and
        returns (with a warning) whether or not the close finished."""
        self._check_process()
        stopped: Future[None] = Future()

        closed = threading.Event()  # set when the task has left, even cancelled

        async def serve(*, task_status=anyio.TASK_STATUS_IGNORED) -> None:
            try:
                stop_event = anyio.Event()
                async with factory() as value:
                    task_status.started((value, stop_event))
                    await stop_event.wait()
            finally:
                closed.set()

        future, (value, stop_event) = self.portal.start_task(serve)

        def stop(timeout: float | None = None) -> None:
            if stopped.done():
                return
            stopped.set_result(None)
            self.portal.call(stop_event.set)
            try:
                future.result(timeout)
            except FutureTimeoutError:
                future.cancel()  # the portal cancels the trio task: its close is cut short
                closed.wait(_CANCEL_GRACE)
                logger.warning("closing %r took over %s s: cancelled it", factory, timeout)

        return value, stop

    @contextmanager
    def wrap_async_context_manager(self, cm: AbstractAsyncContextManager[T]) -> Iterator[T]:
        """Use an async context manager from blocking code (entered and exited in one task)."""
        self._check_process()
        with self.portal.wrap_async_context_manager(cm) as value:
            yield value


class BackgroundService:
    """Base of the blocking facades (``DHT``, ``DecentralizedAverager``, ``ProgressTracker``):
    one trio async-context object kept open on the background loop until ``shutdown()``.

    Subclasses call ``_start_in_background(factory)`` once and reach the running object with
    ``_running()``; ``shutdown`` is idempotent and releases the loop.
    """

    _service_name = "this object"
    _runtime: BackgroundRuntime | None = None
    _service: Any = None
    _stop: Callable[..., None] | None = None
    _shut_down = False
    _pid: int | None = None  # the process that started it

    def _start_in_background(self, factory: Callable[[], AbstractAsyncContextManager[T]]) -> T:
        if self._runtime is not None or self._shut_down:
            raise RuntimeError(f"{self._service_name} was already started")
        runtime = BackgroundRuntime.acquire()
        try:
            self._service, self._stop = runtime.start_service(factory)
        except BaseException:
            runtime.release()
            raise
        self._runtime = runtime
        self._pid = os.getpid()
        exit_shutdown.track(self)  # a script that ends without shutdown() still leaves cleanly
        return self._service

    def _forked(self) -> bool:
        """Whether this is a child forked after the object started (its loop thread is gone)."""
        return self._pid is not None and self._pid != os.getpid()

    def is_alive(self) -> bool:
        return self._runtime is not None and not self._shut_down and not self._forked()

    def shutdown(self, timeout: float | None = None) -> None:
        """Close the object; the background loop stops when nothing else uses it.

        ``timeout``: after this many seconds the close is cancelled (a peer whose network is
        gone cannot say goodbye); None waits for it.

        In a process forked after the object started, this only marks it shut down here: the
        host, its sockets and its loop belong to the parent.
        """
        if self._shut_down:
            return
        self._shut_down = True
        exit_shutdown.forget(self)
        if self._runtime is None or self._forked():
            return
        try:
            if self._stop is not None:
                self._stop(timeout)
        finally:
            self._runtime.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    async def _aio_wait_ready(self) -> None:
        """For ``obj.aio`` calls: wait (without blocking asyncio) until ``_running()`` is ready."""

    def _running(self) -> tuple[BackgroundRuntime, Any]:
        if self._forked():
            raise RuntimeError(
                f"{self._service_name} was created in process {self._pid}, and this is process "
                f"{os.getpid()} (forked from it, e.g. a DataLoader worker): its background loop "
                "does not exist here. Create it after the fork, in the process that uses it"
            )
        if self._runtime is None or self._service is None:
            raise RuntimeError(f"{self._service_name} is not running: start it first")
        if self._shut_down:
            raise RuntimeError(f"{self._service_name} was shut down")
        return self._runtime, self._service
