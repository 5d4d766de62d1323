"""Shut down what is still running when the interpreter exits, as ``shutdown()`` would.

A training script that ends without calling ``opt.shutdown()`` / ``dht.shutdown()`` used to
leave its records in the DHT: its progress (epoch N, for ``metadata_expiration`` seconds) and
its offer to share the state. A new run of the same ``run_id`` started within that minute
believed the swarm was at epoch N and spent a minute trying to download the state from peers
that had left. At exit, the objects started in this process and not shut down (``DHT``,
averagers, progress trackers, the blocking ``P2P``) are now shut down newest first, so each
publishes its departure before the DHT that carries it closes; the whole takes at most
``EXIT_SHUTDOWN_TIMEOUT`` seconds, then the process exits regardless.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

#: the longest the interpreter's exit waits for the remaining objects to shut down (s)
EXIT_SHUTDOWN_TIMEOUT = 10.0

_lock = threading.Lock()
_live: dict[int, weakref.ref] = {}  # id -> object, in start order (dicts keep insertion order)
_registered_pid: int | None = None


def track(service: Any) -> None:
    """Shut ``service`` down at exit unless it was shut down before (see ``forget``)."""
    global _registered_pid
    with _lock:
        if _registered_pid != os.getpid():  # first use in this process (or in a forked child)
            _live.clear()
            atexit.register(shutdown_remaining)
            _registered_pid = os.getpid()
        _live[id(service)] = weakref.ref(service)


def forget(service: Any) -> None:
    with _lock:
        _live.pop(id(service), None)


def remaining() -> list[Any]:
    """The tracked objects still alive, newest first."""
    with _lock:
        refs = list(_live.values())
    return [s for s in (r() for r in reversed(refs)) if s is not None]


def shutdown_remaining(timeout: float = EXIT_SHUTDOWN_TIMEOUT) -> None:
    """Shut down every tracked object, newest first, within ``timeout`` seconds in all."""
    if _registered_pid != os.getpid():
        return
    services = remaining()
    if not services:
        return

    def shut_all() -> None:
        for service in services:
            try:
                service.shutdown()
            except Exception as e:  # at exit: report and go on with the others
                logger.debug("shutting down %r at exit failed: %r", service, e)

    worker = threading.Thread(target=shut_all, name="swarmtrain-exit-shutdown", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        logger.warning(
            "swarmtrain objects did not shut down within %.0f s at exit; their DHT records "
            "expire by themselves",
            timeout,
        )
