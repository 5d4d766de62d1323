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
- Logging: py-libp2p logs bare warnings (and sometimes hex dumps of whole values) and reports
  routine events (a peer closing during identify) as errors; its loggers stay at CRITICAL
  unless the user configures them or sets ``SWARMTRAIN_LIBP2P_LOG_LEVEL``.

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

    apply_io_tuning()
    fix_cancelled_frame_writes()  # a correctness fix: always on
    wake_writers_on_window_updates()
    if os.environ.get("SWARMTRAIN_YAMUX_UPDATE_PER_READ") != "1":
        batch_window_updates()
    if quiet_logging:
        # py-libp2p logs expected events (a peer closing during identify) at ERROR level.
        # (py-libp2p itself sets WARNING with no handler, so Python's last-resort handler prints
        # them; LIBP2P_DEBUG, py-libp2p's own switch, keeps its behaviour.)
        if not os.environ.get("LIBP2P_DEBUG"):
            level = os.environ.get("SWARMTRAIN_LIBP2P_LOG_LEVEL", "CRITICAL").upper()
            logging.getLogger("libp2p").setLevel(getattr(logging, level, logging.CRITICAL))
    _applied = True
