"""py-libp2p 0.8.1 gossipsub classes adjusted for swarmtrain (see ``pubsub.py``'s docstring)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

if TYPE_CHECKING:
    from swarmtrain.p2p.pubsub import PubSub

logger = logging.getLogger(__name__)


class _SizedQueues(dict):
    """``Pubsub.peer_queues``: gives each per-peer ``RpcQueue`` our capacity as it is added.

    py-libp2p 0.8.1 builds them as ``RpcQueue()`` (32 slots) with no setting to change that.
    """

    def __init__(self, max_size: int):
        super().__init__()
        self.max_size = max_size

    def __setitem__(self, peer_id, queue) -> None:
        queue._queue.max_size = self.max_size
        super().__setitem__(peer_id, queue)


class _Router(GossipSub):
    """Gossipsub that counts what py-libp2p drops silently."""

    def __init__(self, owner: PubSub, **kwargs: Any):
        super().__init__(**kwargs)
        self._owner = owner

    def _handle_dropped_rpc(self, peer_id: ID, rpc: rpc_pb2.RPC, reason: str) -> None:
        self._owner._outbound_dropped += len(rpc.publish)
        super()._handle_dropped_rpc(peer_id, rpc, reason)

    def _check_spam_protection(self, peer_id: ID, msg: rpc_pb2.Message) -> bool:
        allowed = super()._check_spam_protection(peer_id, msg)
        if not allowed:
            self._owner._rate_limited += 1
        return allowed


class _Pubsub(Pubsub):
    """py-libp2p's Pubsub, delivering into our subscriptions and robust to remote garbage."""

    def __init__(self, owner: PubSub, host, router: _Router, **kwargs: Any):
        self._owner = owner
        # inbound stream -> the scope its reader runs in: py-libp2p's yamux does not wake a
        # reader blocked on a stream that is reset locally, so closing cancels the reader too
        self._inbound_streams: dict[Any, trio.CancelScope] = {}
        self._attaching: set[ID] = set()
        self.closing = False
        super().__init__(host, router, **kwargs)
        self.peer_queues = _SizedQueues(owner.config.outbound_queue_size)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        self._owner._on_message(publish_message)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        if msg_forwarder == self.my_id:
            await super().push_msg(msg_forwarder, msg)  # our own publish: errors are ours
            return
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as e:  # a task error here would stop the whole pubsub service
            self._owner._rejected += 1
            logger.debug("dropped an invalid pubsub message from %s: %r", msg_forwarder, e)

    async def stream_handler(self, stream) -> None:
        peer_id = stream.muxed_conn.peer_id
        if self.closing:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await stream.reset()
            return
        scope = self._inbound_streams[stream] = trio.CancelScope()
        try:
            if peer_id not in self.peers:
                # The peer runs pubsub but we have no stream to it yet (it connected before
                # one of us started pubsub): open ours now instead of waiting for its retries.
                self.attach_peer_soon(peer_id)
            with scope:  # only reads: cancelling it cannot break a write
                await super().stream_handler(stream)
        except Exception as e:  # e.g. DecodeError on a garbage frame
            self._owner._rejected += 1
            logger.debug("bad pubsub stream from %s: %r", peer_id, e)
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await stream.reset()
                except Exception:
                    pass
            self._handle_dead_peer(peer_id)
        finally:
            self._inbound_streams.pop(stream, None)

    def one_way_peers(self) -> set[ID]:
        """Peers with a pubsub stream to us but none from us (they run pubsub, so we can open
        ours): the attach that their first stream started can fail, e.g. while their pubsub
        was still starting, and py-libp2p retries only its own connection-time attempt."""
        inbound = {stream.muxed_conn.peer_id for stream in self._inbound_streams}
        return {peer_id for peer_id in inbound if peer_id not in self.peers}

    async def reattach_one_way_peers(self, period: float) -> None:
        """Every ``period`` s, attach the :meth:`one_way_peers` that no attach is under way for."""
        while not self.closing:
            await trio.sleep(period)
            for peer_id in self.one_way_peers():
                self.attach_peer_soon(peer_id)

    def attach_peer_soon(self, peer_id: ID) -> None:
        if peer_id in self._attaching or not self.manager.is_running:
            return
        self._attaching.add(peer_id)
        self.manager.run_task(self._attach_peer, peer_id)

    async def _attach_peer(self, peer_id: ID) -> None:
        timeout = self._owner.config.peer_stream_timeout
        try:
            with trio.move_on_after(timeout):
                await self.ensure_peer_stream(peer_id, timeout=timeout)
        except Exception as e:
            logger.debug("could not open a pubsub stream to %s: %r", peer_id, e)
        finally:
            self._attaching.discard(peer_id)
