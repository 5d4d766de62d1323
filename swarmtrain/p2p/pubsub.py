"""``PubSub``: libp2p gossipsub for low-rate, loss-tolerant broadcasts.

Progress and epoch signals, run announcements: things every peer should *usually* hear about
soon, where a lost message costs a little latency, never correctness. Nothing that must arrive
relies on pubsub alone: the DHT stays the durable record, and a message here is a hint to
look there sooner. Lifetime::

    async with P2P.create(...) as p2p, PubSub.create(p2p) as pubsub:
        async with await pubsub.subscribe("run/progress", protobuf_type=Progress) as sub:
            await pubsub.publish_protobuf("run/progress", Progress(step=10))
            async for msg in sub:              # PubSubMessage(topic, data, sender, message)
                ...

Delivery: a message reaches the peers subscribed to its topic through the gossipsub mesh,
also through peers that are connected only to other subscribers. ``sender`` is the signed
originator (every message is signed, and checked, with the publisher's peer key), not the
peer that forwarded it. Messages we publish ourselves are NOT delivered to our own
subscriptions (``deliver_own_messages=False``): a peer already knows what it said, and an
echo would count its own progress twice. Each ``Subscription`` has a bounded buffer; when the
consumer falls behind, the OLDEST unread message is dropped and counted (for progress signals
the newest one matters), so a slow consumer never blocks the router or the other topics.
A peer that sends garbage (undecodable frames, bad signatures, oversized or undecodable
messages) has that message dropped and counted; it cannot crash our pubsub service.

Settings (``PubSubConfig``) and why, measured against py-libp2p 0.8.1's defaults:

- ``heartbeat_interval=1.0`` s (py-libp2p: 120 s). The heartbeat maintains the mesh (GRAFT,
  PRUNE) and gossips IHAVE to peers outside the mesh; at 120 s a mesh that lost a peer is
  rebuilt, and gossip reaches outside peers, only every two minutes. 1 s is go-libp2p's.
- ``adaptive_gossip_enabled=False`` (py-libp2p: on). Its "network health" score, computed
  every 30 s, is low in small swarms (a mesh of 3 where 6 is the target) and then RAISES the
  heartbeat interval to 30-60 s, undoing the setting above.
- ``outbound_queue_size=1024`` RPCs per peer (py-libp2p: 32, not configurable; we resize
  each peer's queue as pubsub creates it). A full queue silently drops the RPC, and gossip
  never repairs it (IHAVE goes only to peers outside the mesh): with 32 slots (and our other
  settings) a 150-message burst reached each of 3 subscribers 53 times, a 500-message burst
  103 times, still so 20 s later. Worst-case memory per peer is this times
  ``max_message_size``.
- ``max_messages_per_topic_per_second=1000`` (py-libp2p: 10). A per-forwarder, per-topic
  sliding one-second window that also applies to our own publishes: from message 11 of a
  burst on, messages are delivered locally but never sent or forwarded (and count as spam
  against the forwarder). With py-libp2p's defaults 10 of a 50- or 100-message burst arrived.
- ``max_pending_messages_per_peer`` = ``outbound_queue_size`` (py-libp2p: 100): messages held
  for a peer whose subscriptions have not arrived yet.
- ``max_message_size=256 KiB`` (hard ceiling ``MAX_MESSAGE_SIZE_LIMIT`` = 1 MiB - 64 KiB).
  Gossipsub frames are capped at 1 MiB *including* topic, ids, signature and the sender's
  signed peer record, and a larger message is dropped without any error anywhere.
  ``publish`` raises ``MessageTooLargeError`` instead; larger messages from others are
  rejected (not delivered, not forwarded).
- ``subscription_buffer_size=1024`` messages per subscription (py-libp2p: 32, dropping the
  NEWEST and logging a warning).
- Protocols /meshsub/1.1.0 and 1.0.0 only (py-libp2p offers up to 2.0.0). From 1.2 on,
  py-libp2p sends an IDONTWANT to every mesh peer for every message, whatever its size (go
  does so only above 1 KiB) and even for its own messages: twice the RPCs, each carrying a
  signed peer record. Without it a 300-message burst to 3 subscribers (4 peers, one process)
  arrived in 1.6-2.2 s instead of 5-12 s.
- Mesh degree 6 (low 4, high 12), gossip window 3 heartbeats, history 5, seen-cache 120 s:
  go-libp2p's values.

Measured (4 peers in one process on loopback, so one CPU does all four peers' work): with
these settings 100, 150, 500 and 1000-message bursts all reached all 3 subscribers (star and
chain), at about 150-300 messages per second: 0.7-1 s for 100, 4.8 s for 1000. Pubsub is for
low rates: every message costs a signature, a verification and a signed peer record per hop.

Resource handling: ``create`` runs py-libp2p's pubsub and gossipsub services in a task group
owned by the ``PubSub``, registers their stream handlers on the host and opens a pubsub
stream to every peer already connected (peers that connect later are added as they come).
Leaving the ``async with`` unsubscribes (telling peers, bounded by ``close_timeout``), ends
every subscription (``async for`` finishes after the buffered messages), stops the services,
resets the pubsub streams and removes the handlers; the host keeps running. Every network wait
is bounded (``peer_stream_timeout``, ``close_timeout``); ``publish``, ``subscribe`` and
unsubscribing only queue RPCs and never wait for the network. ``wait_mesh_peers`` waits
until the caller's own deadline (``trio.fail_after``).

Error handling: ``publish`` raises ``MessageTooLargeError`` or ``ValueError`` (bad topic);
using a closed ``PubSub`` raises ``P2PError``. Lost and dropped messages raise nothing: they
show in ``statistics()``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
from google.protobuf.message import Message
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.rpc_queue import DefaultMaxMessageSize, RpcQueue
from libp2p.tools.anyio_service import background_trio_service

from swarmtrain.p2p._gossipsub import _Pubsub, _Router
from swarmtrain.p2p.errors import MessageTooLargeError, P2PError
from swarmtrain.p2p.host import P2P
from swarmtrain.p2p.subscription import (
    PubSubMessage,
    PubSubStatistics,
    Subscription,
)

logger = logging.getLogger(__name__)

GOSSIPSUB_PROTOCOLS = (PROTOCOL_ID_V11, PROTOCOL_ID)
GOSSIPSUB_FRAME_LIMIT = DefaultMaxMessageSize  # 1 MiB: py-libp2p's cap on one pubsub RPC
ENVELOPE_HEADROOM = 64 * 1024  # topic, ids, signature, key and signed peer record
MAX_MESSAGE_SIZE_LIMIT = GOSSIPSUB_FRAME_LIMIT - ENVELOPE_HEADROOM
DEFAULT_MAX_MESSAGE_SIZE = 256 * 1024
MAX_TOPIC_LENGTH = 1024
REATTACH_PERIOD = 1.0
"""How often (s) a host opens its stream to peers that have a pubsub stream to it but none
from it (``_Pubsub.one_way_peers``): a failed first attach would otherwise leave them unable
to hear our messages for good."""

TMessage = TypeVar("TMessage", bound=Message)


@dataclass(frozen=True)
class PubSubConfig:
    """Validated settings of a ``PubSub`` (see the module docstring for why each value)."""

    heartbeat_interval: float = 1.0
    mesh_degree: int = 6
    mesh_degree_low: int = 4
    mesh_degree_high: int = 12
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    outbound_queue_size: int = 1024
    max_messages_per_topic_per_second: float = 1000.0
    subscription_buffer_size: int = 1024
    deliver_own_messages: bool = False
    seen_ttl: int = 120
    peer_stream_timeout: float = 10.0
    close_timeout: float = 1.0

    def __post_init__(self):
        if not 0 < self.heartbeat_interval <= 60:
            raise ValueError("heartbeat_interval must be in (0, 60] seconds")
        if not 0 < self.mesh_degree_low <= self.mesh_degree <= self.mesh_degree_high:
            raise ValueError("need 0 < mesh_degree_low <= mesh_degree <= mesh_degree_high")
        if not 0 < self.max_message_size <= MAX_MESSAGE_SIZE_LIMIT:
            raise ValueError(
                f"max_message_size must be in (0, {MAX_MESSAGE_SIZE_LIMIT}] bytes: gossipsub "
                f"silently drops frames over {GOSSIPSUB_FRAME_LIMIT} bytes with their envelope"
            )
        for name in ("outbound_queue_size", "subscription_buffer_size", "seen_ttl"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("max_messages_per_topic_per_second", "peer_stream_timeout", "close_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def _check_topic(topic: str) -> None:
    if not isinstance(topic, str) or not topic:
        raise ValueError("a topic must be a non-empty string")
    if len(topic.encode()) > MAX_TOPIC_LENGTH:
        raise ValueError(f"a topic must be at most {MAX_TOPIC_LENGTH} bytes")


_hosts_with_pubsub: weakref.WeakSet[P2P] = weakref.WeakSet()


class PubSub:
    """Gossipsub on a running ``P2P``. Build it with ``async with PubSub.create(p2p)``."""

    def __init__(self, p2p: P2P, config: PubSubConfig):
        self.p2p = p2p
        self.config = config
        self._router = _Router(
            self,
            protocols=list(GOSSIPSUB_PROTOCOLS),
            degree=config.mesh_degree,
            degree_low=config.mesh_degree_low,
            degree_high=config.mesh_degree_high,
            heartbeat_initial_delay=min(0.1, config.heartbeat_interval),
            heartbeat_interval=config.heartbeat_interval,
            adaptive_gossip_enabled=False,
            max_messages_per_topic_per_second=config.max_messages_per_topic_per_second,
            max_pending_messages_per_peer=config.outbound_queue_size,
        )
        self._pubsub: _Pubsub | None = None
        self._subscriptions: dict[str, set[Subscription[Any]]] = {}
        self._running = False
        self._detached = False
        self._published = 0
        self._delivered = 0
        self._dropped = 0
        self._rejected = 0
        self._outbound_dropped = 0
        self._rate_limited = 0

    # ---------------------------------------------------------------- lifetime

    @classmethod
    @asynccontextmanager
    async def create(cls, p2p: P2P, **settings: Any) -> AsyncIterator[PubSub]:
        """Start gossipsub on ``p2p`` (settings: ``PubSubConfig`` fields); stop it on exit."""
        config = PubSubConfig(**settings)
        if p2p in _hosts_with_pubsub:
            raise P2PError("this host already runs a PubSub; share that one")
        if not hasattr(getattr(RpcQueue(), "_queue", None), "max_size"):
            raise RuntimeError("libp2p internals changed: RpcQueue._queue.max_size is missing")
        self = cls(p2p, config)
        host = p2p.host
        _hosts_with_pubsub.add(p2p)
        try:
            self._pubsub = _Pubsub(
                self,
                host,
                self._router,
                seen_ttl=config.seen_ttl,
                strict_signing=True,
                max_inbound_rpc_size=GOSSIPSUB_FRAME_LIMIT,
            )
            try:
                # The services' task groups (pubsub's peer, stream and retry tasks, the
                # router's heartbeat) live inside this block: they end before it returns.
                async with (
                    background_trio_service(self._pubsub),
                    background_trio_service(self._router),
                ):
                    with trio.fail_after(config.peer_stream_timeout):
                        await self._pubsub.wait_until_ready()
                    self._running = True
                    for peer_id in p2p.get_connected_peers():
                        self._pubsub.attach_peer_soon(peer_id)
                    self._pubsub.manager.run_task(
                        self._pubsub.reattach_one_way_peers, REATTACH_PERIOD
                    )
                    try:
                        yield self
                    finally:
                        self._running = False
                        self._pubsub.closing = True
                        with trio.CancelScope(shield=True):
                            await self._say_goodbye()
                        self._detach_from_host()  # no new pubsub streams from here on
            finally:
                self._end_subscriptions()
                with trio.CancelScope(shield=True):
                    await self._close_streams()
        finally:
            self._detach_from_host()
            _hosts_with_pubsub.discard(p2p)

    async def _say_goodbye(self) -> None:
        """Unsubscribe from every topic and let the send queues drain (bounded)."""
        assert self._pubsub is not None
        with trio.move_on_after(self.config.close_timeout):
            for topic in list(self._pubsub.topic_ids):
                await self._pubsub.unsubscribe(topic)
            while True:  # py-libp2p's queues have no "drained" event: poll
                if not any(len(queue) for queue in self._pubsub.peer_queues.values()):
                    return
                await trio.sleep(0.01)

    def _end_subscriptions(self) -> None:
        for subs in self._subscriptions.values():
            for sub in subs:
                sub._end()
        self._subscriptions.clear()

    async def _close_streams(self) -> None:
        if self._pubsub is None:
            return
        for scope in self._pubsub._inbound_streams.values():
            scope.cancel()
        streams = [*self._pubsub.peers.values(), *self._pubsub._inbound_streams]
        with trio.move_on_after(self.config.close_timeout):
            for stream in streams:
                try:
                    await stream.reset()
                except Exception:
                    logger.debug("error while resetting a pubsub stream", exc_info=True)
        self._pubsub.peers.clear()

    def _detach_from_host(self) -> None:
        if self._detached:
            return
        self._detached = True
        host = self.p2p.host
        for protocol in GOSSIPSUB_PROTOCOLS:
            try:
                host.remove_stream_handler(protocol)
            except Exception:
                logger.debug("could not remove the %s handler", protocol, exc_info=True)
        network = host.get_network()
        if self._pubsub is not None:
            for notifee in list(getattr(network, "notifees", ())):
                if self._is_our_notifee(notifee):
                    network.remove_notifee(notifee)

    def _is_our_notifee(self, notifee: Any) -> bool:
        # Pubsub keeps only the receive side of the channel its notifee sends to; a memory
        # channel's two ends share one state object.
        assert self._pubsub is not None
        queue = getattr(notifee, "initiator_peers_queue", None)
        mine = self._pubsub.peer_receive_channel
        # trio declares _state; the outdated trio-stubs of trio-typing (a py-libp2p dependency)
        # do not, and mypy prefers them to trio's own types
        return queue is not None and getattr(queue, "_state", None) is mine._state  # type: ignore[attr-defined]

    def _live(self) -> _Pubsub:
        if not self._running or self._pubsub is None:
            raise P2PError("this PubSub is not running")
        return self._pubsub

    # ------------------------------------------------------------ publishing

    async def publish(self, topic: str, data: bytes) -> None:
        """Send ``data`` to the topic's subscribers (best effort; see the module docstring).

        Raises ``MessageTooLargeError`` over ``max_message_size``. Only queues RPCs: it
        does not wait for the network or for any peer to be subscribed.
        """
        pubsub = self._live()
        _check_topic(topic)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > self.config.max_message_size:
            raise MessageTooLargeError(
                f"pubsub message of {len(data)} bytes exceeds max_message_size="
                f"{self.config.max_message_size} (gossipsub would silently drop frames over "
                f"{GOSSIPSUB_FRAME_LIMIT} bytes); publish a DHT key or use RPC instead"
            )
        with trio.CancelScope(shield=True):  # local work only; never leave it half-done
            await pubsub.publish(topic, data)
        self._published += 1
        await trio.lowlevel.checkpoint()

    async def publish_protobuf(self, topic: str, message: Message) -> None:
        """``publish(topic, message.SerializeToString())``."""
        await self.publish(topic, message.SerializeToString())

    # ----------------------------------------------------------- subscribing

    async def subscribe(
        self,
        topic: str,
        *,
        protobuf_type: type[TMessage] | None = None,
        buffer_size: int | None = None,
    ) -> Subscription[TMessage]:
        """Start receiving ``topic``. Several subscriptions to one topic each get every message.

        With ``protobuf_type``, each ``PubSubMessage.message`` is the decoded protobuf and
        messages that do not decode are skipped (counted as ``malformed``).
        """
        pubsub = self._live()
        _check_topic(topic)
        size = self.config.subscription_buffer_size if buffer_size is None else buffer_size
        if size < 1:
            raise ValueError("buffer_size must be at least 1")
        sub: Subscription[TMessage] = Subscription(self, topic, size, protobuf_type)
        subs = self._subscriptions.setdefault(topic, set())
        first = not subs
        subs.add(sub)
        if first and topic not in pubsub.topic_ids:
            pubsub.set_topic_validator(topic, self._validate, False)
            with trio.CancelScope(shield=True):  # queues announcements; no network wait
                await pubsub.subscribe(topic)
        await trio.lowlevel.checkpoint()
        return sub

    async def _remove_subscription(self, sub: Subscription[Any]) -> None:
        subs = self._subscriptions.get(sub.topic)
        if subs is None or sub not in subs:
            await trio.lowlevel.checkpoint()
            return
        subs.discard(sub)
        if subs:
            await trio.lowlevel.checkpoint()
            return
        del self._subscriptions[sub.topic]
        if self._running and self._pubsub is not None:
            with trio.CancelScope(shield=True):  # queues announcements; no network wait
                await self._pubsub.unsubscribe(sub.topic)
            self._pubsub.remove_topic_validator(sub.topic)
        else:
            await trio.lowlevel.checkpoint()

    def _validate(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        if len(msg.data) > self.config.max_message_size:
            self._rejected += 1
            return False
        return True

    def _on_message(self, msg: rpc_pb2.Message) -> None:
        """Called synchronously by py-libp2p for every new valid message (ours included)."""
        try:
            sender = ID(msg.from_id)
        except Exception:
            self._rejected += 1
            return
        if not self.config.deliver_own_messages and sender == self.p2p.peer_id:
            return
        for topic in msg.topicIDs:
            for sub in tuple(self._subscriptions.get(topic, ())):
                sub._deliver(PubSubMessage(topic, msg.data, sender))

    # ------------------------------------------------------------ inspection

    def topic_peers(self, topic: str) -> list[ID]:
        """Peers that told us they subscribe to ``topic``."""
        pubsub = self._live()
        return list(pubsub.peer_topics.get(topic, ()))

    def mesh_peers(self, topic: str) -> list[ID]:
        """Peers we forward ``topic`` to directly (our gossipsub mesh for it)."""
        self._live()
        return list(self._router.mesh.get(topic, ()))

    async def wait_mesh_peers(self, topic: str, count: int) -> None:
        """Wait until our mesh for ``topic`` (a topic we subscribe to) has ``count`` peers.

        Waits until the caller's deadline: wrap it in ``trio.fail_after``.
        """
        while True:  # the router has no mesh-changed event: poll
            if len(self.mesh_peers(topic)) >= count:
                return
            await trio.sleep(0.02)

    async def wait_topic_peers(self, topic: str, count: int) -> None:
        """Wait until ``count`` peers told us they subscribe to ``topic`` (a publisher that
        does not subscribe sends to these). Waits until the caller's deadline."""
        while True:
            if len(self.topic_peers(topic)) >= count:
                return
            await trio.sleep(0.02)

    def statistics(self) -> PubSubStatistics:
        return PubSubStatistics(
            published=self._published,
            delivered=self._delivered,
            dropped=self._dropped,
            rejected=self._rejected,
            outbound_dropped=self._outbound_dropped,
            rate_limited=self._rate_limited,
            topics=tuple(sorted(self._subscriptions)),
            peers=len(self._pubsub.peers) if self._pubsub is not None else 0,
        )
