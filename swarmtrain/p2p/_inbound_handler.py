"""Our hosts' inbound-connection handler: it ends when its connection ends.

py-libp2p 0.8.1's swarm handles each accepted TCP connection in a task that upgrades it
(Noise, yamux), registers it, and then waits for the *swarm* to finish, not the connection (the
task must live as long as the connection: trio closes a listener's stream when its handler
returns). So every inbound connection a host ever accepted kept its handler task, the closed
connection's objects and one of the swarm's inbound slots (a ``CapacityLimiter`` of
``max_connections - min_connections``, 300 by default) until the host stopped. Measured: 300
connect-and-disconnect cycles from one peer, and the host refused every inbound connection
after them, for good (`tests/test_p2p_connection_limits.py`).

``end_inbound_handlers_with_their_connections(host)`` gives a host's swarm (the instance, not
py-libp2p's class) a handler that waits for its own connection to close. Transports that hand
over an already multiplexed connection (QUIC) keep py-libp2p's handler: swarmtrain uses none.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.abc import IMuxedConn
from libp2p.network.connection.raw_connection import RawConnection

logger = logging.getLogger(__name__)

#: how long a closed connection's muxer may take to finish closing before its socket is closed
MUXER_CLOSE_TIMEOUT = 10.0


def end_inbound_handlers_with_their_connections(host: Any) -> None:
    """See the module docstring."""
    swarm = host.get_network()
    stock = getattr(swarm, "_do_handle_inbound_connection", None)
    if stock is None or not hasattr(swarm, "upgrade_inbound_raw_conn"):
        raise RuntimeError("libp2p internals changed: the swarm's inbound handler is missing")

    async def handle(read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        if isinstance(read_write_closer, IMuxedConn):
            await stock(read_write_closer, maddr, failure_event)
            return
        raw = RawConnection(read_write_closer, False)
        try:
            muxed = await swarm.upgrade_inbound_raw_conn(raw, maddr)
        except Exception as e:  # refused, a failed handshake, a timeout: already logged there
            logger.debug("inbound connection on %s not upgraded: %r", maddr, e)
            try:
                await raw.close()
            except Exception:
                pass
            return
        connection = _registered(swarm, muxed)
        # py-libp2p's wait, cut short when this connection closes (the swarm's own shutdown
        # closes its connections in order: that path stays as it was)
        async with trio.open_nursery() as nursery:

            async def until_closed() -> None:
                if connection is not None:
                    await connection.event_closed.wait()
                # the muxer flushes and closes the socket itself: returning earlier would let
                # trio close the socket under frames still being written
                muxer_closed = getattr(muxed, "event_closed", None)
                if muxer_closed is not None:
                    with trio.move_on_after(MUXER_CLOSE_TIMEOUT):
                        await muxer_closed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_closed)
            await swarm.manager.wait_finished()
            nursery.cancel_scope.cancel()

    swarm._do_handle_inbound_connection = handle


def _registered(swarm: Any, muxed: Any) -> Any:
    """The swarm's connection object over ``muxed`` (None: already closed and removed)."""
    for connection in swarm.connections.get(getattr(muxed, "peer_id", None), ()):
        if connection.muxed_conn is muxed:
            return connection
    return None
