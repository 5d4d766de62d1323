"""Showing swarmtrain's logs without touching the application's logging setup.

swarmtrain logs under the ``swarmtrain`` logger and, like any library, installs no handler by
default. Two switches show its progress messages (epochs, rounds, peers):

- ``verbose=True`` on ``Optimizer`` / ``DiLoCoOptimizer``: the ``swarmtrain`` logger passes INFO;
- the ``SWARMTRAIN_LOGLEVEL`` environment variable (``DEBUG``, ``INFO``, ``WARNING``, ...): that
  level, from the first import of ``swarmtrain`` (hivemind's ``HIVEMIND_LOGLEVEL``).

Either adds one handler to the ``swarmtrain`` logger, never to the root logger. It prints to
stderr only while the root logger has no handler; once the application configures logging
(``logging.basicConfig(...)``, before or after), records reach the application's handlers
through the usual propagation instead, so nothing is printed twice.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "swarmtrain"
LOGLEVEL_ENV = "SWARMTRAIN_LOGLEVEL"
LOG_FORMAT = "[%(asctime)s.%(msecs)03d %(levelname)s %(name)s] %(message)s"
DATE_FORMAT = "%H:%M:%S"


class _FallbackHandler(logging.StreamHandler):
    """Writes to stderr only while the root logger has no handler of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))

    @property
    def stream(self):  # the current stderr (pytest and users may swap it)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application's handlers get it by propagation
        super().emit(record)


def _installed_handler(logger: logging.Logger) -> _FallbackHandler | None:
    return next((h for h in logger.handlers if isinstance(h, _FallbackHandler)), None)


def show_logs(level: int | str | None = None) -> None:
    """Show swarmtrain's log records (idempotent; see the module docstring).

    The level is ``SWARMTRAIN_LOGLEVEL`` when set, else ``level`` (INFO by default); the latter
    never raises the ``swarmtrain`` logger's level: asking for INFO keeps DEBUG if the
    application chose it.
    """
    logger = logging.getLogger(LOGGER_NAME)
    from_environment = os.environ.get(LOGLEVEL_ENV)
    if from_environment:
        logger.setLevel(_parse_level(from_environment))
    else:
        wanted = logging.INFO if level is None else _parse_level(level)
        if logger.level == logging.NOTSET or logger.level > wanted:
            logger.setLevel(wanted)
    if _installed_handler(logger) is None:
        logger.addHandler(_FallbackHandler())


def show_logs_from_environment() -> None:
    """Apply ``SWARMTRAIN_LOGLEVEL`` if it is set (``import swarmtrain`` calls this)."""
    if os.environ.get(LOGLEVEL_ENV):
        show_logs()


def _parse_level(level: int | str) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(
            f"unknown log level {level!r} (in {LOGLEVEL_ENV} or verbose): use DEBUG, INFO, "
            "WARNING, ERROR or CRITICAL"
        )
    return value
