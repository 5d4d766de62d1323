"""Dial the owner of a progress record: is the peer behind it still there?

The I/O half of :mod:`swarmtrain.optim.progress_liveness` (which decides whom to dial and what
an outcome means). A dial to a dead peer's address fails at once when its host refuses the
connection, and hangs when the host is gone from the network (the SYN gets no answer): the
caller's ``move_on_after`` bounds that case (and a caller that gives up counts the owner as
unreachable).
"""

from __future__ import annotations

import logging

from swarmtrain.p2p import P2PError, PeerID

from .progress_liveness import ProbeOutcome

logger = logging.getLogger(__name__)


async def dial_owner(p2p, peer_id: bytes) -> ProbeOutcome:
    """Connect to ``peer_id``, the id a record is bound to (its signed subkey; an open
    connection is enough)."""
    try:
        peer = PeerID(peer_id)
    except Exception:  # not a peer id at all: nobody can be dialled under it
        return ProbeOutcome.UNREACHABLE
    if peer == p2p.peer_id:
        # a record under our own id is ours, or an earlier process's with our identity (the
        # tracker never asks; a caller that does gets: not a live owner)
        return ProbeOutcome.UNREACHABLE
    if p2p.is_connected(peer):
        return ProbeOutcome.REACHABLE
    if not p2p.known_addrs(peer):
        logger.debug("no known address for %s", peer)
        return ProbeOutcome.UNKNOWN
    try:
        await p2p.ensure_connected(peer)
    except (P2PError, OSError) as e:
        logger.debug("progress record owner %s cannot be dialled: %r", peer, e)
        return ProbeOutcome.UNREACHABLE
    except Exception as e:  # whatever a record names, a probe never takes its caller down
        logger.debug("dialling progress record owner %s failed: %r", peer, e, exc_info=True)
        return ProbeOutcome.UNREACHABLE
    return ProbeOutcome.REACHABLE
