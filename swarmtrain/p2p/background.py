"""``BackgroundP2P``: the same ``P2P`` host for plain (blocking) code and for asyncio code.

The host runs on swarmtrain's background trio loop (``swarmtrain.utils.background``); this class
only forwards calls. Blocking use::

    with BackgroundP2P(initial_peers=[...]) as p2p:
        reply = p2p.call_protobuf_handler(peer_id, "demo::Echo.reverse", request, StringValue)

asyncio use (the asyncio loop is never blocked; cancelling the asyncio task cancels the call)::

    p2p = BackgroundP2P(...)
    reply = await p2p.aio.call_protobuf_handler(peer_id, name, request, StringValue)
    p2p.shutdown()

Handlers registered here may be plain functions (run in a worker thread), asyncio coroutine
functions (registered through ``p2p.aio``: run on the registering asyncio loop), or trio
coroutine functions (run on the background loop). Streaming handlers must be trio async
generators registered on a trio ``P2P``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio

from swarmtrain.p2p.host import P2P
from swarmtrain.utils.background import BackgroundRuntime, BackgroundService


def _thread_handler(handler):
    @functools.wraps(handler)
    async def run_in_thread(request, context):
        return await trio.to_thread.run_sync(handler, request, context)

    return run_in_thread


def _asyncio_handler(handler, loop: asyncio.AbstractEventLoop):
    @functools.wraps(handler)
    async def run_on_asyncio_loop(request, context):
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        future = asyncio.run_coroutine_threadsafe(handler(request, context), loop)
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()

    return run_on_asyncio_loop


class BackgroundP2P(BackgroundService):
    """A ``P2P`` host on the background loop. Same keywords as ``P2P.create``."""

    _service_name = "the host"

    def __init__(self, initial_peers=(), **kwargs: Any):
        self._p2p = self._start_in_background(lambda: P2P.create(initial_peers, **kwargs))
        self.peer_id = self._p2p.peer_id
        self.aio = AsyncioP2P(self)

    @property
    def _loop(self) -> BackgroundRuntime:
        runtime = self._runtime
        assert runtime is not None  # set by _start_in_background in __init__, never reset
        return runtime

    def get_visible_maddrs(self) -> list[str]:
        return self._loop.call_sync(self._p2p.get_visible_maddrs)

    def get_connected_peers(self) -> list:
        return self._loop.call_sync(self._p2p.get_connected_peers)

    def add_protobuf_handler(self, name: str, handler, input_protobuf_type, **kwargs) -> None:
        """Register ``handler`` (a plain function runs in a worker thread)."""
        if not inspect.iscoroutinefunction(handler) and not inspect.isasyncgenfunction(handler):
            handler = _thread_handler(handler)
        self._loop.call_sync(
            functools.partial(
                self._p2p.add_protobuf_handler, name, handler, input_protobuf_type, **kwargs
            )
        )

    def call_protobuf_handler(self, peer, name, request, output_protobuf_type, **kwargs):
        """Blocking ``P2P.call_protobuf_handler`` (Ctrl-C cancels the call)."""
        return self._loop.call(
            functools.partial(
                self._p2p.call_protobuf_handler, peer, name, request, output_protobuf_type, **kwargs
            )
        )

    @contextmanager
    def iterate_protobuf_handler(
        self, peer, name, request, output_protobuf_type, **kwargs
    ) -> Iterator[Iterator]:
        """Blocking ``P2P.iterate_protobuf_handler``: ``with ... as responses: for r in ...``."""
        cm = self._p2p.iterate_protobuf_handler(peer, name, request, output_protobuf_type, **kwargs)
        with self._loop.wrap_async_context_manager(cm) as responses:
            yield _BlockingIterator(self._loop, responses)


class _BlockingIterator:
    def __init__(self, runtime: BackgroundRuntime, responses):
        self._runtime, self._responses = runtime, responses

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return self._runtime.call(self._responses.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None


class AsyncioP2P:
    """asyncio awaitables over a ``BackgroundP2P`` (reach it as ``background_p2p.aio``)."""

    def __init__(self, owner: BackgroundP2P):
        self._owner = owner
        self._runtime = owner._loop
        self._p2p = owner._p2p
        self.peer_id = owner.peer_id

    def add_protobuf_handler(self, name: str, handler, input_protobuf_type, **kwargs) -> None:
        """Register an asyncio coroutine function; it runs on the current asyncio loop."""
        if inspect.iscoroutinefunction(handler):
            handler = _asyncio_handler(handler, asyncio.get_running_loop())
        self._owner.add_protobuf_handler(name, handler, input_protobuf_type, **kwargs)

    async def call_protobuf_handler(self, peer, name, request, output_protobuf_type, **kwargs):
        return await self._runtime.call_asyncio(
            functools.partial(
                self._p2p.call_protobuf_handler, peer, name, request, output_protobuf_type, **kwargs
            )
        )

    @asynccontextmanager
    async def iterate_protobuf_handler(
        self, peer, name, request, output_protobuf_type, **kwargs
    ) -> AsyncIterator[AsyncIterator]:
        """``async with ... as responses: async for r in responses`` from asyncio."""
        entered: Future = Future()
        leave = trio.Event()

        async def hold_call() -> None:
            # The trio context manager is entered and exited in this one trio task.
            try:
                async with self._p2p.iterate_protobuf_handler(
                    peer, name, request, output_protobuf_type, **kwargs
                ) as responses:
                    entered.set_result(responses)
                    await leave.wait()
            except BaseException as e:
                if not entered.done():
                    entered.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                raise

        holder = self._runtime.portal.start_task_soon(hold_call)
        try:
            responses = await asyncio.wrap_future(entered)
            yield _AsyncioIterator(self._runtime, responses)
        finally:
            try:
                self._runtime.portal.call(leave.set)
            except RuntimeError:
                pass
            try:
                await asyncio.wrap_future(holder)
            except asyncio.CancelledError:
                raise
            except Exception:
                pass


class _AsyncioIterator:
    def __init__(self, runtime: BackgroundRuntime, responses):
        self._runtime, self._responses = runtime, responses

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._runtime.call_asyncio(self._responses.__anext__)
