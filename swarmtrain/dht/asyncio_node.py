"""``AsyncioDHTNode``: hivemind's asyncio ``DHTNode`` API over swarmtrain's trio node.

hivemind's ``DHTNode`` is created and awaited from asyncio (``node = await DHTNode.create(
initial_peers=...)``, ``await node.store(...)``, ``await node.shutdown()``). swarmtrain's
:class:`~swarmtrain.dht.node.DHTNode` is trio code that runs on a caller's ``P2P`` host. This
class bridges the two without a second implementation: it owns a blocking
:class:`~swarmtrain.dht.dht.DHT` (a host and a node on swarmtrain's background trio loop) and
awaits its calls from asyncio, which never blocks the asyncio loop; cancelling an awaiting
asyncio task cancels the trio call.

Resource handling: ``create`` starts the host and node (in a worker thread, so the asyncio loop
keeps running while the node bootstraps) and ``shutdown`` stops both; a ``create`` cancelled
midway shuts down what it started.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Collection, Sequence
from typing import Any

import trio

from swarmtrain.p2p import PeerID

from .dht import DHT
from .identifiers import DHTID
from .node import DHTNode
from .protocol import DHTProtocol
from .storage import DHTExpiration, ValueWithExpiration
from .validation import RecordValidatorBase

__all__ = ["AsyncioDHTNode"]


class AsyncioDHTNode:
    """A DHT node with its own host, awaited from asyncio. Build it with ``await create()``."""

    def __init__(self, dht: DHT):
        self._dht = dht
        self._node: DHTNode = dht._running()[1].node

    @classmethod
    async def create(
        cls,
        initial_peers: Sequence[Any] = (),
        *,
        record_validator: RecordValidatorBase | None = None,
        record_validators: Sequence[RecordValidatorBase] = (),
        **kwargs: Any,
    ) -> AsyncioDHTNode:
        """Start a host and a node, bootstrap from ``initial_peers`` (multiaddrs), return the node.

        ``record_validator`` (hivemind's keyword: one validator) and ``record_validators`` are
        combined; other keywords are those of :class:`~swarmtrain.dht.dht.DHT` (host settings
        and :class:`~swarmtrain.dht.node.DHTNodeConfig` fields, ``parallel_rpc`` included).
        """
        if isinstance(initial_peers, str):
            raise TypeError("initial_peers must be a list of multiaddrs, not one string")
        validators = list(record_validators)
        if record_validator is not None:
            validators.append(record_validator)
        dht = DHT(
            [str(maddr) for maddr in initial_peers],
            start=False,
            record_validators=validators,
            **kwargs,
        )
        dht.run_in_background(await_ready=False)
        try:
            await asyncio.to_thread(dht.wait_until_ready)
        except BaseException:
            # cancelled (or failed): stop the node once its start is over, off this loop
            threading.Thread(target=dht.shutdown, name="swarmtrain-dht-stop", daemon=True).start()
            raise
        return cls(dht)

    async def shutdown(self) -> None:
        """Stop the node and its host."""
        await asyncio.to_thread(self._dht.shutdown)

    # ------------------------------------------------------------ identity

    @property
    def node_id(self) -> DHTID:
        return self._node.node_id

    @property
    def peer_id(self) -> PeerID:
        return self._dht.peer_id

    @property
    def protocol(self) -> DHTProtocol:
        """The trio node's protocol (routing table, storage, cache, validators): inspect it
        from here; call its coroutines only on the trio loop (:meth:`run_coroutine`)."""
        return self._node.protocol

    async def get_visible_maddrs(self) -> list[str]:
        """Multiaddrs other nodes can pass as ``initial_peers``."""
        return await asyncio.to_thread(self._dht.get_visible_maddrs)

    # --------------------------------------------------------------- calls

    async def _await(self, coro_fn, *args: Any) -> Any:
        runtime, _ = self._dht._running()
        return await runtime.call_asyncio(coro_fn, *args)

    async def find_nearest_nodes(
        self,
        queries: Collection[DHTID],
        k_nearest: int | None = None,
        beam_size: int | None = None,
        exclude_self: bool = False,
    ) -> dict[DHTID, dict[DHTID, PeerID]]:
        """For each query, up to ``k_nearest`` (default ``bucket_size``) nodes nearest to it,
        nearest first; the search keeps ``beam_size`` (default ``max(bucket_size, k_nearest)``)
        nodes, as in hivemind. See :meth:`DHTNode.find_nearest_nodes`."""
        bucket_size = self._node.config.bucket_size
        k_nearest = k_nearest if k_nearest is not None else bucket_size
        beam_size = beam_size if beam_size is not None else max(bucket_size, k_nearest)
        return await self._await(
            functools.partial(
                self._node.find_nearest_nodes,
                list(queries),
                k_nearest,
                exclude_self=exclude_self,
                beam_size=beam_size,
            )
        )

    async def store(
        self, key: Any, value: Any, expiration_time: DHTExpiration, subkey: Any = None
    ) -> bool:
        """See :meth:`DHTNode.store`."""
        return await self._await(self._node.store, key, value, expiration_time, subkey)

    async def store_many(
        self,
        keys: Sequence[Any],
        values: Sequence[Any],
        expiration_time: DHTExpiration | Sequence[DHTExpiration],
        subkeys: Any | Sequence[Any] = None,
    ) -> dict[Any, bool]:
        """Store several values at once (concurrently). ``expiration_time`` and ``subkeys`` are
        one value for all keys or one per key.

        :returns: ``{key: stored}``, keyed by ``(key, subkey)`` for dictionary subkeys
        """
        count = len(keys)
        if not isinstance(expiration_time, Sequence):
            expiration_time = [expiration_time] * count
        if (
            subkeys is None
            or not isinstance(subkeys, Sequence)
            or isinstance(subkeys, (str, bytes))
        ):
            subkeys = [subkeys] * count
        if not len(values) == len(expiration_time) == len(subkeys) == count:
            raise ValueError(
                "keys, values, expiration times and subkeys must have the same length, got "
                f"{count}, {len(values)}, {len(expiration_time)}, {len(subkeys)}"
            )
        items = list(zip(keys, values, expiration_time, subkeys, strict=True))
        results: dict[Any, bool] = {}

        async def store_all() -> None:
            async def store_one(key, value, expiration, subkey) -> None:
                stored = await self._node.store(key, value, expiration, subkey)
                results[key if subkey is None else (key, subkey)] = stored

            async with trio.open_nursery() as nursery:
                for item in items:
                    nursery.start_soon(store_one, *item)

        await self._await(store_all)
        return results

    async def get(self, key: Any, latest: bool = False) -> ValueWithExpiration[Any] | None:
        """See :meth:`DHTNode.get`."""
        return await self._await(self._node.get, key, latest)

    async def get_many(
        self, keys: Collection[Any], latest: bool = False
    ) -> dict[Any, ValueWithExpiration[Any] | None]:
        """See :meth:`DHTNode.get_many`."""
        return await self._await(self._node.get_many, list(keys), latest)

    async def run_coroutine(self, coro_fn) -> Any:
        """``await coro_fn(dht, node)`` on the trio loop (``dht`` is the trio-side
        :class:`~swarmtrain.dht.dht.AsyncDHT`, ``node`` the trio :class:`DHTNode`)."""
        return await self._dht.aio.run_coroutine(coro_fn)

    def __repr__(self) -> str:
        return f"AsyncioDHTNode(node_id={self.node_id!r}, peer_id={self.peer_id})"
