"""Why a DHT call failed, and what the caller does about it (sans-IO).

A loaded machine misses deadlines: a timeout, a refused dial or a reset says nothing bad about
the peer, so such a peer stays in the routing table (stale) and is only backed off; a peer that
answers with a wrong node id or malformed data is banned and dropped at once.

- ``UNRESPONSIVE``: a timeout, an unreachable peer (refused, no route), a reset or cancelled
  stream, the peer's resource limits, any other transport error. The peer is backed off (any
  answer or request from it lifts that) and stays in the routing table, marked stale.
- ``NOT_SERVING``: the peer has no DHT handler (its DHT stopped). Backed off and dropped.
- ``MISBEHAVED``: an undecodable or oversized answer, a wrong node id, malformed node info, a
  wrong number of results, nearest peers whose node ids are not theirs. Banned and dropped.
"""

from __future__ import annotations

import enum

from swarmtrain.p2p import MessageTooLargeError, NoSuchMethodError, P2PError, RPCProtocolError

__all__ = ["CallFailure", "classify_call_error"]


class CallFailure(enum.Enum):
    """What went wrong with a call to a peer (see the module doc for what each one costs)."""

    UNRESPONSIVE = "unresponsive"
    NOT_SERVING = "not_serving"
    MISBEHAVED = "misbehaved"

    @property
    def bans(self) -> bool:
        """Whether the peer is banned (else only backed off)."""
        return self is CallFailure.MISBEHAVED

    @property
    def drops(self) -> bool:
        """Whether the peer leaves the routing table at once (else it is marked stale)."""
        return self is not CallFailure.UNRESPONSIVE


def classify_call_error(error: P2PError) -> CallFailure:
    """The failure that a network-layer error of a call (not a ``RemoteError``) stands for."""
    if isinstance(error, NoSuchMethodError):
        return CallFailure.NOT_SERVING
    if isinstance(error, (RPCProtocolError, MessageTooLargeError)):
        return CallFailure.MISBEHAVED
    return CallFailure.UNRESPONSIVE
