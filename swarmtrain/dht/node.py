"""``DHTNode``: a Kademlia node on a running ``P2P`` host (trio). Lifetime::

    async with P2P.create(initial_peers=[...]) as p2p:
        async with DHTNode.create(p2p, num_replicas=5) as node:
            await node.store("key", "value", get_dht_time() + 60)
            found = await node.get("key")  # ValueWithExpiration(value='value', ...) or None

Searches use :func:`~swarmtrain.dht.traverse.traverse_dht` with ``rpc_find`` as the
``get_neighbors`` coroutine; the routing table, storage and RPCs live in
:class:`~swarmtrain.dht.protocol.DHTProtocol`.

Resource handling: ``create`` opens a task group owned by the node (routing-table pings, the
periodic bucket refresh, caching writes), registers the RPC handlers, bootstraps from
``initial_peers`` (or the peers the host is already connected to) and yields the node; leaving
the ``async with`` unregisters the handlers and cancels the task group. The ``P2P`` host
belongs to the caller and stays open.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import trio

from swarmtrain.p2p import P2P, PeerID, PeerSigner, PeerUnreachableError
from swarmtrain.utils.async_context import async_context_only

from .blacklist import Blacklist, BlacklistStatistics
from .identifiers import DHTID
from .peer_records import PeerRecordValidator
from .protocol import (
    DHTProtocol,
    DHTProtocolLimits,
    FoundValue,
    MalformedRequestError,
    StoreItem,
    merge_found_values,
)
from .routing import RoutingTableStatistics
from .serialization import deserialize, serialize
from .storage import DHTExpiration, DictionaryDHTValue, ValueWithExpiration, get_dht_time
from .storage_quota import StorageQuota
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

# hivemind DHTNode keywords without an equivalent here: the value that means what swarmtrain
# does anyway (accepted and dropped), and the error for any other value.
_HIVEMIND_ONLY_KEYWORDS = {
    "cache_refresh_before_expiry": (
        0,
        "swarmtrain does not refresh cached values before they expire (hivemind's "
        "cache_refresh_before_expiry); pass 0 or leave it out: values found by get stay cached "
        "until they expire (cache_locally, cache_nearest)",
    ),
    "reuse_get_requests": (
        False,
        "swarmtrain runs one search per get call (hivemind's reuse_get_requests=False); to read "
        "several keys in one search, use get_many",
    ),
}


def check_hivemind_only_keywords(kwargs: dict[str, Any]) -> None:
    """Drop hivemind-only DHTNode keywords whose value means swarmtrain's behaviour; raise a
    TypeError naming swarmtrain's equivalent for any other value."""
    for name, (same_as_ours, message) in _HIVEMIND_ONLY_KEYWORDS.items():
        if name in kwargs:
            if kwargs[name] != same_as_ours:
                raise TypeError(f"{name}={kwargs[name]!r}: {message}")
            del kwargs[name]


#: Records expire at most 10 minutes from now by default: our own records live 30-60 s (progress
#: 60 s, state-sharing and DiLoCo declarations 30 s, matchmaking until the group starts), hivemind
#: style declarations a few minutes; a record planted by a peer that left outlives it by at most
#: this long.
DEFAULT_MAX_EXPIRATION_HORIZON = 600.0
#: a node whose routing table is empty asks its initial peers again after this many seconds,
#: doubling up to REJOIN_MAX_DELAY (``DHTNode._rejoin_while_alone``)
REJOIN_FIRST_DELAY = 2.0
REJOIN_MAX_DELAY = 60.0
#: keys a node stores for others (and, separately, caches): far beyond what a run of thousands
#: of peers needs per node; evicted oldest write first
DEFAULT_STORAGE_SIZE = 65536
DEFAULT_CACHE_SIZE = 65536
#: subkeys of one dictionary value (our per-peer keys hold one subkey per peer of the run)
DEFAULT_MAX_SUBKEYS = 4096


