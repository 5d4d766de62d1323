"""How swarmtrain's hosts differ from stock py-libp2p 0.8.1, in one place.

Every change is scoped to our own hosts: they are built with our own classes and instances
(``tune_host``, ``private_network.PrivateNoiseTransport``), and py-libp2p's
modules and classes stay exactly as imported (``tests/test_libp2p_scoped.py``), so a plain
py-libp2p host in the same process behaves as stock py-libp2p.

- Yamux (``_yamux.TunedYamux``): 1 MiB frames, all-or-nothing frame writes under
  cancellation, writers woken by window updates, window updates in batches, no RTT pings.
- TCP + Noise (``_io_tuning``): buffered socket reads, one socket write per muxer frame.
- DCUtR's source-bound TCP dials (``_libp2p_fixes.HolePunchTCP``): no socket leak when cancelled.
- The peerstore (``_libp2p_fixes.CircuitKeepingPeerStore``): a peer's ``/p2p-circuit``
  addresses survive identify replacing its addresses with its (private) listen addresses.
- Relayed circuits (``_relay_splice.SplicingCircuitRelay``, passed by ``relay.py``): our own
  copy loop between a circuit's two streams, cleaned up per circuit, not per peer.
- Inbound connections (``_inbound_handler``): each one's handler task, and its inbound slot,
  end with the connection (py-libp2p kept them until the host stopped: 300 connect/disconnect
  cycles locked a host out of inbound connections for good).
- Multistream-select (``_multistream.PipelinedMultiselectClient``): header and protocol in one
  write (one round trip per stream instead of two).
- Identify: py-libp2p runs identify both ways on every new connection (two extra streams,
  a signed peer record built and verified each way: ~30-50% of the CPU of a dial here). Our
  hosts identify the peers *they* dialled only (``identify_dialled_peers_only``): what the
  listener would learn (the dialer's listen addresses and protocols) swarmtrain's protocols
  carry themselves (the DHT's node info, relay reservations), and py-libp2p still identifies
  a peer before it caches protocols for it. ``SWARMTRAIN_IDENTIFY_INBOUND=1`` restores
  identify on inbound connections.
- Dialling: py-libp2p waits 250 ms (``swarm._HAPPY_EYEBALLS_DELAY``) after starting the dial
  of an address, even when it succeeded; our swarm's ``dial_peer`` reads it as 0
  (``remove_dial_delay``, on the instance: ``_scoped_globals``).
- Connection logging (``log_connections_to_module_logger``): py-libp2p's ``SwarmConn`` logs
  with ``logging.debug(...)``, the root logger, which runs ``logging.basicConfig()`` when the
  root logger has no handler yet (the application's own ``basicConfig`` was then ignored); our
  swarm builds a subclass whose methods log to the module's logger.
- Logging: py-libp2p logs bare warnings (and sometimes hex dumps of whole values) and reports
  routine events (a peer closing during identify) as errors; its loggers stay at CRITICAL
  unless ``SWARMTRAIN_LIBP2P_LOG_LEVEL`` or ``LIBP2P_DEBUG`` says otherwise.

``check_libp2p_version`` fails loudly on any other py-libp2p version.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import version

SUPPORTED_LIBP2P_VERSION = "0.8.1"
_logging_configured = False


def check_libp2p_version() -> None:
    """Raise unless the installed py-libp2p is the version swarmtrain's subclasses target."""
    installed = version("libp2p")
    if installed != SUPPORTED_LIBP2P_VERSION:
        raise RuntimeError(
            f"swarmtrain needs libp2p=={SUPPORTED_LIBP2P_VERSION} (found {installed}): "
            "it subclasses that version's internals; reinstall with "
            f"`pip install libp2p=={SUPPORTED_LIBP2P_VERSION}`"
        )


def remove_dial_delay(host) -> None:
    """py-libp2p 0.8.1's ``Swarm.dial_peer`` waits ``_HAPPY_EYEBALLS_DELAY`` (250 ms, a module
    constant read inside it) after starting the dial of each address, even when the dial
    already succeeded. ``host``'s swarm gets a ``dial_peer`` that reads it as 0 (a peer's at
    most 2 addresses are dialled at once); the module and other hosts keep 250 ms."""
    from swarmtrain.p2p._scoped_globals import override_method_globals

    override_method_globals(host.get_network(), "dial_peer", _HAPPY_EYEBALLS_DELAY=0.0)


