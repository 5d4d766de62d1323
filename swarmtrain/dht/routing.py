"""Kademlia routing table (sans-IO): decides whom to ping, never pings.

Peer ids are opaque hashable values here (the node layer uses libp2p peer-id strings).

A node that stops answering is not dropped at once (a loaded machine misses a few deadlines):
:meth:`RoutingTable.register_failure` marks it stale, lookups rank it after fresh nodes, and it
gives its place to a replacement only after several consecutive failures spread over some
time (:class:`EvictionPolicy`), and only if a replacement is waiting; an answer makes it fresh
again. So failures alone never empty a table. A misbehaving node is removed at once
(:meth:`RoutingTable.remove`).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from .identifiers import DHTID
from .storage import get_dht_time

__all__ = [
    "EvictionPolicy",
    "KBucket",
    "NodeFailures",
    "PingRequest",
    "RoutingTable",
    "RoutingTableStatistics",
]

PeerT = TypeVar("PeerT", bound=Hashable)


@dataclass(frozen=True)
class PingRequest(Generic[PeerT]):
    """Action: ping this node, then report the outcome: ``add_or_update_node`` if it
    answered (the newcomer stays a replacement), ``register_failure`` if it did not, and
    :meth:`RoutingTable.end_ping` if the ping was not sent.

    A full bucket asks for its stalest node to be checked (a stale one first, else the least
    recently seen).
    """

    node_id: DHTID
    peer_id: PeerT


@dataclass(frozen=True)
class RoutingTableStatistics:
    """A snapshot of :class:`RoutingTable` occupancy."""

    num_nodes: int
    num_replacement_nodes: int
    num_buckets: int
    num_pending_pings: int
    max_depth: int
    num_stale_nodes: int = 0  #: main-list nodes whose last request failed


@dataclass(frozen=True)
class EvictionPolicy:
    """When a main-list node that stopped answering gives its place to a waiting replacement:
    after ``max_failures`` consecutive failures, the first at least ``min_failing_time``
    seconds before the last (a burst of concurrent timeouts counts as one moment)."""

    max_failures: int = 3
    min_failing_time: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.max_failures, bool) or not (
            isinstance(self.max_failures, int) and self.max_failures >= 1
        ):
            raise ValueError(f"max_failures must be a positive integer, got {self.max_failures!r}")
        if not self.min_failing_time >= 0:
            raise ValueError(f"min_failing_time must be >= 0, got {self.min_failing_time!r}")


@dataclass(frozen=True)
class NodeFailures:
    """Consecutive failed requests to a node since it last answered."""

    count: int
    first: float  #: time of the first of them
    last: float  #: time of the latest

    def after(self, now: float) -> NodeFailures:
        """These failures and one more at ``now``."""
        return NodeFailures(self.count + 1, self.first, max(self.last, now))

    def allow_eviction(self, policy: EvictionPolicy) -> bool:
        """Whether the node may give its place to a replacement under ``policy``."""
        return self.count >= policy.max_failures and self.last - self.first >= (
            policy.min_failing_time
        )


class KBucket(Generic[PeerT]):
    """Up to ``size`` nodes whose ids lie in ``[lower, upper)``, least-recently-seen first.

    Nodes that arrive while the bucket is full wait in a replacement list (also at most ``size``,
    oldest dropped first) and are promoted when a main node is removed, or evicted after
    failing as ``eviction`` says; a newcomer takes the place of a main node that may be
    evicted at once.
    """

    def __init__(
        self,
        lower: int,
        upper: int,
        size: int,
        depth: int = 0,
        eviction: EvictionPolicy | None = None,
    ):
        if not 0 <= lower < upper or size < 1:
            raise ValueError(f"invalid bucket lower={lower}, upper={upper}, size={size}")
        self.lower, self.upper, self.size, self.depth = lower, upper, size, depth
        self.eviction = eviction if eviction is not None else EvictionPolicy()
        self.nodes: dict[DHTID, PeerT] = {}  # insertion order = least recently seen first
        self.replacement_nodes: dict[DHTID, PeerT] = {}  # same order
        self.failures: dict[DHTID, NodeFailures] = {}  # stale main-list nodes
        self.pending_pings: set[DHTID] = set()
        self.last_updated = float("-inf")

    @property
    def nodes_to_peer_id(self) -> dict[DHTID, PeerT]:
        """hivemind's name of :attr:`nodes` (main-list nodes, least recently seen first)."""
        return self.nodes

    def has_in_range(self, node_id: int) -> bool:
        """Whether ``node_id`` falls into this bucket's range."""
        return self.lower <= node_id < self.upper

    def add_or_update_node(
        self, node_id: DHTID, peer_id: PeerT, now: float
    ) -> tuple[bool, DHTID | None]:
        """Mark ``node_id`` as just seen (fresh: its failures are forgotten).

        :returns: (whether the node is now in the main list, a node that left the bucket to
          make room: the oldest replacement, or a failing main node evicted for the newcomer)
        """
        if not self.has_in_range(node_id):
            raise ValueError(f"{node_id!r} is outside bucket [{self.lower:#x}, {self.upper:#x})")
        self.last_updated = max(self.last_updated, now)
        self.pending_pings.discard(node_id)
        self.failures.pop(node_id, None)
        if node_id in self.nodes:
            del self.nodes[node_id]
            self.nodes[node_id] = peer_id
            return True, None
        if len(self.nodes) < self.size:
            self.replacement_nodes.pop(node_id, None)
            self.nodes[node_id] = peer_id
            return True, None
        self.replacement_nodes.pop(node_id, None)
        evicted = self._evictable_node()
        if evicted is not None:
            self._remove_main(evicted)
            self.nodes[node_id] = peer_id
            return True, evicted
        self.replacement_nodes[node_id] = peer_id
        if len(self.replacement_nodes) > self.size:
            dropped = next(iter(self.replacement_nodes))
            del self.replacement_nodes[dropped]
            return False, dropped
        return False, None

    def _evictable_node(self) -> DHTID | None:
        for node_id, failures in self.failures.items():
            if failures.allow_eviction(self.eviction):
                return node_id
        return None

    def request_ping_node(self) -> PingRequest[PeerT] | None:
        """The stalest main node not already awaiting a ping (a failing one first, else the
        least recently seen), or None."""
        candidates = [*self.failures, *self.nodes]
        for node_id in candidates:
            if node_id not in self.pending_pings:
                self.pending_pings.add(node_id)
                return PingRequest(node_id, self.nodes[node_id])
        return None

    def register_failure(self, node_id: DHTID, now: float) -> bool:
        """A request to ``node_id`` failed on the network (no answer in time, refused, reset).

        A replacement is dropped; a main node is marked stale and evicted (the most recently
        seen replacement taking its place) once :attr:`eviction` allows it and a replacement
        is waiting. :returns: whether the node left the bucket
        """
        self.pending_pings.discard(node_id)
        if self.replacement_nodes.pop(node_id, None) is not None:
            return True
        if node_id not in self.nodes:
            return False
        previous = self.failures.get(node_id)
        failures = NodeFailures(1, now, now) if previous is None else previous.after(now)
        self.failures[node_id] = failures
        if failures.allow_eviction(self.eviction) and self.replacement_nodes:
            return self.remove(node_id)
        return False

    def is_stale(self, node_id: DHTID) -> bool:
        """Whether ``node_id`` is a main node whose last request failed."""
        return node_id in self.failures

    def _remove_main(self, node_id: DHTID) -> None:
        del self.nodes[node_id]
        self.failures.pop(node_id, None)
        self.pending_pings.discard(node_id)

    def remove(self, node_id: DHTID) -> bool:
        """Forget a node; a removed main node is replaced by the most recently seen replacement."""
        self.pending_pings.discard(node_id)
        if self.replacement_nodes.pop(node_id, None) is not None:
            return True
        if node_id not in self.nodes:
            return False
        self._remove_main(node_id)
        if self.replacement_nodes:
            promoted, peer_id = self.replacement_nodes.popitem()
            self.nodes[promoted] = peer_id
        return True

    def split(self) -> tuple[KBucket[PeerT], KBucket[PeerT]]:
        """Split the range in two halves; replacements fill the free slots of each half."""
        if self.upper - self.lower < 2:
            raise ValueError("a bucket of width 1 cannot be split")
        midpoint = (self.lower + self.upper) // 2
        halves = (
            KBucket[PeerT](self.lower, midpoint, self.size, self.depth + 1, self.eviction),
            KBucket[PeerT](midpoint, self.upper, self.size, self.depth + 1, self.eviction),
        )
        for half in halves:
            half.last_updated = self.last_updated
        for source in (self.nodes, self.replacement_nodes):
            for node_id, peer_id in source.items():
                half = halves[node_id >= midpoint]
                target = half.nodes if len(half.nodes) < half.size else half.replacement_nodes
                target[node_id] = peer_id
        for node_id in self.pending_pings:
            halves[node_id >= midpoint].pending_pings.add(node_id)
        for node_id, failures in self.failures.items():  # main nodes stay main nodes
            halves[node_id >= midpoint].failures[node_id] = failures
        return halves

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return (
            f"KBucket(depth={self.depth}, nodes={len(self.nodes)}/{self.size}, "
            f"stale={len(self.failures)}, replacements={len(self.replacement_nodes)}, "
            f"range=[{self.lower:#x}, {self.upper:#x}))"
        )