@dataclass(frozen=True)
class DHTNodeConfig:
    """Validated settings of a :class:`DHTNode` (hivemind's keyword names).

    :param num_replicas: store each value on this many nodes nearest to its key
    :param bucket_size: Kademlia k; also the most nearest nodes a find answer lists (a search
      asks each peer for as many as it keeps: ``beam_size`` or ``latest_beam_size``)
    :param depth_modulo: split buckets not covering our id only at depths not divisible by it
    :param beam_size: nodes kept per search (default: ``bucket_size``); >= ``num_replicas``
    :param latest_beam_size: nodes a ``latest`` get reads (default: ``num_replicas``, the nodes
      every store writes to); it ends once this many nodes nearest to the key answered and no
      nearer node is left to ask. Between ``num_replicas`` and ``beam_size``
    :param num_workers: concurrent RPCs per search
    :param parallel_rpc: at most this many of the node's own RPCs (searches, stores, bootstrap
      pings, cache writes) in flight at once, across all its searches (None: no cap)
    :param client_mode: call others but serve nothing and stay out of their routing tables
    :param wait_timeout: seconds to wait for one RPC before counting the peer as unresponsive
    :param refresh_timeout: look up a random id in every bucket unused for this long (None: off)
    :param cache_locally: keep values found by ``get`` in the local cache
    :param cache_nearest: also store them in the cache of this many nearest nodes that lacked them
    :param blacklist_time: first ban (seconds) of an unresponsive peer; doubles per failure
    :param storage_size: at most this many keys stored for others (None: unbounded); when full,
      the key written longest ago is evicted
    :param cache_size: at most this many keys in the cache of values found (same rule)
    :param max_subkeys: at most this many subkeys per dictionary value (same rule)
    :param storage_quota: per-peer quotas (records, bytes) and the byte budget of the storage
      and, separately, of the cache (:class:`~swarmtrain.dht.storage_quota.StorageQuota`)
    :param max_expiration_horizon: records expire at most this many seconds from now (None: no
      cap). Our own longer stores are capped with a warning; peers' are refused when stored
      and ignored when read (beyond ``EXPIRATION_CLOCK_ALLOWANCE`` for clock skew). Every
      peer of a run should use the same value
    """

    num_replicas: int = 5
    bucket_size: int = 20
    depth_modulo: int = 5
    beam_size: int | None = None
    latest_beam_size: int | None = None
    num_workers: int = 4
    parallel_rpc: int | None = None
    client_mode: bool = False
    wait_timeout: float = 3.0
    refresh_timeout: float | None = 600.0
    cache_locally: bool = True
    cache_nearest: int = 1
    cache_size: int | None = DEFAULT_CACHE_SIZE
    storage_size: int | None = DEFAULT_STORAGE_SIZE
    max_subkeys: int | None = DEFAULT_MAX_SUBKEYS
    storage_quota: StorageQuota = field(default_factory=StorageQuota)
    max_expiration_horizon: float | None = DEFAULT_MAX_EXPIRATION_HORIZON
    blacklist_time: float = 5.0
    backoff_rate: float = 2.0
    prefix: str = "swarmtrain"
    limits: DHTProtocolLimits = field(default_factory=DHTProtocolLimits)

    def __post_init__(self) -> None:
        for name in ("num_replicas", "bucket_size", "depth_modulo", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.parallel_rpc is not None and (
            isinstance(self.parallel_rpc, bool)
            or not isinstance(self.parallel_rpc, int)
            or self.parallel_rpc < 1
        ):
            raise ValueError(
                f"parallel_rpc must be a positive integer or None, got {self.parallel_rpc!r}"
            )
        beam_size = self.beam_size
        if beam_size is None:
            beam_size = max(self.bucket_size, self.num_replicas)
            object.__setattr__(self, "beam_size", beam_size)
        if beam_size < self.num_replicas:
            raise ValueError(
                f"beam_size ({beam_size}) must be at least num_replicas ({self.num_replicas})"
            )
        latest_beam_size = self.latest_beam_size
        if latest_beam_size is None:
            latest_beam_size = self.num_replicas
            object.__setattr__(self, "latest_beam_size", latest_beam_size)
        if (
            isinstance(latest_beam_size, bool)
            or not isinstance(latest_beam_size, int)
            or not self.num_replicas <= latest_beam_size <= beam_size
        ):
            raise ValueError(
                f"latest_beam_size must be an integer between num_replicas ({self.num_replicas}) "
                f"and beam_size ({beam_size}), got {latest_beam_size!r}"
            )
        if self.cache_nearest < 0:
            raise ValueError("cache_nearest must be non-negative")
        if not self.wait_timeout > 0:
            raise ValueError("wait_timeout must be positive")
        if self.refresh_timeout is not None and not self.refresh_timeout > 0:
            raise ValueError("refresh_timeout must be positive or None")
        for name in ("cache_size", "storage_size", "max_subkeys"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.storage_quota, StorageQuota):
            raise TypeError(f"storage_quota must be a StorageQuota, got {self.storage_quota!r}")
        horizon = self.max_expiration_horizon
        if horizon is not None and not (isinstance(horizon, (int, float)) and horizon > 0):
            raise ValueError(f"max_expiration_horizon must be positive or None, got {horizon!r}")
        if not self.prefix or "::" in self.prefix:
            raise ValueError(f"prefix must be a non-empty string without '::', got {self.prefix!r}")


@dataclass(frozen=True)
class DHTNodeStatistics:
    """A snapshot of a :class:`DHTNode`."""

    routing_table: RoutingTableStatistics
    blacklist: BlacklistStatistics
    num_stored_keys: int
    num_cached_keys: int
    num_bucket_refreshes: int
    #: times the node asked its initial peers again while its routing table was empty
    num_rejoins: int = 0


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
        self._num_refreshes = 0
        self._num_rejoins = 0
        self._rpc_limiter = (
            trio.CapacityLimiter(config.parallel_rpc) if config.parallel_rpc is not None else None
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
                await self._bootstrap(initial_peers)
                if initial_peers:
                    nursery.start_soon(self._rejoin_while_alone, initial_peers)
                if config.refresh_timeout is not None:
                    nursery.start_soon(self._refresh_buckets)
                yield self
            finally:
                self.protocol.close()
                nursery.cancel_scope.cancel()

    def add_validators(self, record_validators: Iterable[RecordValidatorBase]) -> None:
        """Add record validators to this running node (merged as in ``CompositeValidator``);
        they apply to every record stored or read from now on."""
        self.record_validator.extend(record_validators)

    async def _bootstrap(self, initial_peers: Sequence[str], retry: bool = False) -> None:
        peers: set[PeerID] = set()

        async def connect(maddr: str) -> None:
            try:
                peers.add(await self.p2p.connect(maddr))
            except (PeerUnreachableError, ValueError) as e:
                (logger.debug if retry else logger.warning)(
                    "initial DHT peer %s unreachable: %s", maddr, e
                )

        async with trio.open_nursery() as nursery:
            for maddr in initial_peers:
                nursery.start_soon(connect, maddr)
        if not initial_peers:
            peers.update(self.p2p.get_connected_peers())
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(self._call, self.protocol.call_ping, peer)
        if initial_peers and len(self.protocol.routing_table) == 0 and not retry:
            logger.warning(
                "none of the initial DHT peers answered; starting alone and asking them again "
                "every %.0f-%.0f s until one answers",
                REJOIN_FIRST_DELAY,
                REJOIN_MAX_DELAY,
            )
        if len(self.protocol.routing_table) > 0:
            await self.find_nearest_nodes([self.node_id])

    async def _rejoin_while_alone(self, initial_peers: Sequence[str]) -> None:
        """While the routing table is empty (the bootstrap failed: the initial peers were
        down, or too slow under load; or every known node left), ask the initial peers again,
        waiting ``REJOIN_FIRST_DELAY`` s, doubling to ``REJOIN_MAX_DELAY`` s. A node that
        gave up on them at startup would otherwise stay a DHT of its own for good."""
        delay = REJOIN_FIRST_DELAY
        while True:
            await trio.sleep(delay * random.uniform(0.9, 1.1))
            if len(self.protocol.routing_table) > 0:
                delay = REJOIN_FIRST_DELAY
                continue
            self._num_rejoins += 1
            await self._bootstrap(initial_peers, retry=True)
            if len(self.protocol.routing_table) > 0:
                logger.info(
                    "joined the DHT through the initial peers (retry %d)", self._num_rejoins
                )
                delay = REJOIN_FIRST_DELAY
            else:
                delay = min(2 * delay, REJOIN_MAX_DELAY)

    async def _refresh_buckets(self) -> None:
        timeout = self.config.refresh_timeout
        assert timeout is not None
        while True:
            await trio.sleep(timeout / 2 * random.uniform(0.9, 1.1))
            refresh_ids = self.protocol.routing_table.get_refresh_ids(get_dht_time(), timeout)
            if refresh_ids and len(self.protocol.routing_table) > 0:
                await self.find_nearest_nodes(refresh_ids)
            self._num_refreshes += 1

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
        """Beam search; ``on_result(query, node_id, FindResult) -> should_stop`` sees answers.

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
                should_stop = on_result(query, node_id, result) if on_result else False
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
        return self._decode(serialized_key, found[serialized_key])

    async def get_many(
        self, keys: Collection[Any], latest: bool = False
    ) -> dict[Any, ValueWithExpiration[Any] | None]:
        """:meth:`get` for several (hashable) keys in one search: each find RPC asks a peer
        about up to 8 of the keys at once. Returns ``{key: value or None}``."""
        keys = list(dict.fromkeys(keys))
        max_size = self.config.limits.max_key_size
        serialized = {key: serialize(key, max_size=max_size) for key in keys}
        found = await self._get_serialized(list(serialized.values()), latest)
        return {key: self._decode(serialized[key], found[serialized[key]]) for key in keys}

    async def _get_serialized(
        self, serialized_keys: list[bytes], latest: bool
    ) -> dict[bytes, FoundValue | None]:
        """Validated (still serialized) values of ``serialized_keys``, searched together."""
        key_of = {DHTID.from_serialized_key(key): key for key in dict.fromkeys(serialized_keys)}
        now = get_dht_time()
        best = {
            key_id: self._validated(key, self.protocol.lookup_locally(key_id, now))
            for key_id, key in key_of.items()
        }
        queries = [key_id for key_id in key_of if best[key_id] is None or latest]
        if queries:
            lacking: dict[DHTID, list[DHTID]] = {key_id: [] for key_id in queries}

            def on_result(query: DHTID, node_id: DHTID, result) -> bool:
                found = self._validated(key_of[query], result.value)
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

    def _validated(self, serialized_key: bytes, found: FoundValue | None) -> FoundValue | None:
        """``found`` without the records the validators reject (None if nothing is left)."""
        if found is None:
            return None
        if isinstance(found.value, DictionaryDHTValue):
            now = get_dht_time()
            valid = DictionaryDHTValue()
            for subkey, item in found.value.items(now):
                if self._is_valid(
                    StoreItem(serialized_key, subkey, item.value, item.expiration_time)
                ):
                    valid.store(subkey, item.value, item.expiration_time, now)
            if len(valid) == 0:
                return None
            return ValueWithExpiration(valid, valid.latest_expiration_time)
        if self._is_valid(StoreItem(serialized_key, None, found.value, found.expiration_time)):
            return found
        return None

    def _is_valid(self, item: StoreItem) -> bool:
        try:
            return self.protocol.validate_record(item)
        except MalformedRequestError:
            return False

    def _cache(
        self,
        serialized_key: bytes,
        found: FoundValue,
        nearest: dict[DHTID, PeerID],
        lacking: list[DHTID],
    ) -> None:
        if isinstance(found.value, DictionaryDHTValue):
            now = get_dht_time()
            items = [
                StoreItem(serialized_key, subkey, item.value, item.expiration_time)
                for subkey, item in found.value.items(now)
            ]
        else:
            items = [StoreItem(serialized_key, None, found.value, found.expiration_time)]
        if self.config.cache_locally:
            self.protocol.store_locally(items, in_cache=True)
        targets = [node_id for node_id in nearest if node_id in lacking]
        for node_id in targets[: self.config.cache_nearest]:
            self._nursery.start_soon(
                self._call,
                self.protocol.call_store,
                nearest[node_id],
                items[: self.config.limits.max_items],
                True,
            )

    def _decode(
        self, serialized_key: bytes, found: FoundValue | None
    ) -> ValueWithExpiration | None:
        if found is None:
            return None
        if isinstance(found.value, DictionaryDHTValue):
            now = get_dht_time()
            return ValueWithExpiration(
                {
                    deserialize(subkey): ValueWithExpiration(
                        self._unsigned(serialized_key, subkey, item), item.expiration_time
                    )
                    for subkey, item in found.value.items(now)
                },
                found.expiration_time,
            )
        return ValueWithExpiration(
            self._unsigned(serialized_key, NO_SUBKEY, cast(ValueWithExpiration[bytes], found)),
            found.expiration_time,
        )

    def _unsigned(self, key: bytes, subkey: bytes, item: ValueWithExpiration[bytes]) -> Any:
        record = DHTRecord(key, subkey, item.value, item.expiration_time)
        return deserialize(self.record_validator.strip_value(record), max_size=None)

    def statistics(self) -> DHTNodeStatistics:
        now = get_dht_time()
        self.protocol.storage.purge(now)
        self.protocol.cache.purge(now)
        return DHTNodeStatistics(
            routing_table=self.routing_table.statistics(),
            blacklist=self.protocol.blacklist.statistics(now),
            num_stored_keys=len(self.protocol.storage),
            num_cached_keys=len(self.protocol.cache),
            num_bucket_refreshes=self._num_refreshes,
            num_rejoins=self._num_rejoins,
        )
