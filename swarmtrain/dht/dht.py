"""``DHT``: a P2P host and a DHT node behind hivemind's names, for trio, asyncio and plain code.

One implementation (``AsyncDHT``, trio), three ways in:

- trio: ``async with DHT.create(initial_peers=[...]) as dht: await dht.store(...)``;
- plain (blocking) code: ``dht = DHT(initial_peers=[...]); dht.store(...); dht.shutdown()``,
  running on swarmtrain's one background trio loop (``swarmtrain.utils.background``);
- asyncio: the same blocking object's ``await dht.aio.store(...)``, which never blocks the asyncio
  loop (cancelling the asyncio task cancels the DHT call).

Resource handling: ``DHT.create`` owns its host and node and closes both on exit. A blocking
``DHT`` holds one reference to the background loop from ``run_in_background`` (done by the
constructor unless ``start=False``) until ``shutdown()``; the loop thread ends with the last
reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import asynccontextmanager
from typing import Any, ClassVar, TypeVar

from swarmtrain.p2p import P2P, PeerID
from swarmtrain.utils.async_context import async_context_only
from swarmtrain.utils.background import BackgroundService
from swarmtrain.utils.facade import aio_namespace, aio_property, forward

from .node import DHTNode, DHTNodeConfig, check_hivemind_only_keywords
from .storage import DHTExpiration, ValueWithExpiration
from .validation import RecordValidatorBase

__all__ = ["DHT", "AsyncDHT", "AsyncioDHT"]

T = TypeVar("T")
#: keywords of ``DHTNode.create`` (the rest go to ``P2P.create``)
_NODE_FIELDS = frozenset(f.name for f in dataclasses.fields(DHTNodeConfig)) | {"node_id"}


class AsyncDHT:
    """The trio DHT: a running ``P2P`` host (``.p2p``) and ``DHTNode`` (``.node``)."""

    def __init__(self, p2p: P2P, node: DHTNode):
        self.p2p, self.node = p2p, node
        self.peer_id: PeerID = p2p.peer_id

    @property
    def client_mode(self) -> bool:
        return self.node.config.client_mode

    def get_visible_maddrs(self) -> list[str]:
        """Multiaddrs other peers can pass as ``initial_peers`` (empty in client mode)."""
        return self.p2p.get_visible_maddrs()

    async def store(
        self, key: Any, value: Any, expiration_time: DHTExpiration, subkey: Any = None
    ) -> bool:
        """See :meth:`DHTNode.store`."""
        return await self.node.store(key, value, expiration_time, subkey=subkey)

    async def get(self, key: Any, latest: bool = False) -> ValueWithExpiration[Any] | None:
        """See :meth:`DHTNode.get`."""
        return await self.node.get(key, latest=latest)

    async def get_many(
        self, keys: Collection[Any], latest: bool = False
    ) -> dict[Any, ValueWithExpiration[Any] | None]:
        """See :meth:`DHTNode.get_many`: several keys in one search."""
        return await self.node.get_many(list(keys), latest=latest)

    async def run_coroutine(self, coro_fn: Callable[[AsyncDHT, DHTNode], Awaitable[T]]) -> T:
        """Run ``await coro_fn(dht, node)`` on swarmtrain's trio loop and return its result.

        ``dht`` is the trio-side :class:`AsyncDHT` (await its methods there; the blocking
        ``DHT``'s methods would deadlock the loop).
        """
        try:
            return await coro_fn(self, self.node)
        except RuntimeError as e:
            if str(e) != "no running event loop":  # asyncio's words, called outside asyncio
                raise
            raise RuntimeError(
                "run_coroutine runs coro_fn on swarmtrain's trio loop, where asyncio calls "
                "(asyncio.sleep, asyncio.gather, ...) find no running event loop: await trio's "
                "or anyio's equivalents there (anyio.sleep), or await dht.aio's methods from "
                "your own asyncio code"
            ) from e

    def add_validators(self, record_validators: Sequence[RecordValidatorBase]) -> None:
        """See :meth:`DHTNode.add_validators`."""
        self.node.add_validators(record_validators)


class DHT(BackgroundService):
    """hivemind's ``DHT`` on the background trio loop (see the module docstring).

    Keywords: those of ``P2P.create`` (``client_mode``, ``host_maddrs``, ``announce_maddrs``,
    ``identity_path``, ...), ``record_validators``, and :class:`DHTNodeConfig` fields
    (``num_replicas``, ``bucket_size``, ``wait_timeout``, ...). ``client_mode`` applies to both.
    """

    _aio_class: ClassVar[type]  #: ``dht.aio``'s class (set below)

    def __init__(
        self,
        initial_peers: Sequence[str] | None = (),
        *,
        start: bool = True,
        await_ready: bool = True,
        **kwargs: Any,
    ):
        if isinstance(initial_peers, str):
            raise TypeError("initial_peers must be a list of multiaddr strings, not one string")
        if "p2p" in kwargs:
            raise TypeError(
                "DHT(p2p=...) is not supported: a blocking DHT owns its host. To run several "
                "components on one host, use trio: `async with P2P.create(...) as p2p, "
                "DHTNode.create(p2p, ...) as node:`"
            )
        check_hivemind_only_keywords(kwargs)
        self._initial_peers = list(initial_peers or ())  # None: hivemind's "no peers"
        self._kwargs = kwargs
        self._ready: Future | None = None
        if start:
            self.run_in_background(await_ready=await_ready)

    @classmethod
    @async_context_only(
        "DHT.create(...) is a trio async context manager: `async with DHT.create(...) as dht:`; "
        "hivemind's blocking form is DHT(...), with asyncio awaitables at DHT(...).aio"
    )
    @asynccontextmanager
    async def create(
        cls,
        initial_peers: Sequence[str] | None = (),
        *,
        record_validators: Sequence[Any] = (),
        client_mode: bool = False,
        **kwargs: Any,
    ) -> AsyncIterator[AsyncDHT]:
        """trio: start a host and a node, yield an :class:`AsyncDHT`; close both on exit."""
        check_hivemind_only_keywords(kwargs)
        node_kwargs = {k: v for k, v in kwargs.items() if k in _NODE_FIELDS}
        p2p_kwargs = {k: v for k, v in kwargs.items() if k not in _NODE_FIELDS}
        async with P2P.create(initial_peers, client_mode=client_mode, **p2p_kwargs) as p2p:
            async with DHTNode.create(
                p2p,
                initial_peers,
                record_validators=record_validators,
                client_mode=client_mode,
                **node_kwargs,
            ) as node:
                yield AsyncDHT(p2p, node)

    @classmethod
    async def aio_create(cls, initial_peers: Sequence[str] | None = (), **kwargs: Any) -> DHT:
        """From asyncio: ``dht = await DHT.aio_create(...)`` starts a blocking ``DHT`` (seconds:
        host, bootstrap) without blocking the asyncio loop. Keywords: as ``DHT(...)``.

        Import it at module level (``from swarmtrain import DHT``): ``swarmtrain``'s names load
        lazily, and loading this one (libp2p) takes 1-2 s, which would block the loop."""
        dht = cls(initial_peers, start=False, **kwargs)
        dht.run_in_background(await_ready=False)
        assert dht._ready is not None
        try:
            await asyncio.shield(asyncio.wrap_future(dht._ready))
        except asyncio.CancelledError:  # close it once started, off the loop
            threading.Thread(target=dht.shutdown, daemon=True).start()
            raise
        return dht

    # ---------------------------------------------------------------- lifetime

    _service_name = "the DHT"

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the host and node on the background loop (the constructor does this unless
        ``start=False``). With ``await_ready`` (default), return once the node has bootstrapped
        (see :meth:`wait_until_ready` for ``timeout``); otherwise return at once and let
        :meth:`wait_until_ready` wait (several DHTs can then bootstrap concurrently)."""
        if self._ready is not None:
            raise RuntimeError("the DHT was already started")
        self._ready = Future()
        threading.Thread(target=self._start, name="swarmtrain-dht-start", daemon=True).start()
        if await_ready:
            self.wait_until_ready(timeout)

    def _start(self) -> None:
        assert self._ready is not None
        try:
            self._start_in_background(lambda: DHT.create(self._initial_peers, **self._kwargs))
        except BaseException as e:
            self._ready.set_exception(e)
        else:
            self._ready.set_result(None)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until the node has bootstrapped; re-raise the error if its start failed.

        :raises concurrent.futures.TimeoutError: not ready within ``timeout`` seconds (the start
          goes on)
        """
        if self._ready is None:
            raise RuntimeError("the DHT is not started: call run_in_background() first")
        try:
            self._ready.result(timeout)
        except FutureTimeoutError:
            raise FutureTimeoutError(f"the DHT was not ready within {timeout} s") from None

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the node and host (waits for a start still in progress first); ``timeout``:
        cut the close short after this many seconds."""
        if self._ready is not None:
            try:
                self._ready.result()
            except BaseException:
                pass  # the start's error was raised to whoever waited for it
        super().shutdown(timeout)

    async def _aio_wait_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            await asyncio.shield(asyncio.wrap_future(self._ready))

    def _running(self) -> tuple[Any, AsyncDHT]:
        if self._ready is not None and not self._shut_down:
            self._ready.result()  # calls made while the node bootstraps wait for it
        return super()._running()

    def add_validators(self, record_validators: Sequence[RecordValidatorBase]) -> None:
        """Add record validators to the running node (hivemind's ``DHT.add_validators``).

        :raises RuntimeError: the DHT is not running yet
        """
        runtime, dht = self._running()
        runtime.call_sync(dht.add_validators, list(record_validators))

    # ------------------------------------------------------------------ calls

    @property
    def peer_id(self) -> PeerID:
        return self._running()[1].peer_id

    @property
    def client_mode(self) -> bool:
        return self._running()[1].client_mode

    def get_visible_maddrs(self) -> list[str]:
        runtime, dht = self._running()
        return runtime.call_sync(dht.get_visible_maddrs)

    store = forward(AsyncDHT.store, future_keyword="return_future")
    get = forward(AsyncDHT.get, future_keyword="return_future")
    get_many = forward(AsyncDHT.get_many, future_keyword="return_future")
    run_coroutine = forward(AsyncDHT.run_coroutine, future_keyword="return_future")

    #: asyncio awaitables: ``await dht.aio.store(...)`` (see :class:`AsyncioDHT`)
    aio = aio_property()


#: ``dht.aio``'s class: ``store``, ``get``, ``get_many``, ``run_coroutine`` as asyncio awaitables
AsyncioDHT = aio_namespace(DHT, name="AsyncioDHT")
DHT._aio_class = AsyncioDHT
