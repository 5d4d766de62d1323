"""Settings and statistics of a :class:`~swarmtrain.dht.node.DHTNode`: :class:`DHTNodeConfig`
(validated, hivemind's keyword names), its defaults, the hivemind-only keywords a node accepts,
and :class:`DHTNodeStatistics`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .blacklist import BlacklistStatistics
from .protocol_types import DHTProtocolLimits
from .routing import RoutingTableStatistics
from .storage_quota import StorageQuota

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_MAX_EXPIRATION_HORIZON",
    "DEFAULT_MAX_SUBKEYS",
    "DEFAULT_STORAGE_SIZE",
    "DHTNodeConfig",
    "DHTNodeStatistics",
    "check_hivemind_only_keywords",
]

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
    :param blacklist_time: first ban (seconds) of a misbehaving peer and first backoff of an
      unresponsive one (kept in the routing table, stale); each doubles per failure
      (``backoff_rate``), a backoff up to 30 s (see :mod:`~swarmtrain.dht.call_failures`)
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