class RoutingTable(Generic[PeerT]):
    """Kademlia routing table of ``node_id``: buckets of up to ``bucket_size`` nodes.

    A full bucket is split if it covers ``node_id`` or its depth is not a multiple of
    ``depth_modulo`` (Kademlia paper, section 4.2); otherwise the newcomer becomes a replacement
    and :meth:`add_or_update_node` returns a :class:`PingRequest` for the bucket's stalest node.
    Failed requests are reported with :meth:`register_failure` (``eviction`` says when a
    failing node gives way to a replacement; see the module doc).
    """

    def __init__(
        self,
        node_id: DHTID,
        bucket_size: int = 20,
        depth_modulo: int = 5,
        *,
        eviction: EvictionPolicy | None = None,
    ):
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        if depth_modulo < 1:
            raise ValueError(f"depth_modulo must be positive, got {depth_modulo}")
        self.node_id, self.bucket_size, self.depth_modulo = node_id, bucket_size, depth_modulo
        self.eviction = eviction if eviction is not None else EvictionPolicy()
        self.buckets: list[KBucket[PeerT]] = [
            KBucket(DHTID.MIN, DHTID.MAX, bucket_size, eviction=self.eviction)
        ]
        self._lowers: list[int] = [DHTID.MIN]
        self._uid_to_peer_id: dict[DHTID, PeerT] = {}
        self._peer_id_to_uid: dict[PeerT, DHTID] = {}

    def get_bucket_index(self, node_id: int) -> int:
        """Index in :attr:`buckets` of the bucket whose range holds ``node_id``."""
        if not DHTID.MIN <= node_id < DHTID.MAX:
            raise ValueError(f"{node_id} is not a valid DHTID")
        return bisect.bisect_right(self._lowers, node_id) - 1

    def add_or_update_node(
        self, node_id: DHTID, peer_id: PeerT, *, now: float | None = None
    ) -> PingRequest[PeerT] | None:
        """Record that ``node_id`` (reachable as ``peer_id``) was just seen alive at time ``now``
        (default: :func:`~swarmtrain.dht.storage.get_dht_time`).

        :returns: a node the caller should ping (see :class:`PingRequest`), or None
        """
        if node_id == self.node_id:
            return None
        if now is None:
            now = get_dht_time()
        previous_uid = self._peer_id_to_uid.get(peer_id)
        if previous_uid is not None and previous_uid != node_id:
            self.remove(previous_uid)  # the peer restarted with a new DHT id
        previous_peer = self._uid_to_peer_id.get(node_id)
        if previous_peer is not None and previous_peer != peer_id:
            del self._peer_id_to_uid[previous_peer]
        self._uid_to_peer_id[node_id] = peer_id
        self._peer_id_to_uid[peer_id] = node_id

        while True:
            index = self.get_bucket_index(node_id)
            bucket = self.buckets[index]
            added, dropped = bucket.add_or_update_node(node_id, peer_id, now)
            if dropped is not None:
                self._forget(dropped)
            if added:
                return None
            can_split = bucket.upper - bucket.lower >= 2
            if can_split and (
                bucket.has_in_range(self.node_id) or bucket.depth % self.depth_modulo != 0
            ):
                self._split_bucket(index)  # the newcomer is re-filed into one of the halves
                continue
            return bucket.request_ping_node()

    def _split_bucket(self, index: int) -> None:
        left, right = self.buckets[index].split()
        self.buckets[index : index + 1] = [left, right]
        self._lowers[index : index + 1] = [left.lower, right.lower]

    def _forget(self, node_id: DHTID) -> None:
        peer_id = self._uid_to_peer_id.pop(node_id, None)
        if peer_id is not None and self._peer_id_to_uid.get(peer_id) == node_id:
            del self._peer_id_to_uid[peer_id]

    def remove(self, node_id: DHTID) -> bool:
        """Forget a node at once (it misbehaved); a replacement takes its place. True if known."""
        removed = self.buckets[self.get_bucket_index(node_id)].remove(node_id)
        self._forget(node_id)
        return removed

    def register_failure(self, node_id: DHTID, *, now: float | None = None) -> bool:
        """A request to ``node_id`` failed on the network at ``now`` (default:
        :func:`~swarmtrain.dht.storage.get_dht_time`): the node is stale until it answers again,
        and evicted only as :class:`EvictionPolicy` allows and if a replacement is waiting.

        :returns: whether the node left the table
        """
        if now is None:
            now = get_dht_time()
        left = self.buckets[self.get_bucket_index(node_id)].register_failure(node_id, now)
        if left:
            self._forget(node_id)
        return left

    def end_ping(self, node_id: DHTID) -> None:
        """A :class:`PingRequest` for ``node_id`` ended without a report (it was not sent)."""
        self.buckets[self.get_bucket_index(node_id)].pending_pings.discard(node_id)

    def is_stale(self, node_id: DHTID) -> bool:
        """Whether ``node_id`` is a main-list node whose last request failed."""
        return self.buckets[self.get_bucket_index(node_id)].is_stale(node_id)

    def num_fresh_nodes(self) -> int:
        """Main-list nodes that answered since their last failure (0: this node is alone,
        though it may still know stale nodes)."""
        return sum(len(bucket.nodes) - len(bucket.failures) for bucket in self.buckets)

    def __delitem__(self, node_id: DHTID) -> None:
        if not self.remove(node_id):
            raise KeyError(node_id)

    def __contains__(self, item: object) -> bool:
        """Whether a node id (an ``int``), or the peer id of a node, is in a bucket's main list
        (replacements do not count)."""
        if not isinstance(item, int):
            node_id = self._peer_id_to_uid.get(cast(PeerT, item))
            return node_id is not None and node_id in self
        if not DHTID.MIN <= item < DHTID.MAX:
            return False
        return item in self.buckets[self.get_bucket_index(item)].nodes

    def __getitem__(self, item: DHTID | PeerT) -> PeerT | DHTID:
        """The peer id of a main-list node id, or the node id of a main-list node's peer id
        (hivemind's lookup in both directions). :raises KeyError: not in a main list"""
        if item not in self:
            raise KeyError(item)
        if isinstance(item, int):
            return self._uid_to_peer_id[DHTID(item)]
        return self._peer_id_to_uid[item]

    def get(
        self, *, node_id: DHTID | None = None, peer_id: PeerT | None = None, default=None
    ) -> PeerT | DHTID | None:
        """``self[node_id]`` or ``self[peer_id]`` (exactly one of them), else ``default``."""
        if (node_id is None) == (peer_id is None):
            raise TypeError("pass exactly one of node_id and peer_id")
        try:
            return self[node_id if node_id is not None else cast(PeerT, peer_id)]
        except KeyError:
            return default

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self.buckets)

    def __iter__(self) -> Iterator[tuple[DHTID, PeerT]]:
        """(node_id, peer_id) for every main-list node."""
        for bucket in self.buckets:
            yield from bucket.nodes.items()

    def get_peer_id(self, node_id: DHTID) -> PeerT | None:
        """Peer id of a known node (main list or replacement), or None."""
        return self._uid_to_peer_id.get(node_id)

    def get_node_id(self, peer_id: PeerT) -> DHTID | None:
        """DHT id of a known peer (main list or replacement), or None."""
        return self._peer_id_to_uid.get(peer_id)

    def get_nearest_neighbors(
        self, query_id: int, k: int, exclude: DHTID | None = None
    ) -> list[tuple[DHTID, PeerT]]:
        """Up to ``k`` main-list nodes nearest to ``query_id`` by XOR distance, nearest first,
        stale nodes after all fresh ones (they fill the list only if fresh nodes are too few)."""
        if k < 0:
            raise ValueError(f"k must be non-negative, got {k}")
        query = int(query_id)
        if not any(bucket.failures for bucket in self.buckets):
            fresh = (item for item in self if item[0] != exclude)
            return heapq.nsmallest(k, fresh, key=lambda item: item[0] ^ query)
        candidates = (
            (bucket.is_stale(node_id), node_id ^ query, node_id, peer_id)
            for bucket in self.buckets
            for node_id, peer_id in bucket.nodes.items()
            if node_id != exclude
        )
        return [(node_id, peer_id) for _, _, node_id, peer_id in heapq.nsmallest(k, candidates)]

    def get_stale_buckets(self, now: float, max_age: float) -> list[KBucket[PeerT]]:
        """Buckets that saw no node for more than ``max_age`` seconds before ``now``."""
        return [bucket for bucket in self.buckets if bucket.last_updated < now - max_age]

    def get_refresh_ids(
        self, now: float, max_age: float, rng: random.Random | None = None
    ) -> list[DHTID]:
        """A random id inside each stale bucket: look them up to refresh the table."""
        rng = rng if rng is not None else random.Random()
        return [
            DHTID(rng.randrange(bucket.lower, bucket.upper))
            for bucket in self.get_stale_buckets(now, max_age)
        ]

    def statistics(self) -> RoutingTableStatistics:
        """Current occupancy as a frozen record."""
        return RoutingTableStatistics(
            num_nodes=len(self),
            num_replacement_nodes=sum(len(b.replacement_nodes) for b in self.buckets),
            num_buckets=len(self.buckets),
            num_pending_pings=sum(len(b.pending_pings) for b in self.buckets),
            max_depth=max(bucket.depth for bucket in self.buckets),
            num_stale_nodes=sum(len(b.failures) for b in self.buckets),
        )

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"RoutingTable(node_id={self.node_id!r}, nodes={stats.num_nodes}, "
            f"buckets={stats.num_buckets}, bucket_size={self.bucket_size})"
        )
