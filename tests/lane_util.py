"""A data lane over a local socket pair, for lane tests that drive the far end by hand."""

from __future__ import annotations

import os
import socket

import trio

from swarmtrain.p2p import lane as lane_module
from swarmtrain.p2p.lane_records import RecordOpener, RecordSealer


def lane_over_socketpair(key: bytes) -> tuple[lane_module.LaneStream, trio.socket.SocketType]:
    """(a lane that opens records sealed with ``key``, the far end's trio socket); the
    caller resets the lane and closes the far end."""
    raw_a, raw_b = socket.socketpair()
    for raw in (raw_a, raw_b):
        raw.setblocking(False)
    sock_a, sock_b = trio.socket.from_stdlib_socket(raw_a), trio.socket.from_stdlib_socket(raw_b)
    lane = lane_module.LaneStream(raw_a, sock_a, RecordSealer(os.urandom(32)), RecordOpener(key))
    return lane, sock_b
