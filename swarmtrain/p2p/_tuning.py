"""The py-libp2p 0.8.1 internals swarmtrain adjusts, in one place.

- Dial latency: py-libp2p waits ``_HAPPY_EYEBALLS_DELAY`` (250 ms) before it returns from
  every dial; we set it to 0 so all (at most 2) addresses of a peer are dialled at once.
- Yamux frames: 64 KiB frames cost a Python round trip each; we send frames of up to 1 MiB
  (sender side only: an unpatched receiver accepts frames up to its 16 MiB window cap).
- Cancelled frame writes: a task cancelled while py-libp2p writes a yamux frame killed the
  whole connection; frame writes are made all-or-nothing (``fix_cancelled_frame_writes``).
- Window updates: py-libp2p sends a yamux WINDOW_UPDATE frame after every read (two extra
  encrypted frames per small RPC); credit goes back once half the window was consumed, as in
  go-yamux (``batch_window_updates``), and a writer blocked on a closed send window waits for
  the update instead of polling every 10 ms (``wake_writers_on_window_updates``);
  ``SWARMTRAIN_YAMUX_UPDATE_PER_READ=1`` keeps py-libp2p's per-read updates.
- Multistream-select: the client sends the header and the protocol in one write (one round
  trip per stream instead of two; ``_multistream.pipeline_multistream_select``).
- Identify: py-libp2p runs identify both ways on every new connection (two extra streams,
  a signed peer record built and verified each way: ~30-50% of the CPU of a dial here). A
  peer now identifies the peers *it* dialled only (``identify_dialled_peers_only``): what
  the listener would learn (the dialer's listen addresses and protocols) swarmtrain's
  protocols carry themselves (the DHT's node info, relay reservations), and py-libp2p still
  identifies a peer before it caches protocols for it. ``SWARMTRAIN_IDENTIFY_INBOUND=1``
  restores identify on inbound connections.
- Logging: py-libp2p logs bare warnings (and sometimes hex dumps of whole values) and reports
  routine events (a peer closing during identify) as errors; its loggers stay at CRITICAL
  unless the user configures them or sets ``SWARMTRAIN_LIBP2P_LOG_LEVEL``. Its calls to the
  root logger go to a module logger (``route_root_logging_calls``), so they never run an
  implicit ``logging.basicConfig()`` that would swallow the application's own.

These are module attributes of a pinned version; ``apply_libp2p_tuning`` checks the version
and fails loudly if the attributes moved.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import version

SUPPORTED_LIBP2P_VERSION = "0.8.1"
YAMUX_MAX_FRAME_SIZE = 1024 * 1024
_applied = False


def apply_libp2p_tuning(*, quiet_logging: bool = True) -> None:
    """Idempotently apply the tuning described in this module's docstring."""
    global _applied
    if _applied:
        return
    installed = version("libp2p")
    if installed != SUPPORTED_LIBP2P_VERSION:
        raise RuntimeError(
            f"swarmtrain needs libp2p=={SUPPORTED_LIBP2P_VERSION} (found {installed}): "
            "it tunes that version's internals; reinstall with "
            f"`pip install libp2p=={SUPPORTED_LIBP2P_VERSION}`"
        )
    import libp2p.network.swarm as swarm_module
    import libp2p.stream_muxer.yamux.yamux as yamux_module

    for module, name in (
        (swarm_module, "_HAPPY_EYEBALLS_DELAY"),
        (yamux_module, "MAX_MESSAGE_SIZE"),
    ):
        if not hasattr(module, name):
            raise RuntimeError(f"libp2p internals changed: {module.__name__}.{name} is missing")
    swarm_module._HAPPY_EYEBALLS_DELAY = 0.0
    yamux_module.MAX_MESSAGE_SIZE = YAMUX_MAX_FRAME_SIZE
    from swarmtrain.p2p._io_tuning import apply_io_tuning
    from swarmtrain.p2p._libp2p_fixes import (
        batch_window_updates,
        fix_cancelled_frame_writes,
        wake_writers_on_window_updates,
    )
    from swarmtrain.p2p._multistream import pipeline_multistream_select

    apply_io_tuning()
    fix_cancelled_frame_writes()  # a correctness fix: always on
    wake_writers_on_window_updates()
    if os.environ.get("SWARMTRAIN_YAMUX_UPDATE_PER_READ") != "1":
        batch_window_updates()
    pipeline_multistream_select()
    if os.environ.get("SWARMTRAIN_IDENTIFY_INBOUND") != "1":
        identify_dialled_peers_only()
    route_root_logging_calls()  # a correctness fix for the application's logging: always on
    if quiet_logging:
        # py-libp2p logs expected events (a peer closing during identify) at ERROR level.
        # (py-libp2p itself sets WARNING with no handler, so Python's last-resort handler prints
        # them; LIBP2P_DEBUG, py-libp2p's own switch, keeps its behaviour.)
        if not os.environ.get("LIBP2P_DEBUG"):
            level = os.environ.get("SWARMTRAIN_LIBP2P_LOG_LEVEL", "CRITICAL").upper()
            logging.getLogger("libp2p").setLevel(getattr(logging, level, logging.CRITICAL))
    _applied = True


#: py-libp2p modules that log through the ``logging`` module's functions (the root logger)
ROOT_LOGGING_MODULES = ("libp2p.network.connection.swarm_connection",)


def route_root_logging_calls() -> None:
    """Send py-libp2p's ``logging.debug(...)``-style calls to a module logger, idempotently.

    py-libp2p 0.8.1's ``swarm_connection`` logs with ``logging.debug/warning(...)``: the root
    logger, and when the root logger has no handler yet, each such call runs
    ``logging.basicConfig()``. That happened as soon as two peers connected; the application's
    own ``logging.basicConfig(level=...)`` afterwards was then silently ignored. Here the
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
        module.logging = logging.getLogger(name)


def identify_dialled_peers_only() -> None:
    """Skip py-libp2p's identify toward peers that dialled us (see the module docstring)."""
    from libp2p.host.basic_host import BasicHost

    current = getattr(BasicHost, "_schedule_identify", None)
    if current is None:
        raise RuntimeError("libp2p internals changed: BasicHost._schedule_identify is missing")
    if getattr(current, "swarmtrain_fixed", False):
        return

    def schedule_identify(self, peer_id, *, reason: str) -> None:
        # "notifee-connected" fires for every new connection, inbound or outbound (our dials
        # also schedule "connect"); the other reasons are requests for this very peer.
        if reason == "notifee-connected" and not _dialled(self, peer_id):
            return
        current(self, peer_id, reason=reason)

    schedule_identify.swarmtrain_fixed = True  # type: ignore[attr-defined]
    BasicHost._schedule_identify = schedule_identify


def _dialled(host, peer_id) -> bool:
    """Whether one of our connections to ``peer_id`` is one we opened (or of unknown origin)."""
    try:
        connections = host.get_network().get_connections(peer_id)
    except Exception:
        return True
    return any(str(getattr(conn, "direction", "unknown")) != "inbound" for conn in connections)