#: the module whose connection class logs through the ``logging`` module's functions
SWARM_CONNECTION_MODULE = "libp2p.network.connection.swarm_connection"
_logged_swarm_conn: type | None = None


def log_connections_to_module_logger(host) -> None:
    """``host``'s swarm wraps its connections in a ``SwarmConn`` subclass that logs to the
    ``libp2p.network.connection.swarm_connection`` logger instead of the root logger.

    py-libp2p 0.8.1's ``SwarmConn`` logs with ``logging.debug/warning(...)``: the root logger,
    and when the root logger has no handler yet each such call runs ``logging.basicConfig()``.
    That happened as soon as two peers connected, and the application's own
    ``logging.basicConfig(level=...)`` afterwards was silently ignored. ``Swarm.add_conn``
    builds the connection after a function-local import; our swarm gets a copy of it whose
    import yields the subclass (``_scoped_globals``), whose methods read ``logging`` as that
    logger (a logger has the same ``debug/warning`` methods). Other hosts keep stock behaviour.
    """
    from libp2p.network.connection.swarm_connection import SwarmConn

    from swarmtrain.p2p._scoped_globals import override_method_imports, subclass_with_globals

    global _logged_swarm_conn
    if _logged_swarm_conn is None:
        logger = logging.getLogger(SWARM_CONNECTION_MODULE)
        _logged_swarm_conn = subclass_with_globals(SwarmConn, logging=logger)
    override_method_imports(
        host.get_network(), "add_conn", SWARM_CONNECTION_MODULE, SwarmConn=_logged_swarm_conn
    )


def tune_host(host) -> None:
    """Give a new py-libp2p host (not yet running) swarmtrain's per-host behaviour."""
    from swarmtrain.p2p._inbound_handler import end_inbound_handlers_with_their_connections
    from swarmtrain.p2p._libp2p_fixes import keep_circuit_addrs, use_hole_punch_tcp
    from swarmtrain.p2p._multistream import use_pipelined_multistream
    from swarmtrain.p2p._yamux import use_tuned_yamux

    use_tuned_yamux(host)
    remove_dial_delay(host)
    log_connections_to_module_logger(host)
    use_hole_punch_tcp(host)
    keep_circuit_addrs(host)
    end_inbound_handlers_with_their_connections(host)
    use_pipelined_multistream(host)
    if os.environ.get("SWARMTRAIN_IDENTIFY_INBOUND") != "1":
        identify_dialled_peers_only(host)


def configure_process(*, quiet_logging: bool = True) -> None:
    """Once per process: the log levels of py-libp2p's loggers."""
    configure_logging(quiet_logging=quiet_logging)


def configure_logging(*, quiet_logging: bool = True) -> None:
    """Once per process: quieten py-libp2p's loggers (a level, no handler)."""
    global _logging_configured
    if _logging_configured:
        return
    if quiet_logging:
        # py-libp2p logs expected events (a peer closing during identify) at ERROR level.
        # (py-libp2p itself sets WARNING with no handler, so Python's last-resort handler prints
        # them; LIBP2P_DEBUG, py-libp2p's own switch, keeps its behaviour.)
        if not os.environ.get("LIBP2P_DEBUG"):
            level = os.environ.get("SWARMTRAIN_LIBP2P_LOG_LEVEL", "CRITICAL").upper()
            logging.getLogger("libp2p").setLevel(getattr(logging, level, logging.CRITICAL))
    _logging_configured = True


def identify_dialled_peers_only(host) -> None:
    """Skip py-libp2p's identify toward peers that dialled ``host`` (see the module docstring):
    an instance attribute of this host, py-libp2p's ``BasicHost`` class stays as is."""
    stock = getattr(host, "_schedule_identify", None)
    if stock is None:
        raise RuntimeError("libp2p internals changed: BasicHost._schedule_identify is missing")

    def schedule_identify(peer_id, *, reason: str) -> None:
        # "notifee-connected" fires for every new connection, inbound or outbound (our dials
        # also schedule "connect"); the other reasons are requests for this very peer.
        if reason == "notifee-connected" and not _dialled(host, peer_id):
            return
        stock(peer_id, reason=reason)

    host._schedule_identify = schedule_identify


def _dialled(host, peer_id) -> bool:
    """Whether one of our connections to ``peer_id`` is one we opened (or of unknown origin)."""
    try:
        connections = host.get_network().get_connections(peer_id)
    except Exception:
        return True
    return any(str(getattr(conn, "direction", "unknown")) != "inbound" for conn in connections)
