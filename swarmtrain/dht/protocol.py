"""DHT RPCs over ``swarmtrain.p2p``: the ping / store / find handlers and the calls to them.

``DHTProtocol`` owns a node's routing table, storage and cache. Server side, it registers
``{prefix}::DHTProtocol.rpc_ping``, ``.rpc_store`` and ``.rpc_find`` (not in client mode) and
checks every request against :class:`DHTProtocolLimits` and every record against the record
validator before it touches any state: a malformed request fails as a whole with
:class:`MalformedRequestError` (the caller sees a ``RemoteError`` naming it), a record that a
validator rejects is answered with ``store_ok=False``, and so is a record the storage refuses
(:class:`~swarmtrain.dht.storage_quota.StoreOutcome`: an expiration beyond the horizon, the
caller's quota used up, ...; each refusal reason is logged once per peer). Client side,
``call_*`` return None when the peer does not answer in ``wait_timeout`` seconds and never
raise for network failures. What a failure costs the peer depends on its kind
(:mod:`~swarmtrain.dht.call_failures`): a timeout, refused dial or reset backs the peer off
and marks it stale in the routing table, where it stays until it answers again or a replacement
takes its place (:class:`~swarmtrain.dht.routing.EvictionPolicy`); a backed-off peer is skipped
while the routing table holds a fresh node, and asked anyway when it does not. A malformed
answer bans the peer and drops it at once. Values a peer returns with an expiration beyond the
horizon are ignored (no honest node stores them).

Peers that call us with a node id (non-client nodes) and peers that answer us are added to the
routing table (fresh, their backoff lifted); when a bucket is full, the protocol pings its
stalest node in the owner's task group (``nursery``) and keeps whichever answers.

Node ids are bound to peer ids (``DHTID.from_peer_id``): a request whose node id is not its
caller's fails with :class:`NodeIdMismatchError`, a response whose node id is not its sender's
is dropped and the sender banned, and ``nearest_peers`` entries whose node id is not their
peer id's are dropped (the peer that listed them is banned too). So nothing enters the
routing table or a search at a place its peer did not get by hashing its identity.

Resource handling: :meth:`serve` registers the handlers and :meth:`close` removes them; the
owner (``DHTNode``) calls both and owns the task group.

The records and limits live in :mod:`~swarmtrain.dht.protocol_types`, the checks of a store
request and a found value in :mod:`~swarmtrain.dht.protocol_messages`, the address bookkeeping
in :mod:`~swarmtrain.dht.protocol_addresses`; the public names are importable from here too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import trio

from swarmtrain.p2p import P2P, P2PError, PeerID, RemoteError
from swarmtrain.proto import dht_pb2

from .blacklist import Blacklist
from .call_failures import CallFailure, classify_call_error
from .identifiers import DHTID
from .protocol_addresses import PeerAddresses
from .protocol_messages import (
    check_serialized_field,
    parse_found_value,
    parse_store_request,
)
from .protocol_types import (
    EXPIRATION_CLOCK_ALLOWANCE,
    INLINE_VALIDATION_BYTES,
    DHTProtocolLimits,
    FindResult,
    FoundValue,
    MalformedRequestError,
    NodeIdMismatchError,
    StoreItem,
    merge_found_values,
    parse_dht_id,
)
from .routing import EvictionPolicy, PingRequest, RoutingTable
from .serialization import check_serialized_subkey
from .storage import DHTLocalStorage, DictionaryDHTValue, ValueWithExpiration, get_dht_time
from .storage_quota import StorageQuota, StoreOutcome
from .validation import NO_SUBKEY, DHTRecord, RecordValidatorBase

__all__ = [
    "EXPIRATION_CLOCK_ALLOWANCE",
    "DHTProtocol",
    "DHTProtocolLimits",
    "FindResult",
    "MalformedRequestError",
    "NodeIdMismatchError",
    "StoreItem",
    "merge_found_values",
]

logger = logging.getLogger(__name__)


class DHTProtocol:
    """RPC handlers and calls of one DHT node (see the module docstring)."""

    def __init__(
        self,
        p2p: P2P,
        node_id: DHTID,
        *,
        record_validator: RecordValidatorBase,
        nursery: trio.Nursery,
        bucket_size: int = 20,
        depth_modulo: int = 5,
        client_mode: bool = False,
        prefix: str = "swarmtrain",
        wait_timeout: float = 3.0,
        limits: DHTProtocolLimits | None = None,
        blacklist: Blacklist[PeerID] | None = None,
        storage_size: int | None = None,
        cache_size: int | None = None,
        max_subkeys: int | None = None,
        storage_quota: StorageQuota | None = None,
        max_expiration_horizon: float | None = None,
        eviction: EvictionPolicy | None = None,
    ):
        self.p2p, self.node_id, self.client_mode = p2p, node_id, client_mode
        self.record_validator = record_validator
        self.bucket_size, self.prefix, self.wait_timeout = bucket_size, prefix, wait_timeout
        self.limits = limits if limits is not None else DHTProtocolLimits()
        self.blacklist: Blacklist[PeerID] = blacklist if blacklist is not None else Blacklist()
        self.routing_table: RoutingTable[PeerID] = RoutingTable(
            node_id, bucket_size, depth_modulo, eviction=eviction
        )
        self.max_expiration_horizon = max_expiration_horizon
        # records of peers may expire up to the allowance later than our own are capped at
        horizon = (
            max_expiration_horizon + EXPIRATION_CLOCK_ALLOWANCE
            if max_expiration_horizon is not None
            else None
        )
        self.storage = DHTLocalStorage(
            storage_size, max_subkeys, quota=storage_quota, expiration_horizon=horizon
        )
        self.cache = DHTLocalStorage(
            cache_size, max_subkeys, quota=storage_quota, expiration_horizon=horizon
        )
        self._logged_refusals: set[tuple[PeerID, StoreOutcome]] = set()
        self._nursery = nursery
        self.validation_limiter = trio.CapacityLimiter(1)  # large records, one thread per node
        self._serving = False
        self._closed = False
        self._addresses = PeerAddresses(p2p, node_id, client_mode=client_mode, limits=self.limits)

    # --------------------------------------------------------------- lifetime

    def method_name(self, method: str) -> str:
        return f"{self.prefix}::DHTProtocol.{method}"

    def serve(self) -> None:
        """Register the RPC handlers (a client-mode node serves nothing)."""
        if self.client_mode:
            return
        size = self.limits.max_message_size
        for method, handler, request_type in (
            ("rpc_ping", self.rpc_ping, dht_pb2.DHTPingRequest),
            ("rpc_store", self.rpc_store, dht_pb2.DHTStoreRequest),
            ("rpc_find", self.rpc_find, dht_pb2.DHTFindRequest),
        ):
            self.p2p.add_protobuf_handler(
                self.method_name(method), handler, request_type, max_message_size=size
            )
        self._serving = True

    def close(self) -> None:
        """Stop serving; later routing-table pings are not started."""
        self._closed = True
        if self._serving:
            self._serving = False
            for method in ("rpc_ping", "rpc_store", "rpc_find"):
                try:
                    self.p2p.remove_protobuf_handler(self.method_name(method))
                except Exception:
                    logger.debug("could not remove handler %s", method, exc_info=True)

    # ---------------------------------------------------------- routing table

    def update_routing_table(self, node_id: DHTID, peer_id: PeerID) -> None:
        """Note that ``node_id`` (at ``peer_id``) is alive; a full bucket pings its stalest node."""
        if node_id == self.node_id or peer_id == self.p2p.peer_id:
            return
        request = self.routing_table.add_or_update_node(node_id, peer_id, now=get_dht_time())
        if request is not None and not self._closed:
            try:
                self._nursery.start_soon(self._check_stale_node, request)
            except RuntimeError:  # the node is shutting down
                pass

    async def _check_stale_node(self, request: PingRequest[PeerID]) -> None:
        # an answer or a failure is reported to the routing table by _call; a ping skipped
        # (a backed-off peer) just ends
        await self.call_ping(request.peer_id)
        self.routing_table.end_ping(request.node_id)

    def _on_failure(self, peer_id: PeerID, failure: CallFailure) -> None:
        """A call to ``peer_id`` failed: back off or ban it; mark it stale or drop it."""
        now = get_dht_time()
        if failure.bans:
            self.blacklist.register_failure(peer_id, now)
        else:
            self.blacklist.register_unresponsive(peer_id, now)
        node_id = self.routing_table.get_node_id(peer_id)
        if node_id is None:
            return
        if failure.drops:
            self.routing_table.remove(node_id)
        else:
            self.routing_table.register_failure(node_id, now=now)

    def _skips(self, peer_id: PeerID, now: float) -> bool:
        """Whether a call to ``peer_id`` is not sent: it is banned, or backed off while the
        routing table holds a fresh node (a node with nobody fresh asks everyone it knows)."""
        if self.blacklist.is_banned(peer_id, now):
            return True
        return (
            self.blacklist.is_backed_off(peer_id, now) and self.routing_table.num_fresh_nodes() > 0
        )

    # ---------------------------------------------------------------- server

    def _accept_caller(
        self, remote_id: PeerID, node_id: DHTID | None, addrs: list[str], maddrs=()
    ) -> None:
        if node_id is None:
            return  # a client: never routed to
        self._addresses.remember_addrs(remote_id, tuple(maddrs), addrs)
        self.blacklist.register_success(remote_id)  # it reached us: no longer backed off
        self.update_routing_table(node_id, remote_id)

    async def rpc_ping(self, request: dht_pb2.DHTPingRequest, context) -> dht_pb2.DHTPingResponse:
        """Answer with our node info; add the caller to the routing table unless it is a client."""
        self._accept_caller(
            context.remote_id, *self._addresses.parse_node_info(context.remote_id, request.peer)
        )
        return dht_pb2.DHTPingResponse(peer=self._addresses.node_info(), dht_time=get_dht_time())

    async def rpc_store(
        self, request: dht_pb2.DHTStoreRequest, context
    ) -> dht_pb2.DHTStoreResponse:
        """Validate every item, then store the valid ones (in the cache if ``in_cache``)."""
        caller = self._addresses.parse_node_info(context.remote_id, request.peer)
        items = parse_store_request(request, self.limits)
        valid = await self._validate_request(items)  # raises before any change
        self._accept_caller(context.remote_id, *caller)
        store_ok = self._store_valid(items, valid, request.in_cache, peer=context.remote_id)
        return dht_pb2.DHTStoreResponse(store_ok=store_ok, peer=self._addresses.node_info())

    async def _validate_request(self, items: Sequence[StoreItem]) -> list[bool]:
        """:meth:`validate_record` for each item: on the loop for a small request, otherwise
        in one worker thread per node (a thread of its own lets the loop take the GIL back
        every few ms, so other requests, pings included, go on meanwhile)."""
        if sum(len(item.value) for item in items) <= INLINE_VALIDATION_BYTES:
            return [self.validate_record(item) for item in items]
        return await trio.to_thread.run_sync(
            lambda: [self.validate_record(item) for item in items], limiter=self.validation_limiter
        )

    def validate_record(self, item: StoreItem) -> bool:
        """Whether the validators accept ``item`` and its unsigned value is a valid DHT value.

        :raises MalformedRequestError: its subkey is malformed (a peer's answer to a lookup
          is checked here), or the validators accept it but its value is malformed
        """
        if item.subkey:
            check_serialized_field(
                item.subkey, self.limits.max_subkey_size, "subkey", check_serialized_subkey
            )
        record = DHTRecord(
            item.key, item.subkey or NO_SUBKEY, item.value, float(item.expiration_time)
        )
        if not self.record_validator.validate(record):
            return False
        check_serialized_field(
            self.record_validator.strip_value(record), self.limits.max_value_size, "value"
        )
        return True

    def store_locally(self, items: Sequence[StoreItem], in_cache: bool = False) -> list[bool]:
        """Validate all items (raising before any change if one is malformed), then store."""
        return self._store_valid(items, [self.validate_record(item) for item in items], in_cache)

    def store_validated_locally(
        self, items: Sequence[StoreItem], in_cache: bool = False
    ) -> list[bool]:
        """Store items this node validated already (a search's results), without checking
        them again on the loop."""
        return self._store_valid(items, [True] * len(items), in_cache)

    def _store_valid(
        self,
        items: Sequence[StoreItem],
        valid: Sequence[bool],
        in_cache: bool,
        peer: PeerID | None = None,
    ) -> list[bool]:
        """Store the valid items for ``peer`` (None: this node; no quota applies)."""
        target = self.cache if in_cache else self.storage
        now = get_dht_time()
        results = []
        for ok, item in zip(valid, items, strict=True):
            outcome = (
                target.store_record(
                    item.key_id, item.value, item.expiration_time, now, item.subkey, peer
                )
                if ok
                else StoreOutcome.INVALID
            )
            results.append(outcome.stored)
            if peer is not None and outcome in _REPORTED_REFUSALS:
                self._log_refusal(peer, outcome, target)
        return results

    def _log_refusal(self, peer: PeerID, outcome: StoreOutcome, target: DHTLocalStorage) -> None:
        """Warn once per peer and reason that its stores are refused."""
        if (peer, outcome) in self._logged_refusals:
            return
        if len(self._logged_refusals) > 4096:
            self._logged_refusals.clear()
        self._logged_refusals.add((peer, outcome))
        usage = target.usage(peer, get_dht_time())
        logger.warning(
            "refusing records from %s: %s (it holds %d records, %d bytes here; quota %s); "
            "logged once per peer and reason",
            peer,
            outcome.value,
            usage.records,
            usage.bytes,
            target.ledger.quota,
        )

    def lookup_locally(self, key_id: DHTID, now: float) -> FoundValue | None:
        """What storage and cache hold under ``key_id`` (merged; a snapshot, safe across awaits)."""
        return merge_found_values(
            self.storage.get_copy(key_id, now), self.cache.get_copy(key_id, now), now
        )

    async def rpc_find(self, request: dht_pb2.DHTFindRequest, context) -> dht_pb2.DHTFindResponse:
        """For each key id: the value we hold (if any) and the nodes we know nearest to it."""
        caller_id, addrs, announced = self._addresses.parse_node_info(
            context.remote_id, request.peer
        )
        if len(request.keys) > self.limits.max_items:
            raise MalformedRequestError(
                f"{len(request.keys)} keys in one request, more than {self.limits.max_items}"
            )
        key_ids = [parse_dht_id(key, f"keys[{i}]") for i, key in enumerate(request.keys)]
        self._accept_caller(context.remote_id, caller_id, addrs, announced)
        now = get_dht_time()
        response = dht_pb2.DHTFindResponse(peer=self._addresses.node_info())
        k = min(self.bucket_size, self.limits.max_nearest_peers)
        if request.max_nearest_peers:  # 0: the caller did not say (our bucket_size)
            k = min(k, request.max_nearest_peers)
        for key_id in key_ids:
            result = response.results.add()
            found = self.lookup_locally(key_id, now)
            if isinstance(found, ValueWithExpiration) and isinstance(
                found.value, DictionaryDHTValue
            ):
                result.type = dht_pb2.DHTFindResult.FOUND_DICTIONARY
                result.value = found.value.packb(now)
                result.expiration_time = found.expiration_time
            elif found is not None:
                result.type = dht_pb2.DHTFindResult.FOUND_REGULAR
                result.value = cast(bytes, found.value)  # a regular value: its bytes
                result.expiration_time = found.expiration_time
            for node_id, peer_id in self.routing_table.get_nearest_neighbors(
                key_id, k, exclude=caller_id
            ):
                result.nearest_peers.add(
                    node_id=node_id.to_bytes(),
                    peer_id=peer_id.to_bytes(),
                    maddrs=self._addresses.maddrs_of(peer_id),
                )
        return response

    # ---------------------------------------------------------------- client

    async def _call(self, peer_id: PeerID, method: str, request, response_type):
        if self._skips(peer_id, get_dht_time()):
            return None
        try:
            response = await self.p2p.call_protobuf_handler(
                peer_id,
                self.method_name(method),
                request,
                response_type,
                timeout=self.wait_timeout,
                max_message_size=self.limits.max_message_size,
            )
        except RemoteError as e:
            logger.warning("%s rejected our %s: %s", peer_id, method, e)
            return None
        except P2PError as e:
            failure = classify_call_error(e)
            log = logger.warning if failure.bans else logger.debug
            log("%s to %s failed (%s): %s", method, peer_id, failure.value, e)
            self._on_failure(peer_id, failure)
            return None
        self.blacklist.register_success(peer_id)
        try:
            node_id, _, _ = self._addresses.parse_node_info(peer_id, response.peer)
        except MalformedRequestError as e:
            logger.warning("malformed %s response from %s (banned): %s", method, peer_id, e)
            self._on_failure(peer_id, CallFailure.MISBEHAVED)
            return None
        if node_id is not None:
            self.update_routing_table(node_id, peer_id)
        return response

    async def call_ping(self, peer_id: PeerID) -> DHTID | None:
        """The node id of ``peer_id``, or None if it did not answer as a DHT server."""
        response = await self._call(
            peer_id,
            "rpc_ping",
            dht_pb2.DHTPingRequest(peer=self._addresses.node_info()),
            dht_pb2.DHTPingResponse,
        )
        if response is None or not response.peer.node_id:
            return None
        return DHTID.from_bytes(response.peer.node_id)

    async def call_store(
        self, peer_id: PeerID, items: Sequence[StoreItem], in_cache: bool = False
    ) -> list[bool] | None:
        """Ask ``peer_id`` to store ``items``: whether each was stored, or None if no answer."""
        request = dht_pb2.DHTStoreRequest(
            keys=[item.key for item in items],
            subkeys=[item.subkey or NO_SUBKEY for item in items],
            values=[item.value for item in items],
            expiration_time=[item.expiration_time for item in items],
            in_cache=in_cache,
            peer=self._addresses.node_info(),
        )
        response = await self._call(peer_id, "rpc_store", request, dht_pb2.DHTStoreResponse)
        if response is None:
            return None
        if len(response.store_ok) != len(items):
            logger.warning("%s answered rpc_store with a wrong number of results (banned)", peer_id)
            self._on_failure(peer_id, CallFailure.MISBEHAVED)
            return None
        return list(response.store_ok)

    async def call_find(
        self, peer_id: PeerID, key_ids: Sequence[DHTID], max_nearest_peers: int | None = None
    ) -> dict[DHTID, FindResult] | None:
        """Ask ``peer_id`` about ``key_ids``; values in the answer are not validated yet.

        :param max_nearest_peers: list at most this many nearest peers per key (default: as
          many as the callee's bucket_size)
        """
        request = dht_pb2.DHTFindRequest(
            keys=[key_id.to_bytes() for key_id in key_ids],
            peer=self._addresses.node_info(),
            max_nearest_peers=max_nearest_peers or 0,
        )
        response = await self._call(peer_id, "rpc_find", request, dht_pb2.DHTFindResponse)
        if response is None:
            return None
        if len(response.results) != len(key_ids):
            logger.warning("%s answered rpc_find with a wrong number of results (banned)", peer_id)
            self._on_failure(peer_id, CallFailure.MISBEHAVED)
            return None
        now = get_dht_time()
        found, num_unbound = {}, 0
        for key_id, result in zip(key_ids, response.results, strict=True):
            nearest, unbound = self._addresses.parse_nearest(result)
            found[key_id] = FindResult(
                parse_found_value(peer_id, result, now, self.limits, self.max_expiration_horizon),
                nearest,
            )
            num_unbound += unbound
        if num_unbound:
            # our nodes only list pairs they checked: this peer made them up (or runs an
            # older version); use the rest of its answer, but ask it nothing more for a while
            logger.warning(
                "%s listed %d nearest peers whose node ids are not derived from their peer ids;"
                " ignored them and banned it",
                peer_id,
                num_unbound,
            )
            self._on_failure(peer_id, CallFailure.MISBEHAVED)
        return found


#: refusals worth a warning: a peer past its quota or its expiration horizon (stale or
#: outdated writes are routine)
_REPORTED_REFUSALS = frozenset(
    {
        StoreOutcome.EXPIRATION_TOO_FAR,
        StoreOutcome.PEER_RECORD_QUOTA,
        StoreOutcome.PEER_BYTE_QUOTA,
        StoreOutcome.TOO_LARGE,
    }
)
