"""``P2P``: a py-libp2p host with a persistent identity and typed protobuf RPC.

The only module (with dialling.py, relay.py and pubsub.py) that talks to libp2p's host API.
Lifetime::

    async with P2P.create(initial_peers=[...], identity_path="peer.key") as p2p:
        p2p.add_protobuf_handler("demo::Echo.echo", echo, EchoRequest)
        reply = await p2p.call_protobuf_handler(peer_id, "demo::Echo.echo", req, EchoReply)

Resource handling: ``create`` opens the host, a task group for background work (relay
reservations, hole punching) and the RPC server; leaving the ``async with`` cancels running
calls (callers get ``RPCCancelledError``), stops background tasks and closes every connection.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Literal, TypeVar, overload

import multiaddr
import trio
from google.protobuf.message import Message
from libp2p import new_host
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.network.config import RetryConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID

from swarmtrain.p2p import rpc, rpc_client
from swarmtrain.p2p._tuning import (
    check_libp2p_version,
    configure_process,
    tune_host,
)
from swarmtrain.p2p.addresses import DialableAddrs, expand_unspecified
from swarmtrain.p2p.autonat import AutoNAT, Reachability, connection_path, observed_ips
from swarmtrain.p2p.connection_limits import (
    SwarmResourceManager,
    build_connection_config,
    build_resource_manager,
    connections_within_fd_limit,
    keep_auto_connector_idle,
)
from swarmtrain.p2p.dialling import Dialling, as_peer_id
from swarmtrain.p2p.errors import (
    P2PError,
    PeerUnreachableError,
    RPCTimeoutError,
    SwarmKeyMismatchError,
)
from swarmtrain.p2p.identity import load_or_create_identity
from swarmtrain.p2p.lane import (
    DEFAULT_STRIPE_MIN_RTT,
    DEFAULT_STRIPES,
    DataLanes,
    LaneStream,
    lane_listen_host,
    lanes_disabled_by_env,
)
from swarmtrain.p2p.lane_connections import AUTO_CONGESTION
from swarmtrain.p2p.lane_pool import BulkStreamPool
from swarmtrain.p2p.lane_stripes import StripedLane
from swarmtrain.p2p.limits import ResourceLimits, fd_soft_limit
from swarmtrain.p2p.listen_check import check_addresses_free
from swarmtrain.p2p.private_network import PrivateNoiseTransport, resolve_swarm_key
from swarmtrain.p2p.relay import RelayManager
from swarmtrain.p2p.rpc_stream import RPCStream
from swarmtrain.p2p.stripe_core import MAX_STRIPES
from swarmtrain.utils import loop_stalls
from swarmtrain.utils.async_context import async_context_only
from swarmtrain.utils.exception_groups import collapse_exception_groups

logger = logging.getLogger(__name__)
TOut = TypeVar("TOut", bound=Message)
DIAL_RETRIES = 1
DIAL_RETRY_DELAY = 0.05
#: how long py-libp2p refuses to dial a peer whose every address just failed (its default is
#: 60 s: one dial lost to packet loss on a long link kept two peers of an all-reduce from
#: reaching each other for the rest of the round)
FAILED_DIAL_MEMORY = 10.0


@dataclass(frozen=True)
class P2PConfig:
    """Validated settings of a ``P2P`` host (hivemind's keyword names)."""

    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    initial_peers: tuple[str, ...] = ()
    identity_path: str | None = None
    client_mode: bool = False
    enable_websocket: bool = False
    dial_timeout: float = 5.0
    request_timeout: float | None = 30.0
    max_message_size: int = rpc.DEFAULT_MAX_MESSAGE_SIZE
    quiet_logging: bool = True
    # Let py-libp2p keep >= 50 connections by dialling known peers (off: swarmtrain connects
    # to the peers it talks to).
    auto_connect: bool = False
    # NAT traversal (swarmtrain.p2p.relay): dial and accept relayed connections; serve as a relay
    # when listening; reserve relay slots (always in client_mode, or with use_auto_relay);
    # upgrade relayed connections by hole punching.
    use_relay: bool = True
    relay_service: bool = True
    use_auto_relay: bool = False
    use_hole_punching: bool = True
    relay_max_reservations: int = 16
    # AutoNAT (swarmtrain.p2p.autonat): a listening peer serves dial-backs and asks peers to
    # dial it back; judged unreachable, it reserves relay slots as if use_auto_relay were set.
    use_autonat: bool = True
    # Direct data lanes (swarmtrain.p2p.lane): ``bulk=True`` calls travel over their own
    # encrypted TCP connection (port ``data_lane_port``, 0 = any) when the callee offers one.
    use_data_lanes: bool = True
    data_lane_port: int = 0
    # A lane on a long path (the first connection's TCP RTT >= ``lane_stripe_min_rtt`` s)
    # spreads over up to ``lane_stripes`` TCP connections (swarmtrain.p2p.stripe_core: one
    # lossy flow at 100+ ms RTT gets a fraction of the link; how many: from the libp2p
    # connection's RTT and loss, ``stripes_for_path``); 1: one connection per lane.
    lane_stripes: int = DEFAULT_STRIPES
    lane_stripe_min_rtt: float = DEFAULT_STRIPE_MIN_RTT
    # The TCP congestion control of our lane sockets (Linux ``TCP_CONGESTION``): "auto" gives
    # lanes on a long path (RTT >= ``lane_stripe_min_rtt``) BBR, which neither random loss nor
    # the idle gaps between rounds slow, where the kernel lets this process set it; a name:
    # every lane socket; None: the system's. Refused: logged once, lanes keep the default.
    lane_congestion: str | None = AUTO_CONGESTION
    # Private runs (swarmtrain.p2p.private_network): only peers with the same key (>= 32 bytes,
    # or a key file path, loaded here) complete the handshake with us.
    swarm_key: bytes | str | None = field(default=None, repr=False)
    # What other peers may make us hold (swarmtrain.p2p.limits): calls and lanes per peer,
    # lanes per host, bytes in flight per host and per peer.
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("host_maddrs", "announce_maddrs", "initial_peers"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name} must be a list of multiaddr strings, not one string")
            parsed = []
            for addr in value:
                try:
                    parsed.append(str(multiaddr.Multiaddr(str(addr))))
                except Exception as e:
                    raise ValueError(f"{name}: {addr!r} is not a valid multiaddr: {e}") from None
            object.__setattr__(self, name, tuple(parsed))
        for addr in self.initial_peers:
            if "/p2p/" not in addr:
                raise ValueError(f"initial peer {addr!r} must end with /p2p/<peer id>")
        if self.dial_timeout <= 0:
            raise ValueError("dial_timeout must be positive")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be positive or None")
        if self.max_message_size <= 0:
            raise ValueError("max_message_size must be positive")
        if self.relay_max_reservations < 0:
            raise ValueError("relay_max_reservations must be non-negative")
        if not 0 <= self.data_lane_port <= 65535:
            raise ValueError("data_lane_port must be in 0..65535")
        stripes = self.lane_stripes
        if isinstance(stripes, bool) or not isinstance(stripes, int):
            raise TypeError(f"lane_stripes must be an int, got {stripes!r}")
        if not 1 <= stripes <= MAX_STRIPES:
            raise ValueError(f"lane_stripes must be in 1..{MAX_STRIPES}, got {stripes}")
        if not self.lane_stripe_min_rtt >= 0:
            raise ValueError("lane_stripe_min_rtt must be a non-negative number of seconds")
        congestion = self.lane_congestion
        if congestion is not None and not isinstance(congestion, str):
            raise TypeError(f"lane_congestion must be a str or None, got {congestion!r}")
        if congestion is not None and not (
            congestion.isascii() and congestion.isprintable() and 0 < len(congestion) < 16
        ):
            raise ValueError(f"lane_congestion must be a short algorithm name, got {congestion!r}")
        if not isinstance(self.limits, ResourceLimits):
            raise TypeError(f"limits must be a ResourceLimits, got {type(self.limits).__name__}")
        if self.limits.max_bytes_in_flight < self.max_message_size:
            raise ValueError(
                f"limits.max_bytes_in_flight ({self.limits.max_bytes_in_flight}) must be at "
                f"least max_message_size ({self.max_message_size})"
            )
        per_peer = self.limits.max_bytes_in_flight_per_peer
        if per_peer is not None and per_peer < self.max_message_size:
            raise ValueError(
                f"limits.max_bytes_in_flight_per_peer ({per_peer}) must be at least "
                f"max_message_size ({self.max_message_size}): one peer must be able to send "
                "one whole message"
            )
        if self.use_auto_relay and not self.use_relay:
            raise ValueError("use_auto_relay needs use_relay=True")
        object.__setattr__(self, "swarm_key", resolve_swarm_key(self.swarm_key))


def _with_ws_port(addr: str) -> multiaddr.Multiaddr:
    """py-libp2p 0.8.1's WebSocket listener reports ``/tcp/0`` instead of the port it bound, so
    we choose a free port for ``/tcp/0/ws`` addresses ourselves."""
    maddr = multiaddr.Multiaddr(addr)
    protocols = [p.name for p in maddr.protocols()]
    if "ws" not in protocols or maddr.value_for_protocol("tcp") != "0":
        return maddr
    family = socket.AF_INET6 if "ip6" in protocols else socket.AF_INET
    host = maddr.value_for_protocol("ip6" if "ip6" in protocols else "ip4")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return multiaddr.Multiaddr(addr.replace("/tcp/0/", f"/tcp/{port}/", 1))


def _build_host(key_pair: KeyPair, config: P2PConfig, noise: PrivateNoiseTransport):
    kwargs: dict[str, Any] = {}
    if config.announce_maddrs:
        kwargs["announce_addrs"] = [multiaddr.Multiaddr(a) for a in config.announce_maddrs]
    else:  # what identify and DCUtR advertise: no wildcard address (p2p/addresses.py)
        kwargs["addrs_factory"] = DialableAddrs()
    # py-libp2p builds one transport per kind of address in ``listen_addrs`` (and ignores the
    # enable_* flags when it finds any), so a TCP listener could not dial a WebSocket peer and
    # vice versa. We list one address of every kind we want to *dial*; the host only listens on
    # ``listen`` (see ``host.run`` in ``P2P.create``).
    use_websocket = config.enable_websocket or any("/ws" in a for a in config.host_maddrs)
    transport_kinds = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    if use_websocket:
        transport_kinds.append(multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0/ws"))
    max_inbound = connections_within_fd_limit(
        config.limits.max_inbound_connections, fd_soft_limit()
    )
    kwargs["connection_config"] = build_connection_config(
        max_inbound, config.auto_connect, config.limits.connection_grace_period
    )
    resource_manager = build_resource_manager(
        max_inbound, config.limits.max_inbound_connections_per_ip
    )
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},  # never plaintext, which py-libp2p offers by default
        muxer_preference="YAMUX",
        listen_addrs=transport_kinds,
        resource_manager=resource_manager,
        **kwargs,
    )
    # py-libp2p retries a failed dial 3 times over 0.7 s (0.1, 0.2, 0.4 s), even a refused one:
    # a DHT lookup that met a dead peer waited that long. One quick retry; the layers above
    # (DHT, averaging) have their own. (new_host takes no retry_config in 0.8.1.)
    swarm = host.get_network()
    if not isinstance(swarm, Swarm) or not isinstance(
        getattr(swarm, "retry_config", None), RetryConfig
    ):
        raise RuntimeError("libp2p internals changed: the swarm has no retry_config")
    swarm.retry_config = RetryConfig(max_retries=DIAL_RETRIES, initial_delay=DIAL_RETRY_DELAY)
    failed_dials = getattr(swarm, "_negative_peer_cache", None)
    if failed_dials is None or not isinstance(getattr(failed_dials, "_ttl", None), float):
        raise RuntimeError("libp2p internals changed: the swarm has no negative peer cache")
    failed_dials._ttl = FAILED_DIAL_MEMORY
    # the same manager without py-libp2p's host-wide stream semaphore (connection_limits.py)
    swarm.set_resource_manager(resource_manager, enable_stream_semaphore=False)
    schedule_prune = getattr(swarm, "_schedule_prune", None)
    if not callable(schedule_prune):
        raise RuntimeError("libp2p internals changed: the swarm has no _schedule_prune")
    resource_manager.on_inbound = schedule_prune
    if not config.auto_connect:
        keep_auto_connector_idle(swarm)
    tune_host(host)
    return host


