"""Subscriptions of ``swarmtrain.p2p.pubsub.PubSub``: bounded, drop-oldest message buffers."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import trio
from google.protobuf.message import DecodeError, Message
from libp2p.peer.id import ID

if TYPE_CHECKING:
    from swarmtrain.p2p.pubsub import PubSub

TMessage = TypeVar("TMessage", bound=Message)
logger = logging.getLogger("swarmtrain.p2p.pubsub")


@dataclass(frozen=True)
class PubSubMessage(Generic[TMessage]):
    """One received message. ``sender`` is the signed originator, not the forwarding peer.

    ``message`` is the decoded protobuf for subscriptions made with ``protobuf_type``.
    """

    topic: str
    data: bytes
    sender: ID
    message: TMessage | None = None


@dataclass(frozen=True)
class SubscriptionStatistics:
    delivered: int  # accepted into this subscription's buffer
    dropped: int  # evicted unread (oldest first) because the consumer was slow
    malformed: int  # did not decode as ``protobuf_type``; skipped
    buffered: int  # waiting to be received now


@dataclass(frozen=True)
class PubSubStatistics:
    published: int  # messages this peer published
    delivered: int  # messages accepted into local subscription buffers (all subscriptions)
    dropped: int  # of those, evicted unread because a consumer was slow
    rejected: int  # invalid messages from other peers (oversized, bad signature, garbage)
    outbound_dropped: int  # messages py-libp2p dropped from a full per-peer send queue
    rate_limited: int  # messages not forwarded: over max_messages_per_topic_per_second
    topics: tuple[str, ...]  # topics with at least one open subscription
    peers: int  # peers with an open pubsub stream


class Subscription(Generic[TMessage]):
    """Messages of one topic. ``async for msg in sub``, or ``await sub.receive()``.

    Resource handling: ``aclose()`` (or leaving ``async with sub``) unsubscribes when it is
    the topic's last subscription; later receives raise ``trio.ClosedResourceError``. When
    the ``PubSub`` closes, buffered messages can still be received, then ``receive`` raises
    ``trio.EndOfChannel`` and ``async for`` ends.
    """

    def __init__(
        self,
        owner: PubSub,
        topic: str,
        buffer_size: int,
        protobuf_type: type[TMessage] | None,
    ):
        self.topic = topic
        self.protobuf_type = protobuf_type
        self._owner = owner
        self._buffer: deque[PubSubMessage[TMessage]] = deque()
        self._buffer_size = buffer_size
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False  # by our user
        self._ended = False  # by the PubSub shutting down
        self._delivered = 0
        self._dropped = 0
        self._malformed = 0

    # Called synchronously by the router (through PubSub._on_message): never blocks.
    def _deliver(self, message: PubSubMessage[TMessage]) -> None:
        if self._closed or self._ended:
            return
        if len(self._buffer) >= self._buffer_size:
            self._buffer.popleft()
            self._dropped += 1
            self._owner._dropped += 1
        self._buffer.append(message)
        self._delivered += 1
        self._owner._delivered += 1
        self._lot.unpark_all()

    def _end(self) -> None:
        self._ended = True
        self._lot.unpark_all()

    def _decode(self, message: PubSubMessage[TMessage]) -> PubSubMessage[TMessage] | None:
        if self.protobuf_type is None:
            return message
        decoded = self.protobuf_type()
        try:
            decoded.ParseFromString(message.data)
        except (DecodeError, ValueError, RuntimeError):
            self._malformed += 1
            logger.debug(
                "undecodable %s on %s from %s", self.protobuf_type, self.topic, message.sender
            )
            return None
        return PubSubMessage(message.topic, message.data, message.sender, decoded)

    def receive_nowait(self) -> PubSubMessage[TMessage]:
        """The next buffered message; ``trio.WouldBlock`` if none is buffered."""
        while self._buffer:
            message = self._decode(self._buffer.popleft())
            if message is not None:
                return message
        if self._closed:
            raise trio.ClosedResourceError("this subscription is closed")
        if self._ended:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> PubSubMessage[TMessage]:
        """Wait for the next message (bound it with ``trio.move_on_after`` if you need to)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                message = self.receive_nowait()
            except trio.WouldBlock:
                await self._lot.park()
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return message

    def __aiter__(self) -> Subscription[TMessage]:
        return self

    async def __anext__(self) -> PubSubMessage[TMessage]:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Unsubscribe (announced to peers when this is the topic's last subscription)."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._buffer.clear()
        self._lot.unpark_all()
        await self._owner._remove_subscription(self)

    async def __aenter__(self) -> Subscription[TMessage]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def statistics(self) -> SubscriptionStatistics:
        return SubscriptionStatistics(
            delivered=self._delivered,
            dropped=self._dropped,
            malformed=self._malformed,
            buffered=len(self._buffer),
        )
