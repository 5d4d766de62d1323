"""``DHTNode``: a Kademlia node on a running ``P2P`` host (trio). Lifetime::

    async with P2P.create(initial_peers=[...]) as p2p:
        async with DHTNode.create(p2p, num_replicas=5) as node:
            await node.store("key", "value", get_dht_time() + 60)
            found = await node.get("key")  # ValueWithExpiration(value='value', ...) or None

Searches use :func:`~swarmtrain.dht.traverse.traverse_dht` with ``rpc_find`` as the
``get_neighbors`` coroutine; the routing table, storage and RPCs live in
:class:`~swarmtrain.dht.protocol.DHTProtocol`. The settings are in
:mod:`~swarmtrain.dht.node_config`, the bootstrap and bucket refresh in
:mod:`~swarmtrain.dht.node_maintenance`, the handling of found values in
:mod:`~swarmtrain.dht.node_values`.

Resource handling: ``create`` opens a task group owned by the node (routing-table pings, the
periodic bucket refresh, caching writes), registers the RPC handlers, bootstraps from
``initial_peers`` (or the peers the host is already connected to) and yields the node; leaving
the ``async with`` unregisters the handlers and cancels the task group. The ``P2P`` host
belongs to the caller and stays open.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from swarmtrain.p2p import P2P, PeerID, PeerSigner
from swarmtrain.utils.async_context import async_context_only

from .blacklist import Blacklist
from .identifiers import DHTID
from .node_config import DEFAULT_CACHE_SIZE as DEFAULT_CACHE_SIZE
from .node_config import DEFAULT_MAX_EXPIRATION_HORIZON as DEFAULT_MAX_EXPIRATION_HORIZON
from .node_config import DEFAULT_MAX_SUBKEYS as DEFAULT_MAX_SUBKEYS
from .node_config import DEFAULT_STORAGE_SIZE as DEFAULT_STORAGE_SIZE
from .node_config import DHTNodeConfig, DHTNodeStatistics
from .node_config import check_hivemind_only_keywords as check_hivemind_only_keywords
from .node_maintenance import REJOIN_FIRST_DELAY as REJOIN_FIRST_DELAY
from .node_maintenance import REJOIN_MAX_DELAY as REJOIN_MAX_DELAY
from .node_maintenance import RoutingMaintenance
from .node_values import cache_items, decode, validated_off_loop
from .peer_records import PeerRecordValidator
from .protocol import (
    DHTProtocol,
    FoundValue,
    MalformedRequestError,
    StoreItem,
    merge_found_values,
)
from .serialization import serialize
from .storage import DHTExpiration, ValueWithExpiration, get_dht_time
from .traverse import traverse_dht
from .validation import (
    NO_SUBKEY,
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    RecordValidatorBase,
)

__all__ = ["DHTNode", "DHTNodeConfig", "DHTNodeStatistics"]

logger = logging.getLogger(__name__)


class DHTNode:
    """A running DHT node. Build it with ``async with DHTNode.create(p2p, ...) as node``."""

    def __init__(
        self,
        p2p: P2P,
        node_id: DHTID,
        config: DHTNodeConfig,
        record_validator: CompositeValidator,
        nursery: trio.Nursery,
    ):
        self.p2p, self.node_id, self.config = p2p, node_id, config
        self.record_validator = record_validator
        self._nursery = nursery
        self.protocol = DHTProtocol(
            p2p,
            node_id,
            record_validator=record_validator,
            nursery=nursery,
            bucket_size=config.bucket_size,
            depth_modulo=config.depth_modulo,
            client_mode=config.client_mode,
            prefix=config.prefix,
            wait_timeout=config.wait_timeout,
            limits=config.limits,
            blacklist=Blacklist(config.blacklist_time, config.backoff_rate),
            storage_size=config.storage_size,
            cache_size=config.cache_size,
            max_subkeys=config.max_subkeys,
            storage_quota=config.storage_quota,
            max_expiration_horizon=config.max_expiration_horizon,
        )
        self._warned_horizon = False
        self._rpc_limiter = (
            trio.CapacityLimiter(config.parallel_rpc) if config.parallel_rpc is not None else None
        )
        self._maintenance = RoutingMaintenance(
            p2p, self.protocol, node_id, config, self._call, self.find_nearest_nodes
        )

    async def _call(self, rpc, *args):
        """``await rpc(*args)`` within the ``parallel_rpc`` cap."""
        if self._rpc_limiter is None:
            return await rpc(*args)
        async with self._rpc_limiter:
            return await rpc(*args)

    # ---------------------------------------------------------------- lifetime

    @classmethod
    @async_context_only(
        "DHTNode.create(p2p, ...) is a trio async context manager, not awaited as in "
        "hivemind: `async with DHTNode.create(p2p, ...) as node:`. From asyncio code, "
        "`await AsyncioDHTNode.create(...)` is hivemind's DHTNode"
    )
    @asynccontextmanager
    async def create(
        cls,
        p2p: P2P,
        initial_peers: Sequence[str] | None = (),
        *,
        node_id: DHTID | None = None,
        record_validators: Iterable[RecordValidatorBase] = (),
        **kwargs: Any,
    ) -> AsyncIterator[DHTNode]:
        """Start a node on ``p2p``, bootstrap it, yield it; stop it on exit (see module doc).

        ``initial_peers`` are multiaddrs of DHT nodes; without them the node bootstraps from the
        peers ``p2p`` is connected to. ``client_mode`` defaults to the host's. Other keywords
        are :class:`DHTNodeConfig` fields.

        The node id is derived from the host's peer id (``DHTID.from_peer_id(p2p.peer_id)``)
        and other nodes check it, so it cannot be chosen: ``node_id`` (hivemind's keyword) is
        accepted only if it is that id; a node placed elsewhere needs another identity.

        :raises ValueError: ``node_id`` is not the node id of ``p2p.peer_id``
        """
        check_hivemind_only_keywords(kwargs)
        own_id = DHTID.from_peer_id(p2p.peer_id)
        if node_id is not None and node_id != own_id:
            raise ValueError(
                f"node_id={node_id!r} is not this host's node id {own_id!r}: node ids are "
                "derived from peer ids (DHTID.from_peer_id(p2p.peer_id)) and other nodes reject "
                "any other; leave node_id out, or use another identity (identity_path) to get "
                "another id"
            )
        kwargs.setdefault("client_mode", p2p.config.client_mode)
        config = DHTNodeConfig(**kwargs)
        if isinstance(initial_peers, str):
            raise TypeError("initial_peers must be a list of multiaddr strings, not one string")
        initial_peers = tuple(initial_peers or ())  # None: hivemind's "no peers"
        # Signatures are verified (and stripped) on every node, even one whose owner added no
        # validator: it stores and returns signed records for others. Per-peer records
        # (swarmtrain.dht.peer_records) are signed with this host's identity key.
        validator = CompositeValidator(
            [
                Ed25519SignatureValidator.verifier(),
                PeerRecordValidator(signer=PeerSigner(p2p.key_pair)),
                *record_validators,
            ]
        )
        async with trio.open_nursery() as nursery:
            self = cls(p2p, own_id, config, validator, nursery)
            try:
                self.protocol.serve()
                await self._maintenance.bootstrap(initial_peers)
                if initial_peers:
                    nursery.start_soon(self._maintenance.rejoin_while_alone, initial_peers)
                if config.refresh_timeout is not None:
                    nursery.start_soon(self._maintenance.refresh_buckets)
                yield self
            finally:
                self.protocol.close()
                nursery.cancel_scope.cancel()

    def add_validators(self, record_validators: Iterable[RecordValidatorBase]) -> None:
        """Add record validators to this running node (merged as in ``CompositeValidator``);
        they apply to every record stored or read from now on."""
        self.record_validator.extend(record_validators)

    # ----------------------------------------------------------------- search

    @property
    def routing_table(self):
        return self.protocol.routing_table

    async def find_nearest_nodes(
        self,
        queries: Collection[DHTID],
        k: int | None = None,
        exclude_self: bool = False,
        beam_size: int | None = None,
    ) -> dict[DHTID, dict[DHTID, PeerID]]:
        """For each query id, up to ``k`` (default ``beam_size``) live nodes nearest to it.

        :param beam_size: nodes the search keeps (default ``k``; a wider beam is slower but
          less likely to miss a nearer node)
        :returns: {query: {node_id: peer_id}, nearest first}; includes this node unless it is
          a client or ``exclude_self``
        """
        default_k = self.config.beam_size
        assert default_k is not None  # set by DHTNodeConfig.__post_init__
        k = k if k is not None else default_k
        beam_size = max(beam_size, k) if beam_size is not None else k
        queries = list(dict.fromkeys(queries))
        found, _ = await self._search(queries, beam_size, include_self=not exclude_self)
        return {
            query: dict(sorted(found[query].items(), key=lambda item: item[0] ^ query)[:k])
            for query in queries
        }

    async def _search(
        self, queries: list[DHTID], beam_size: int, on_result=None, include_self: bool = False
    ) -> tuple[dict[DHTID, dict[DHTID, PeerID]], dict[DHTID, set[DHTID]]]:
        """Beam search; ``await on_result(query, node_id, FindResult) -> should_stop`` sees
        answers.

        With ``include_self`` (ignored for a client), this node takes a place in the beam
        without an RPC (the caller has read its own storage) and may be among the results.
        """
        peers: dict[DHTID, PeerID] = {self.node_id: self.p2p.peer_id}
        initial: list[DHTID] = []
        # More starting points than the beam holds: the search calls the farther ones only if
        # nearer ones fail, so a narrow search (a store, a latest get) survives a burst of
        # unresponsive peers instead of ending with no node at all.
        num_initial = max(beam_size, self.config.bucket_size)
        for query in queries:
            for node_id, peer_id in self.routing_table.get_nearest_neighbors(query, num_initial):
                peers[node_id] = peer_id
                initial.append(node_id)

        async def get_neighbors(node_id: DHTID, batch: list[DHTID]):
            # a peer's nodes beyond the beam_size nearest to a query would not enter our beam
            response = await self._call(self.protocol.call_find, peers[node_id], batch, beam_size)
            if response is None:
                return None
            answer = {}
            for query in batch:
                result = response[query]
                for neighbor, peer_id in result.nearest.items():
                    peers.setdefault(neighbor, peer_id)
                should_stop = await on_result(query, node_id, result) if on_result else False
                answer[query] = (list(result.nearest), should_stop)
            return answer

        myself = {self.node_id} if include_self and not self.config.client_mode else set()
        nearest, visited = await traverse_dht(
            queries,
            initial,
            beam_size=beam_size,
            num_workers=self.config.num_workers,
            queries_per_call=min(len(queries), 8) or 1,
            get_neighbors=get_neighbors,
            visited_nodes={query: {self.node_id} for query in queries},
            answered_nodes={query: myself for query in queries},
            # a call slower than this stops holding back farther candidates (dead peers can
            # take the whole wait_timeout to fail)
            patience=self.config.wait_timeout / 4,
        )
        found = {q: {node_id: peers[node_id] for node_id in nearest[q]} for q in queries}
        return found, visited

    # ------------------------------------------------------------------ store

    async def store(
        self,
        key: Any,
        value: Any,
        expiration_time: DHTExpiration,
        subkey: Any = None,
    ) -> bool:
        """Store ``value`` (or ``subkey`` of a dictionary value) under ``key`` until
        ``expiration_time`` on the ``num_replicas`` nodes nearest to the key.

        An ``expiration_time`` beyond now + ``max_expiration_horizon`` is capped there (with a
        warning, once per node): other nodes refuse such records.

        :returns: whether at least one node (possibly this one) accepted it
        :raises DHTValueError: key, subkey or value cannot be serialized or is too large
        """
        serialized_key = serialize(key, max_size=self.config.limits.max_key_size)
        serialized_subkey = (
            serialize(subkey, max_size=self.config.limits.max_subkey_size)
            if subkey is not None
            else None
        )
        serialized_value = serialize(value, max_size=self.config.limits.max_value_size)
        expiration_time = float(expiration_time)
        now = get_dht_time()
        if not math.isfinite(expiration_time) or expiration_time <= now:
            return False
        horizon = self.config.max_expiration_horizon
        if horizon is not None and expiration_time > now + horizon:
            if not self._warned_horizon:
                self._warned_horizon = True
                logger.warning(
                    "expiration_time %.0f s from now is capped at max_expiration_horizon=%s s "
                    "(other nodes refuse records beyond it); logged once",
                    expiration_time - now,
                    horizon,
                )
            expiration_time = now + horizon
        record = DHTRecord(
            serialized_key, serialized_subkey or NO_SUBKEY, serialized_value, expiration_time
        )
        item = StoreItem(
            serialized_key,
            serialized_subkey,
            self.record_validator.sign_value(record),
            expiration_time,
        )
        key_id = item.key_id
        nearest = (await self.find_nearest_nodes([key_id], k=self.config.num_replicas))[key_id]
        results: list[bool] = []

        async def store_on(node_id: DHTID, peer_id: PeerID) -> None:
            if node_id == self.node_id:
                try:
                    results.extend(self.protocol.store_locally([item]))
                except MalformedRequestError:
                    results.append(False)
            else:
                results.extend(
                    await self._call(self.protocol.call_store, peer_id, [item]) or [False]
                )

        async with trio.open_nursery() as nursery:
            for node_id, peer_id in nearest.items():
                nursery.start_soon(store_on, node_id, peer_id)
        return any(results)

    # -------------------------------------------------------------------- get

    async def get(self, key: Any, latest: bool = False) -> ValueWithExpiration[Any] | None:
        """The value under ``key``, or None if no live, valid value was found.

        Without ``latest``, the search stops at the first valid value (the local storage and
        cache count). With ``latest``, it reads the ``latest_beam_size`` (default
        ``num_replicas``) live nodes nearest to the key -- the nodes stores write to, this node
        included if it is one -- and returns the value with the latest expiration. Dictionary
        values are merged across all answers received; they come back as
        ``{subkey: ValueWithExpiration(value, expiration)}``.
        """
        serialized_key = serialize(key, max_size=self.config.limits.max_key_size)
        found = await self._get_serialized([serialized_key], latest)
        return decode(self.record_validator, serialized_key, found[serialized_key])

    async def get_many(
        self, keys: Collection[Any], latest: bool = False
    ) -> dict[Any, ValueWithExpiration[Any] | None]:
        """:meth:`get` for several (hashable) keys in one search: each find RPC asks a peer
        about up to 8 of the keys at once. Returns ``{key: value or None}``."""
        keys = list(dict.fromkeys(keys))
        max_size = self.config.limits.max_key_size
        serialized = {key: serialize(key, max_size=max_size) for key in keys}
        found = await self._get_serialized(list(serialized.values()), latest)
        return {
            key: decode(self.record_validator, serialized[key], found[serialized[key]])
            for key in keys
        }

    async def _get_serialized(
        self, serialized_keys: list[bytes], latest: bool
    ) -> dict[bytes, FoundValue | None]:
        """Validated (still serialized) values of ``serialized_keys``, searched together."""
        key_of = {DHTID.from_serialized_key(key): key for key in dict.fromkeys(serialized_keys)}
        now = get_dht_time()
        best = {}
        for key_id, key in key_of.items():
            best[key_id] = await self._validated(key, self.protocol.lookup_locally(key_id, now))
        queries = [key_id for key_id in key_of if best[key_id] is None or latest]
        if queries:
            lacking: dict[DHTID, list[DHTID]] = {key_id: [] for key_id in queries}

            async def on_result(query: DHTID, node_id: DHTID, result) -> bool:
                found = await self._validated(key_of[query], result.value)
                if found is None:
                    lacking[query].append(node_id)
                best[query] = merge_found_values(best[query], found, get_dht_time())
                return best[query] is not None and not latest

            beam_size = self.config.latest_beam_size if latest else self.config.beam_size
            assert beam_size is not None
            found_nodes, _ = await self._search(queries, beam_size, on_result, include_self=True)
            for key_id in queries:
                best_found = best[key_id]
                if best_found is not None:
                    self._cache(key_of[key_id], best_found, found_nodes[key_id], lacking[key_id])
        return {key: best[key_id] for key_id, key in key_of.items()}

    async def _validated(
        self, serialized_key: bytes, found: FoundValue | None
    ) -> FoundValue | None:
        """``found`` without invalid records; large values are checked in a worker thread."""
        return await validated_off_loop(self.protocol, serialized_key, found)

    def _cache(
        self,
        serialized_key: bytes,
        found: FoundValue,
        nearest: dict[DHTID, PeerID],
        lacking: list[DHTID],
    ) -> None:
        items = cache_items(serialized_key, found)
        if self.config.cache_locally:  # validated by the search already
            self.protocol.store_validated_locally(items, in_cache=True)
        targets = [node_id for node_id in nearest if node_id in lacking]
        for node_id in targets[: self.config.cache_nearest]:
            self._nursery.start_soon(
                self._call,
                self.protocol.call_store,
                nearest[node_id],
                items[: self.config.limits.max_items],
                True,
            )

    def statistics(self) -> DHTNodeStatistics:
        now = get_dht_time()
        self.protocol.storage.purge(now)
        self.protocol.cache.purge(now)
        return DHTNodeStatistics(
            routing_table=self.routing_table.statistics(),
            blacklist=self.protocol.blacklist.statistics(now),
            num_stored_keys=len(self.protocol.storage),
            num_cached_keys=len(self.protocol.cache),
            num_bucket_refreshes=self._maintenance.num_refreshes,
            num_rejoins=self._maintenance.num_rejoins,
        )
