"""Exceptions raised by swarmtrain.p2p. Every failure a caller can see is one of these."""

from __future__ import annotations

import errno


class P2PError(Exception):
    """Base class of all swarmtrain.p2p errors."""


class PeerUnreachableError(P2PError):
    """We could not open a connection to the peer (no addresses, refused, or timed out)."""


class SwarmKeyMismatchError(PeerUnreachableError):
    """The peer's handshake failed the way a different swarm key makes it fail (one side has
    another ``swarm_key``, or none): see ``swarmtrain.p2p.private_network``."""


class RPCError(P2PError):
    """An RPC failed. Subclasses say where and why."""


class RemoteError(RPCError):
    """The remote handler raised. ``error_type`` is the remote exception's class name."""

    def __init__(self, method: str, error_type: str, message: str):
        super().__init__(f"{method} failed on the remote peer: {error_type}: {message}")
        self.method = method
        self.error_type = error_type
        self.remote_message = message


class NoSuchMethodError(RPCError):
    """The remote peer has no handler registered under that name."""


class MessageTooLargeError(RPCError):
    """A message exceeded the sender's or the receiver's ``max_message_size``."""


class RPCProtocolError(RPCError):
    """The other side sent malformed frames, an undecodable message, or ended the stream early."""


class RPCCancelledError(RPCError):
    """The other side cancelled the call (closed or reset the stream before it finished)."""


class CallNotServedError(RPCCancelledError):
    """The callee closed the (reused) stream before it read anything of the call, so nothing
    of it was served: the call may be sent again on another stream (a data lane the callee
    took for a newcomer while it was idle, ``RPCErrorCode.NOT_SERVED``)."""


class RPCTimeoutError(RPCError, TimeoutError):
    """The call (or the next message of a stream) did not complete within its timeout."""


class LaneError(P2PError):
    """A direct data lane failed (``swarmtrain.p2p.lane``): the connection was cut, a record did
    not authenticate, or the handshake failed. RPC callers never see it: ``RPCStream`` turns
    it into the RPC error of the call (``RPCCancelledError``), as it does libp2p's stream
    errors, and a lane that cannot be set up makes the call fall back to libp2p."""


class LaneResetError(LaneError):
    """The lane's connection was cut or failed, or the peer broke the record protocol."""


class LaneStripeError(LaneResetError):
    """A striped lane's peer broke the stripe protocol (a duplicate, missing or far-ahead
    sequence number, an oversized record, a stripe too many), or one of its stripes failed:
    the whole striped lane fails, like a reset stream."""


class LaneClosedError(LaneError):
    """The lane was closed on our side (or broke) and cannot be used any more."""


class LaneEndOfStream(LaneError):
    """The peer ended its direction of the lane cleanly (its end record arrived)."""


class AddressInUseError(P2PError, OSError):
    """Another socket (often another swarmtrain peer) already listens on this address.

    An ``OSError`` with ``errno.EADDRINUSE``; ``address`` is the multiaddr we could not take.
    """

    def __init__(self, address: str):
        message = (
            f"cannot listen on {address}: the address is already in use (another peer or "
            "process listens there); stop it, or pick another port (tcp/0 picks a free one)"
        )
        super().__init__(errno.EADDRINUSE, message)
        self.address = address

    def __str__(self) -> str:
        return self.strerror or ""


class ResourceLimitError(RPCError):
    """A peer hit one of the callee's resource limits (``swarmtrain.p2p.ResourceLimits``):
    too many concurrent calls or lanes from one peer, or the host's budget of bytes in flight.
    The message says which limit; the call may be retried later."""
