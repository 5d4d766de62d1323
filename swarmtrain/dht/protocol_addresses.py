"""The addresses DHT nodes exchange (:mod:`swarmtrain.dht.protocol`): our own node info, the
addresses peers announce and list as nearest (checked, then put in the peerstore) and the
addresses we hand out for the peers we list.

Address bookkeeping is hot (every find answer carries up to 20 peers' addresses): it remembers
what each peer last announced so unchanged lists skip parsing and the peerstore, and reuses our
own announcement and the addresses we hand out for a while.
"""

from __future__ import annotations

import logging

import multiaddr

from swarmtrain.p2p import P2P, PeerID
from swarmtrain.proto import dht_pb2

from .identifiers import DHTID
from .protocol_types import (
    DHTProtocolLimits,
    MalformedRequestError,
    NodeIdMismatchError,
    parse_dht_id,
)
from .storage import get_dht_time

__all__ = ["ADDRESS_CACHE_SECONDS", "PeerAddresses"]

# logged as part of DHTProtocol
logger = logging.getLogger("swarmtrain.dht.protocol")
ADDRESS_CACHE_SECONDS = 5.0


class PeerAddresses:
    """One DHT node's address bookkeeping (its ``DHTProtocol`` owns it; see the module doc)."""

    def __init__(
        self, p2p: P2P, node_id: DHTID, *, client_mode: bool, limits: DHTProtocolLimits
    ) -> None:
        self.p2p, self.node_id, self.client_mode, self.limits = p2p, node_id, client_mode, limits
        self._announced: dict[PeerID, tuple[str, ...]] = {}
        self._own_info: tuple[float, dht_pb2.DHTNodeInfo] | None = None
        self._handed_out: dict[PeerID, tuple[float, list[str]]] = {}

    def node_info(self) -> dht_pb2.DHTNodeInfo:
        if self.client_mode:
            return dht_pb2.DHTNodeInfo()
        now = get_dht_time()
        if self._own_info is None or now - self._own_info[0] > ADDRESS_CACHE_SECONDS:
            maddrs = self.p2p.get_visible_maddrs()[: self.limits.max_maddrs]
            info = dht_pb2.DHTNodeInfo(node_id=self.node_id.to_bytes(), maddrs=maddrs)
            self._own_info = (now, info)
        return self._own_info[1]

    def remember_addrs(self, peer_id: PeerID, maddrs: tuple[str, ...], addrs: list[str]) -> None:
        """Put a peer's announced addresses in the peerstore unless it announced them already."""
        if not addrs or self._announced.get(peer_id) == maddrs:
            return
        self.p2p.add_addrs(peer_id, addrs)
        if len(self._announced) > 4096:
            self._announced.clear()
        self._announced[peer_id] = maddrs
        self._handed_out.pop(peer_id, None)

    def parse_node_info(
        self, remote_id: PeerID, info: dht_pb2.DHTNodeInfo
    ) -> tuple[DHTID | None, list[str], tuple[str, ...]]:
        """(node id or None for a client, new addresses without /p2p/..., what was announced);
        raises if malformed. Addresses the peer announced before come back empty."""
        if not info.node_id:
            return None, [], ()
        node_id = parse_dht_id(info.node_id, "peer.node_id")
        if not node_id.is_node_id_of(remote_id):
            raise NodeIdMismatchError(
                f"peer.node_id {node_id!r} is not the node id of {remote_id}: node ids are "
                "DHTID.from_peer_id(peer_id) (a peer of an older swarmtrain, or one that tries "
                "to choose its place in the DHT)"
            )
        if len(info.maddrs) > self.limits.max_maddrs:
            raise MalformedRequestError(
                f"peer.maddrs has {len(info.maddrs)} addresses, more than {self.limits.max_maddrs}"
            )
        announced = tuple(info.maddrs)
        if announced == self._announced.get(remote_id):
            return node_id, [], announced  # known and unchanged: nothing to parse or store
        suffix = f"/p2p/{remote_id.to_base58()}"
        addrs = []
        for maddr in info.maddrs:
            if len(maddr) > self.limits.max_maddr_length or not maddr.endswith(suffix):
                raise MalformedRequestError(
                    f"peer.maddrs: {maddr[:80]!r} is too long or does not end with {suffix}"
                )
            base = maddr[: -len(suffix)]
            try:
                multiaddr.Multiaddr(base)
            except Exception as e:
                raise MalformedRequestError(f"peer.maddrs: {maddr[:80]!r} is invalid: {e}") from e
            addrs.append(base)
        return node_id, addrs, announced

    def parse_nearest(self, result: dht_pb2.DHTFindResult) -> tuple[dict[DHTID, PeerID], int]:
        """The listed peers we may call, and how many listed pairs were not bound (dropped)."""
        nearest: dict[DHTID, PeerID] = {}
        unbound = 0
        for info in result.nearest_peers[: self.limits.max_nearest_peers]:
            if len(info.node_id) != DHTID.HASH_NBYTES or not info.peer_id:
                continue
            node_id = DHTID.from_bytes(info.node_id)
            if not node_id.is_node_id_of(info.peer_id):
                unbound += 1
                continue
            peer_id = PeerID(info.peer_id)
            if peer_id == self.p2p.peer_id or node_id == self.node_id:
                continue
            maddrs = tuple(info.maddrs[: self.limits.max_maddrs])
            if maddrs != self._announced.get(peer_id):
                suffix = f"/p2p/{peer_id.to_base58()}"
                addrs = [
                    a[: -len(suffix)]
                    for a in maddrs
                    if a.endswith(suffix) and len(a) <= self.limits.max_maddr_length
                ]
                try:
                    self.remember_addrs(peer_id, maddrs, addrs)
                except Exception as e:
                    logger.debug("ignoring bad addresses of %s: %s", peer_id, e)
                    continue
            nearest[node_id] = peer_id
        return nearest, unbound

    def maddrs_of(self, peer_id: PeerID) -> list[str]:
        now = get_dht_time()
        cached = self._handed_out.get(peer_id)
        if cached is not None and now - cached[0] <= ADDRESS_CACHE_SECONDS:
            return cached[1]
        suffix = f"/p2p/{peer_id.to_base58()}"
        addrs = [a if a.endswith(suffix) else a + suffix for a in self.p2p.known_addrs(peer_id)]
        addrs = [a for a in addrs if len(a) <= self.limits.max_maddr_length][
            : self.limits.max_maddrs
        ]
        if len(self._handed_out) > 4096:
            self._handed_out.clear()
        self._handed_out[peer_id] = (now, addrs)
        return addrs