class P2P(Dialling):
    """A running libp2p host. Build it with ``async with P2P.create(...) as p2p``."""

    def __init__(self, host, key_pair: KeyPair, config: P2PConfig):
        self._host = host
        self.key_pair = key_pair
        self.config = config
        self.peer_id: ID = host.get_id()
        self._rpc_server = rpc.RPCServer(config.max_message_size, config.limits)
        self._stream_pool = rpc_client.StreamPool(
            self._open_rpc_stream, still_fitting=self._not_a_replaced_relay_path
        )
        self._bulk_pool = BulkStreamPool(
            self._open_bulk_stream,
            preferred=lambda s: isinstance(s.stream, (LaneStream, StripedLane)),
            still_fitting=self._not_a_replaced_relay_path,
        )
        self.lanes: DataLanes | None = None  # set in create when use_data_lanes
        self._nursery: trio.Nursery | None = None
        self._dial_locks: dict[ID, trio.Lock] = {}
        self._addresses_checked: set[ID] = set()  # peers _learn_addrs_of looked at
        self._noise: PrivateNoiseTransport | None = None  # set in create
        self.relay: RelayManager | None = None  # set in create when relaying is enabled
        self.autonat: AutoNAT | None = None  # set in create when use_autonat
        self._closed = False

    # ---------------------------------------------------------------- lifetime

    @classmethod
    @async_context_only(
        "P2P.create(...) is a trio async context manager, not awaited as in hivemind: "
        "`async with P2P.create(...) as p2p:`. A blocking DHT starts its own host: "
        "DHT(host_maddrs=..., announce_maddrs=...)"
    )
    @asynccontextmanager
    async def create(
        cls,
        initial_peers: Sequence[str] | None = (),
        *,
        host_maddrs: Sequence[str] | None = None,
        announce_maddrs: Sequence[str] | None = (),
        identity_path: str | None = None,
        client_mode: bool = False,
        **kwargs: Any,
    ) -> AsyncIterator[P2P]:
        """Start a host, connect to ``initial_peers``, yield it; close everything on exit."""
        config = P2PConfig(
            host_maddrs=tuple(host_maddrs) if host_maddrs is not None else P2PConfig.host_maddrs,
            announce_maddrs=tuple(announce_maddrs or ()),  # None: hivemind's "no extra"
            initial_peers=tuple(initial_peers or ()),
            identity_path=identity_path,
            client_mode=client_mode,
            **kwargs,
        )
        check_libp2p_version()
        configure_process(quiet_logging=config.quiet_logging)
        loop_stalls.watch_from_env()
        key_pair = load_or_create_identity(config.identity_path)
        listen = [] if config.client_mode else [_with_ws_port(a) for a in config.host_maddrs]
        check_addresses_free(listen)
        swarm_key = config.swarm_key
        assert not isinstance(swarm_key, str)  # P2PConfig resolved a key file to its bytes
        noise = PrivateNoiseTransport(
            key_pair, noise_privkey=create_x25519_key_pair().private_key, swarm_key=swarm_key
        )
        host = _build_host(key_pair, config, noise)
        self = cls(host, key_pair, config)
        self._noise = noise
        host.set_stream_handler(rpc.RPC_PROTOCOL_ID, self._on_rpc_stream)
        try:
            with collapse_exception_groups():
                async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
                    self._nursery = nursery
                    try:
                        if config.use_data_lanes and not lanes_disabled_by_env():
                            self.lanes = DataLanes(
                                self,
                                lane_listen_host(config.host_maddrs, config.client_mode),
                                config.data_lane_port,
                                config.limits,
                                config.lane_stripes,
                                config.lane_stripe_min_rtt,
                                config.lane_congestion,
                            )
                            await self.lanes.start(nursery)
                        if config.use_relay or config.relay_service:
                            self.relay = await RelayManager.start(self)
                        if config.use_autonat:
                            self.autonat = AutoNAT.start(self)
                        await self._connect_initial_peers()
                        if self.relay is not None:
                            await self.relay.reserve_initial_relays()
                        if self.autonat is not None:
                            self.autonat.start_checks()
                        yield self
                    finally:
                        self._closed = True
                        self._rpc_server.cancel_all()
                        nursery.cancel_scope.cancel()
                        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                            self._stream_pool.forget()  # libp2p streams: closed with the network
                            await self._bulk_pool.aclose()
                            await self._rpc_server.wait_idle()  # let them say ERROR(CANCELLED)
                        await self._close_network()
        except OSError as e:
            if self._nursery is not None:
                raise  # not a startup failure: an error from the caller's own code
            raise P2PError(f"could not listen on {list(config.host_maddrs)}: {e}") from e

    async def _close_network(self) -> None:
        # py-libp2p's own shutdown path closes connections from an already-cancelled scope, which
        # leaks their sockets; close them explicitly (shielded, bounded) first.
        with trio.CancelScope(shield=True), trio.move_on_after(5.0):
            try:
                await self._host.get_network().close()
            except Exception:
                logger.debug("error while closing the libp2p network", exc_info=True)

    async def _connect_initial_peers(self) -> None:
        if not self.config.initial_peers:
            return
        failures: list[str] = []
        key_mismatches = 0

        async def connect_one(addr: str) -> None:
            nonlocal key_mismatches
            try:
                await self.connect(addr)
            except PeerUnreachableError as e:
                failures.append(f"{addr}: {e}")
                key_mismatches += isinstance(e, SwarmKeyMismatchError)

        async with trio.open_nursery() as nursery:
            for addr in self.config.initial_peers:
                nursery.start_soon(connect_one, addr)
        if len(failures) == len(self.config.initial_peers):
            all_rejected = key_mismatches == len(failures)
            error = SwarmKeyMismatchError if all_rejected else PeerUnreachableError
            raise error(
                "failed to connect to bootstrap peers: could not reach any of the initial "
                "peers:\n  " + "\n  ".join(failures)
            )
        for failure in failures:
            logger.warning("initial peer unreachable (continuing with the others): %s", failure)

    @property
    def host(self):
        """The underlying py-libp2p host (for extensions inside swarmtrain.p2p)."""
        return self._host

    @property
    def nursery(self) -> trio.Nursery:
        """The task group that owns this host's background tasks."""
        if self._nursery is None:
            raise P2PError("the host is not running")
        return self._nursery

    # --------------------------------------------------------------- addresses

    def get_visible_maddrs(self) -> list[str]:
        """Multiaddrs (ending in /p2p/<id>) other peers can pass as ``initial_peers``; a host
        listening on ``0.0.0.0`` / ``::`` lists each IP of this machine instead (default route
        first, loopback last: ``swarmtrain.p2p.addresses``)."""
        addrs = expand_unspecified(str(a) for a in self._host.get_addrs())
        if self.relay is not None:
            addrs += self.relay.circuit_addrs()
        return addrs

    @property
    def reachability(self) -> Reachability:
        """Whether other peers can dial us directly: ``PRIVATE`` in client_mode, else AutoNAT's
        verdict (``UNKNOWN`` until enough peers answered, or without ``use_autonat``)."""
        if self.config.client_mode:
            return Reachability.PRIVATE
        return self.autonat.reachability if self.autonat is not None else Reachability.UNKNOWN

    def get_connected_peers(self) -> list[ID]:
        return list(self._host.get_connected_peers())

    async def _open_rpc_stream(self, peer_id: ID):
        return await self.new_stream(peer_id, rpc.RPC_PROTOCOL_ID, lazily=True)

    async def _open_bulk_stream(self, peer_id: ID):
        """A data lane to ``peer_id`` when it offers one, else a libp2p RPC stream."""
        if self.lanes is not None:
            await self.ensure_connected(peer_id)
            ips = sorted(observed_ips(self, peer_id))
            lane = await self.lanes.open(
                peer_id,
                ips[0] if ips else None,
                self.nursery,
                self._keep_late_lane,
                path=connection_path(self, peer_id),
            )
            if lane is not None:
                return lane
        return await self._open_rpc_stream(peer_id)

    def _keep_late_lane(self, peer_id: ID, lane) -> None:
        """A lane that opened after its call went over libp2p: idle, for the next bulk call."""
        stream = RPCStream(lane, self.config.max_message_size)
        if self._closed or not self._bulk_pool.release(peer_id, stream):
            lane.reset_now()

    def lanes_offered(self) -> bool:
        """Whether we hand out lane tickets: listening, and not known to be behind a NAT."""
        return not self.config.client_mode and self.reachability != Reachability.PRIVATE

    async def _serve_lane(
        self, lane, remote_id: ID, on_call=None, idle_timeout: float | None = None
    ) -> None:
        """Serve the calls of a data lane; ``idle_timeout``: the lane's own (None: a libp2p
        stream's)."""
        await self._rpc_server.serve_stream(lane, remote_id, on_call, idle_timeout)

    # ------------------------------------------------------------------- RPC

    def add_protobuf_handler(
        self,
        name: str,
        handler,
        input_protobuf_type: type[Message],
        *,
        stream_input: bool = False,
        stream_output: bool = False,
        max_message_size: int | None = None,
        timeout: float | None = None,
        replace: bool = False,
        attachments: bool = False,
        attachment_buffer: Callable[[Message, int], Any] | None = None,
    ) -> None:
        """Serve ``name`` (by convention ``{prefix}::Service.method``).

        ``handler(request, context)``: ``request`` is one message, or an async iterator of
        messages if ``stream_input``; it returns one message, or is an async generator of
        messages if ``stream_output``. Exceptions reach the caller as ``RemoteError``.
        ``attachments=True``: requests and responses may also be ``rpc.Attached`` (a message
        plus raw bytes sent without protobuf copies; callers must opt in as well);
        ``attachment_buffer(request, size)`` may return the writable buffer of exactly
        ``size`` bytes a request's attachment is received into (None: a new numpy array).
        """
        self._rpc_server.add_handler(
            name,
            handler,
            input_protobuf_type,
            stream_input=stream_input,
            stream_output=stream_output,
            max_message_size=max_message_size,
            timeout=timeout,
            replace=replace,
            attachments=attachments,
            attachment_buffer=attachment_buffer,
        )

    def remove_protobuf_handler(self, name: str) -> None:
        self._rpc_server.remove_handler(name)

    async def call_protobuf_handler(
        self,
        peer: ID | str,
        name: str,
        request,
        output_protobuf_type: type[TOut],
        *,
        stream_input: bool = False,
        timeout: float | EllipsisType | None = ...,  # noqa: ASYNC109 (public facade keyword)
        max_message_size: int | None = None,
        bulk: bool = False,
    ) -> TOut:
        """Call a unary-output handler. ``request`` is a message, or an (async) iterable of
        messages with ``stream_input=True``. ``timeout`` defaults to ``request_timeout``.
        ``bulk=True``: carry the call over a direct data lane when the peer offers one."""
        timeout = self.config.request_timeout if timeout is ... else timeout
        with trio.move_on_after(timeout if timeout is not None else math.inf) as scope:
            return await rpc_client.call_unary_output(
                self._bulk_pool if bulk else self._stream_pool,
                as_peer_id(peer),
                name,
                request,
                output_protobuf_type,
                stream_input=stream_input,
                max_message_size=max_message_size or self.config.max_message_size,
            )
        assert scope.cancelled_caught
        raise RPCTimeoutError(f"{name} to {peer} did not complete within {timeout} s")

    @overload
    def iterate_protobuf_handler(
        self,
        peer: ID | str,
        name: str,
        request,
        output_protobuf_type: type[TOut],
        *,
        stream_input: bool = ...,
        next_message_timeout: float | EllipsisType | None = ...,
        max_message_size: int | None = ...,
        bulk: bool = ...,
        attachments: Literal[False] = ...,
        attachment_buffer: Callable[[Message, int], Any] | None = ...,
    ) -> AbstractAsyncContextManager[rpc_client.ResponseStream[TOut]]: ...

    @overload
    def iterate_protobuf_handler(
        self,
        peer: ID | str,
        name: str,
        request,
        output_protobuf_type: type[TOut],
        *,
        stream_input: bool = ...,
        next_message_timeout: float | EllipsisType | None = ...,
        max_message_size: int | None = ...,
        bulk: bool = ...,
        attachments: bool,
        attachment_buffer: Callable[[Message, int], Any] | None = ...,
    ) -> AbstractAsyncContextManager[rpc_client.ResponseStream[TOut | rpc.Attached]]: ...

    @asynccontextmanager
    async def iterate_protobuf_handler(
        self,
        peer: ID | str,
        name: str,
        request,
        output_protobuf_type: type[TOut],
        *,
        stream_input: bool = False,
        next_message_timeout: float | EllipsisType | None = ...,
        max_message_size: int | None = None,
        bulk: bool = False,
        attachments: bool = False,
        attachment_buffer: Callable[[Message, int], Any] | None = None,
    ) -> AsyncIterator[rpc_client.ResponseStream[Any]]:
        """Call a stream-output handler: ``async with ... as responses: async for r in responses``.

        ``next_message_timeout`` (default ``request_timeout``) bounds the wait for each
        response, not the whole call. Leaving the block early cancels the remote handler.
        ``bulk=True``: carry the call over a direct data lane (swarmtrain.p2p.lane: its own
        encrypted TCP connection, several times the throughput of the libp2p muxer) when the
        peer offers one; otherwise, or if the lane cannot be opened, over libp2p as usual.
        ``attachments=True`` (the handler must be registered so too): requests and responses
        may be ``rpc.Attached``; ``attachment_buffer(message, size)`` may return the buffer a
        response's attachment is received into (None: a new numpy array).
        """
        timeout = (
            self.config.request_timeout if next_message_timeout is ... else next_message_timeout
        )
        async with rpc_client.open_call(
            self._bulk_pool if bulk else self._stream_pool,
            as_peer_id(peer),
            name,
            request,
            output_protobuf_type,
            stream_input=stream_input,
            max_message_size=max_message_size or self.config.max_message_size,
            attachments=attachments,
            attachment_buffer=attachment_buffer,
        ) as reader:
            yield rpc_client.ResponseStream(reader, timeout)

    async def _on_rpc_stream(self, net_stream) -> None:
        remote_id = net_stream.muxed_conn.peer_id
        await self._rpc_server.serve_stream(net_stream, remote_id)

    def statistics(self) -> dict[str, Any]:
        return {
            "peer_id": str(self.peer_id),
            "connected_peers": len(self.get_connected_peers()),
            "handlers": self._rpc_server.handler_names,
            "calls_served": self._rpc_server.calls_served,
            "rpc_streams_opened": self._stream_pool.streams_opened,
            "rpc_streams_reused": self._stream_pool.streams_reused,
            "lanes_opened": self.lanes.lanes_opened if self.lanes else 0,
            "lanes_accepted": self.lanes.lanes_accepted if self.lanes else 0,
            "striped_lanes_opened": self.lanes.striped_lanes_opened if self.lanes else 0,
            "striped_lanes_accepted": self.lanes.striped_lanes_accepted if self.lanes else 0,
            "lane_fallbacks": self.lanes.fallbacks if self.lanes else 0,
            "lanes_open": len(self.lanes.open_lanes) if self.lanes else 0,  # served by us
            "lanes_evicted": self.lanes.open_lanes.evicted if self.lanes else 0,
            "bytes_in_flight": self._rpc_server.budget.used,
            "calls_refused": self._rpc_server.calls_per_peer.refused
            + self._rpc_server.budget.refused,
            "inbound_connections_refused_per_ip": self._connection_limits().addresses.refused,
        }

    def _connection_limits(self) -> SwarmResourceManager:
        manager = getattr(self._host.get_network(), "_resource_manager", None)
        if not isinstance(manager, SwarmResourceManager):
            raise RuntimeError("libp2p internals changed: our resource manager was replaced")
        return manager
