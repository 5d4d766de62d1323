"""Keeping a :class:`~swarmtrain.dht.node.DHTNode` in the DHT: the bootstrap from its initial
peers (or the peers its host is connected to), asking them again while the node is alone (no
node of its routing table answered since its last failure: the table is empty or every node
in it is stale), and the periodic refresh of buckets unused for ``refresh_timeout``. The node
runs the two loops in its task group."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import trio

from swarmtrain.p2p import P2P, PeerID, PeerUnreachableError

from .identifiers import DHTID
from .node_config import DHTNodeConfig
from .protocol import DHTProtocol
from .storage import get_dht_time

__all__ = ["REJOIN_FIRST_DELAY", "REJOIN_MAX_DELAY", "RoutingMaintenance"]

# logged as part of DHTNode
logger = logging.getLogger("swarmtrain.dht.node")

#: a node whose routing table is empty asks its initial peers again after this many seconds,
#: doubling up to REJOIN_MAX_DELAY (``RoutingMaintenance.rejoin_while_alone``)
REJOIN_FIRST_DELAY = 2.0
REJOIN_MAX_DELAY = 60.0


class RoutingMaintenance:
    """Fills and refreshes one node's routing table (see the module doc).

    :param call: runs one of the node's RPCs within its ``parallel_rpc`` cap
    :param find_nearest_nodes: the node's search (``DHTNode.find_nearest_nodes``)
    """

    def __init__(
        self,
        p2p: P2P,
        protocol: DHTProtocol,
        node_id: DHTID,
        config: DHTNodeConfig,
        call: Callable[..., Awaitable[Any]],
        find_nearest_nodes: Callable[[Collection[DHTID]], Awaitable[object]],
    ) -> None:
        self.p2p, self.protocol, self.node_id, self.config = p2p, protocol, node_id, config
        self._call = call
        self.find_nearest_nodes = find_nearest_nodes
        self.num_refreshes = 0
        #: times the node asked its initial peers again while its routing table was empty
        self.num_rejoins = 0

    async def bootstrap(self, initial_peers: Sequence[str], retry: bool = False) -> None:
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
        if initial_peers and self.is_alone() and not retry:
            logger.warning(
                "none of the initial DHT peers answered; starting alone and asking them again "
                "every %.0f-%.0f s until one answers",
                REJOIN_FIRST_DELAY,
                REJOIN_MAX_DELAY,
            )
        if not self.is_alone():
            await self.find_nearest_nodes([self.node_id])

    def is_alone(self) -> bool:
        """Whether no node of the routing table answered since its last failure (a table of
        stale nodes keeps them: they may be slow, not gone)."""
        return self.protocol.routing_table.num_fresh_nodes() == 0

    async def rejoin_while_alone(self, initial_peers: Sequence[str]) -> None:
        """While the node is alone (:meth:`is_alone`: the bootstrap failed, the initial peers
        being down or too slow under load; or every known node stopped answering), ask the
        initial peers again, waiting ``REJOIN_FIRST_DELAY`` s, doubling to ``REJOIN_MAX_DELAY``
        s. A node that gave up on them at startup would otherwise stay a DHT of its own for
        good."""
        delay = REJOIN_FIRST_DELAY
        while True:
            await trio.sleep(delay * random.uniform(0.9, 1.1))
            if not self.is_alone():
                delay = REJOIN_FIRST_DELAY
                continue
            self.num_rejoins += 1
            await self.bootstrap(initial_peers, retry=True)
            if not self.is_alone():
                logger.info("joined the DHT through the initial peers (retry %d)", self.num_rejoins)
                delay = REJOIN_FIRST_DELAY
            else:
                delay = min(2 * delay, REJOIN_MAX_DELAY)

    async def refresh_buckets(self) -> None:
        timeout = self.config.refresh_timeout
        assert timeout is not None
        while True:
            await trio.sleep(timeout / 2 * random.uniform(0.9, 1.1))
            refresh_ids = self.protocol.routing_table.get_refresh_ids(get_dht_time(), timeout)
            if refresh_ids and len(self.protocol.routing_table) > 0:
                await self.find_nearest_nodes(refresh_ids)
            self.num_refreshes += 1
