import pytest

from swarmtrain.dht import CallFailure, classify_call_error
from swarmtrain.p2p import (
    MessageTooLargeError,
    NoSuchMethodError,
    P2PError,
    PeerUnreachableError,
    ResourceLimitError,
    RPCCancelledError,
    RPCProtocolError,
    RPCTimeoutError,
    SwarmKeyMismatchError,
)


@pytest.mark.parametrize(
    "error",
    [
        RPCTimeoutError("late"),
        PeerUnreachableError("refused"),
        SwarmKeyMismatchError("handshake"),
        RPCCancelledError("reset"),
        ResourceLimitError("busy"),
        P2PError("other transport trouble"),
    ],
)
def test_network_failures_keep_the_peer(error):
    failure = classify_call_error(error)
    assert failure is CallFailure.UNRESPONSIVE and not failure.bans and not failure.drops


def test_a_peer_without_a_dht_is_dropped_but_not_banned():
    failure = classify_call_error(NoSuchMethodError("no rpc_find"))
    assert failure is CallFailure.NOT_SERVING and failure.drops and not failure.bans


@pytest.mark.parametrize("error", [RPCProtocolError("garbage"), MessageTooLargeError("9 MiB")])
def test_malformed_answers_ban_and_drop(error):
    failure = classify_call_error(error)
    assert failure is CallFailure.MISBEHAVED and failure.bans and failure.drops
