"""Exceptions raised by swarmtrain.p2p. Every failure a caller can see is one of these."""

from __future__ import annotations


class P2PError(Exception):
    """Base class of all swarmtrain.p2p errors."""


class PeerUnreachableError(P2PError):
    """We could not open a connection to the peer (no addresses, refused, or timed out)."""


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


class RPCTimeoutError(RPCError, TimeoutError):
    """The call (or the next message of a stream) did not complete within its timeout."""


class ResourceLimitError(RPCError):
    """A peer hit one of the callee's resource limits (``swarmtrain.p2p.ResourceLimits``):
    too many concurrent calls or lanes from one peer, or the host's budget of bytes in flight.
    The message says which limit; the call may be retried later."""
