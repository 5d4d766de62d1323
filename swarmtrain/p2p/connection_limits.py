"""How many libp2p connections other peers may hold to a host, in all and per source address.

py-libp2p enforces connection limits through the resource manager each swarm carries; its
defaults are fixed (256 inbound connections, any number from one address, a host-wide stream
semaphore that inbound and outbound streams share). ``build_resource_manager`` gives each of our
hosts one configured from ``ResourceLimits``:

- inbound connections: ``max_inbound_connections`` over all peers (at most a quarter of the soft
  ``ulimit -n``: lanes take up to half), ``max_inbound_connections_per_ip`` from one address
  (an IPv6 /64 counts as one address), so identities from one machine cannot take every slot;
- outbound connections are ours, counted in total only;
- no host-wide stream semaphore: streams are bounded per peer by the RPC server
  (``max_inbound_calls_per_peer``), and our own outbound calls never queue behind streams
  other peers opened to us.

py-libp2p's connection manager has limits of its own that must agree
(``build_connection_config``): its inbound cap (``max_connections - min_connections``, 300 by
default, which silently bound before ours) is set above ours, and its pruner, which closes
connections without open streams older than a grace period once the host holds more than a
high watermark, gets a watermark of 3/4 of our inbound cap. A host at its cap also asks the
pruner to run when it refuses a connection, so that a crowd of identities holding idle
connections loses them to newcomers (py-libp2p runs it only when a connection is added).

``AddressCounter`` is the sans-IO per-address count.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from libp2p.network.config import ConnectionConfig
from libp2p.rcmgr import ResourceManager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.rcmgr.manager import ResourceLimits as Libp2pLimits

logger = logging.getLogger(__name__)

#: connections py-libp2p lets one peer id hold (several dials may race); its default
CONNECTIONS_PER_PEER = 8
#: handshakes in progress at once (inbound, outbound): py-libp2p's defaults
PENDING_CONNECTIONS = 64
#: outbound connections (ours: the DHT and averaging dial what they need)
MAX_OUTBOUND_CONNECTIONS = 1024


def address_key(ip: str) -> str | None:
    """The source-address bucket of ``ip`` (itself for IPv4, its /64 for IPv6; None if it is
    not an IP address, e.g. a relayed connection's missing endpoint)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))
    return str(address)


def connections_within_fd_limit(max_inbound: int, fd_soft_limit: int | None) -> int:
    """The inbound connection cap for a process that may open ``fd_soft_limit`` files (None
    or negative: unlimited): ``max_inbound``, or a quarter of the soft limit when lower (each
    connection is a file descriptor; lanes may take half)."""
    if fd_soft_limit is None or fd_soft_limit < 0:
        return max_inbound
    return max(1, min(max_inbound, fd_soft_limit // 4))


class AddressCounter:
    """Inbound connections per source address, against ``limit``.

    Shaped like py-libp2p's ``CIDRLimiter`` (``allow``/``acquire``/``release`` by endpoint
    IP), which the resource manager calls for each connection it admits and closes."""

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError("a per-address connection limit must be positive")
        self.limit = limit
        self.refused = 0
        self._counts: Counter[str] = Counter()

    def count(self, ip: str) -> int:
        key = address_key(ip)
        return self._counts[key] if key is not None else 0

    def allow(self, endpoint_ip: str | None) -> bool:
        key = address_key(endpoint_ip) if endpoint_ip else None
        if key is None or self._counts[key] < self.limit:
            return True
        self.refused += 1
        logger.debug("refused a connection from %s: %d already open", endpoint_ip, self.limit)
        return False

    def acquire(self, endpoint_ip: str | None) -> bool:
        key = address_key(endpoint_ip) if endpoint_ip else None
        if key is None:
            return True
        if self._counts[key] >= self.limit:
            self.refused += 1
            return False
        self._counts[key] += 1
        return True

    def release(self, endpoint_ip: str | None) -> None:
        key = address_key(endpoint_ip) if endpoint_ip else None
        if key is None or key not in self._counts:
            return
        self._counts[key] -= 1
        if self._counts[key] <= 0:
            del self._counts[key]


class SwarmResourceManager(ResourceManager):
    """py-libp2p's resource manager with per-address limits on inbound connections only
    (an outbound connection's endpoint is the peer we dialled, not a crowd at our door).

    py-libp2p opens two scopes per inbound connection: one before the handshake (no peer id
    yet) and one after it, then closes the first. The address is counted in the second only;
    the first refuses an address already at its limit, before any handshake work."""

    cidr_limiter: Any
    #: called before each inbound handshake (the host asks py-libp2p's pruner to look, at
    #: most once a second: a host at its cap never adds a connection, which is what else
    #: triggers it)
    on_inbound: Callable[[], None] | None = None

    def open_connection(
        self, peer_id: Any | None = None, endpoint_ip: str | None = None, direction: str = "inbound"
    ):
        if str(direction).lower().endswith("outbound"):
            endpoint_ip = None
        elif peer_id is None:  # before the handshake: check, do not count
            if self.on_inbound is not None:
                self.on_inbound()
            if endpoint_ip and not self.addresses.allow(endpoint_ip):
                return None
            endpoint_ip = None
        return super().open_connection(peer_id, endpoint_ip=endpoint_ip, direction=direction)

    @property
    def addresses(self) -> AddressCounter:
        return self.cidr_limiter


def build_resource_manager(
    max_inbound_connections: int, max_inbound_connections_per_ip: int
) -> SwarmResourceManager:
    """The resource manager of one host (see the module docstring)."""
    total = max_inbound_connections + MAX_OUTBOUND_CONNECTIONS
    manager = SwarmResourceManager(
        # streams: bounded per peer by our RPC server; the count here must never bind
        limits=Libp2pLimits(max_connections=total, max_streams=2**62),
        connection_limits=ConnectionLimits(
            max_pending_inbound=PENDING_CONNECTIONS,
            max_pending_outbound=PENDING_CONNECTIONS,
            max_established_inbound=max_inbound_connections,
            max_established_outbound=MAX_OUTBOUND_CONNECTIONS,
            max_established_per_peer=CONNECTIONS_PER_PEER,
            max_established_total=total,
        ),
        enable_metrics=False,
        # both change limits at run time (a breaker refuses every connection for 60 s after
        # five failed admissions): a host's limits are the ones it was configured with
        enable_circuit_breaker=False,
        enable_graceful_degradation=False,
    )
    manager.cidr_limiter = AddressCounter(max_inbound_connections_per_ip)
    return manager


def build_connection_config(
    max_inbound_connections: int, auto_connect: bool, grace_period: float
) -> ConnectionConfig:
    """py-libp2p's connection-manager settings for a host whose inbound cap is
    ``max_inbound_connections`` (see the module docstring). Without ``auto_connect`` nothing
    dials to keep a minimum (py-libp2p's auto-connector would dial half the swarm from the
    peerstore the DHT fills), so crowded hosts trim idle connections toward none; with it,
    py-libp2p's own watermarks (100-300) stay, within the cap."""
    defaults = ConnectionConfig()
    minimum = defaults.min_connections if auto_connect else 0
    low = defaults.low_watermark if auto_connect else 0
    high = max_inbound_connections * 3 // 4
    if auto_connect:
        high = min(defaults.high_watermark, high)
    high = max(low, high)
    return ConnectionConfig(
        # its own inbound cap (max - min) and its check of all connections before a handshake
        # stay above ours: the resource manager enforces the inbound cap
        max_connections=max_inbound_connections + MAX_OUTBOUND_CONNECTIONS + minimum,
        min_connections=minimum,
        low_watermark=low,
        high_watermark=high,
        grace_period=grace_period,
    )


def keep_auto_connector_idle(swarm: Any) -> None:
    """py-libp2p's auto-connector dials peers from the peerstore (which the DHT fills) until a
    host holds the midpoint of its watermarks, even with a low watermark of 0 (150
    connections with its default high watermark): this swarm's (the instance's) never dials;
    swarmtrain connects to the peers it talks to."""
    connector = getattr(swarm, "auto_connector", None)
    if connector is None or not hasattr(connector, "maybe_connect"):
        raise RuntimeError("libp2p internals changed: the swarm has no auto_connector")

    async def maybe_connect() -> None:
        return None

    connector.maybe_connect = maybe_connect
