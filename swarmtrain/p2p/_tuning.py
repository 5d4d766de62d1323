"""How swarmtrain's hosts differ from stock py-libp2p 0.8.1, in one place.

Every change is scoped to our own hosts: they are built with our own classes and instances
(``tune_host``, ``private_network.PrivateNoiseTransport``), and py-libp2p's
modules and classes stay exactly as imported (``tests/test_libp2p_scoped.py``), so a plain
py-libp2p host in the same process behaves as stock py-libp2p. One exception remains, a
module attribute set once per process: ``route_root_logging_calls`` (see there).

- Yamux (``_yamux.TunedYamux``): 1 MiB frames, all-or-nothing frame writes under
  cancellation, writers woken by window updates, window updates in batches, no RTT pings.
- TCP + Noise (``_io_tuning``): buffered socket reads, one socket write per muxer frame.
- DCUtR's source-bound TCP dials (``_libp2p_fixes.HolePunchTCP``): no socket leak when cancelled.
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


def tune_host(host) -> None:
    """Give a new py-libp2p host (not yet running) swarmtrain's per-host behaviour."""
    from swarmtrain.p2p._libp2p_fixes import use_hole_punch_tcp
    from swarmtrain.p2p._multistream import use_pipelined_multistream
    from swarmtrain.p2p._yamux import use_tuned_yamux

    use_tuned_yamux(host)
    remove_dial_delay(host)
    use_hole_punch_tcp(host)
    use_pipelined_multistream(host)
    if os.environ.get("SWARMTRAIN_IDENTIFY_INBOUND") != "1":
        identify_dialled_peers_only(host)


def configure_process(*, quiet_logging: bool = True) -> None:
    """Once per process: the process-wide change left (root-logger calls) and log levels."""
    configure_logging(quiet_logging=quiet_logging)


def configure_logging(*, quiet_logging: bool = True) -> None:
    """Once per process: route py-libp2p's root-logger calls, quieten its loggers."""
    global _logging_configured
    if _logging_configured:
        return
    route_root_logging_calls()  # a correctness fix for the application's logging: always on
    if quiet_logging:
        # py-libp2p logs expected events (a peer closing during identify) at ERROR level.
        # (py-libp2p itself sets WARNING with no handler, so Python's last-resort handler prints
        # them; LIBP2P_DEBUG, py-libp2p's own switch, keeps its behaviour.)
        if not os.environ.get("LIBP2P_DEBUG"):
            level = os.environ.get("SWARMTRAIN_LIBP2P_LOG_LEVEL", "CRITICAL").upper()
            logging.getLogger("libp2p").setLevel(getattr(logging, level, logging.CRITICAL))
    _logging_configured = True


#: py-libp2p modules that log through the ``logging`` module's functions (the root logger)
ROOT_LOGGING_MODULES = ("libp2p.network.connection.swarm_connection",)


def route_root_logging_calls() -> None:
    """Send py-libp2p's ``logging.debug(...)``-style calls to a module logger, idempotently.

    One of the two process-wide changes to py-libp2p modules (listed in docs/libp2p.md and in
    ``tests/test_libp2p_scoped.py``). py-libp2p 0.8.1's ``swarm_connection`` logs with
    ``logging.debug/warning(...)``: the root logger, and when the root logger has no handler
    yet, each such call runs ``logging.basicConfig()``. That happened as soon as two peers
    connected, and the application's own ``logging.basicConfig(level=...)`` afterwards was
    silently ignored. The calls are made by py-libp2p's connection objects (any host's), name
    the module's global ``logging``, and change the application's root logger: no per-host
    object or handler can intercept them without changing the root logger instead. Here the
    module's ``logging`` name is bound to ``logging.getLogger(<module name>)`` (a logger has the
    same ``debug/info/warning/error/exception`` methods), under ``libp2p`` like its other logs.
    """
    import importlib

    for name in ROOT_LOGGING_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "logging", None)
        if isinstance(current, logging.Logger):
            continue
        if current is not logging:
            raise RuntimeError(f"libp2p internals changed: {name}.logging is not the module")
        module.__dict__["logging"] = logging.getLogger(name)


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
