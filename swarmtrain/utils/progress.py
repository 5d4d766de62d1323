"""Progress of long work (state downloads, checkpoints, preprocessing): a bar on a terminal, two
log lines elsewhere.

Whether a bar is drawn (first match wins):

- :func:`set_progress_bars` (``True`` / ``False``; ``None`` goes back to the rules below);
- the ``SWARMTRAIN_PROGRESS_BARS`` environment variable: ``1`` / ``0`` (also ``true``/``false``,
  ``yes``/``no``, ``on``/``off``);
- otherwise a bar only when the output (stderr) is a terminal.

Without a bar, a :class:`Progress` logs one line when the work starts and one when it ends (with
its size, duration and rate), never one per update, so non-interactive logs stay short. Bars are
tqdm's (imported only when one is drawn; without tqdm the log lines are used). A bar redraws at
most every ``BAR_INTERVAL`` seconds and runs no monitor thread, so updating it per chunk from the
event loop costs a clock read; only a redraw writes to the terminal.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

__all__ = [
    "BAR_INTERVAL",
    "PROGRESS_BARS_ENV",
    "Progress",
    "format_size",
    "progress_bars_enabled",
    "progress_iter",
    "set_progress_bars",
]

PROGRESS_BARS_ENV = "SWARMTRAIN_PROGRESS_BARS"
#: seconds between two redraws of a bar
BAR_INTERVAL = 0.5
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}

logger = logging.getLogger(__name__)
_setting: bool | None = None
T = TypeVar("T")


def set_progress_bars(enabled: bool | None) -> bool | None:
    """Draw bars always (True), never (False) or only on a terminal (None: the environment
    variable, then auto); returns the previous setting."""
    global _setting
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_progress_bars takes True, False or None, got {enabled!r}")
    previous, _setting = _setting, enabled
    return previous


def progress_bars_enabled(stream: TextIO | None = None) -> bool:
    """Whether a bar is drawn on ``stream`` (default: stderr); see the module docstring."""
    if _setting is not None:
        return _setting
    value = os.environ.get(PROGRESS_BARS_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def format_size(n: float, unit: str = "B") -> str:
    """``1536`` -> ``"1.5 KiB"`` for bytes; other units as plain counts (``"12 it"``)."""
    if unit != "B":
        return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.0f} B" if prefix == "" else f"{n:.1f} {prefix}B"
        n /= 1024
    raise AssertionError("unreachable")


@functools.cache
def _bar_class() -> Any:
    """tqdm without its monitor thread (a subclass: tqdm's own class is left as it is)."""
    try:
        from tqdm import tqdm
    except ImportError:
        logger.debug("tqdm is not installed: progress is logged instead of drawn")
        return None

    class _Bar(tqdm):
        monitor_interval = 0

    return _Bar


def _open_bar(description: str, total: int | None, unit: str, file: TextIO | None) -> Any:
    bar_class = _bar_class()
    if bar_class is None:
        return None
    return bar_class(
        desc=description,
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr if file is None else file,
        mininterval=BAR_INTERVAL,
        dynamic_ncols=True,
        leave=True,
    )


class Progress:
    """One piece of long work: ``update_to`` / ``advance`` while it runs, then ``close``
    (or use it as a context manager: an exception closes it as failed).

    :param description: what is being done ("loading the state of run")
    :param total: the size when known (in ``unit``), else None
    :param unit: ``"B"`` (sizes shown in KiB/MiB/...) or a count's name
    :param log: where the start and end lines go without a bar
    :param bar: draw a bar (True), log lines (False), or decide (None: ``progress_bars_enabled``)
    :param file: the bar's output (default: stderr)
    :param clock: seconds, for the duration in the end line
    """

    def __init__(
        self,
        description: str,
        *,
        total: int | None = None,
        unit: str = "B",
        log: logging.Logger | None = None,
        bar: bool | None = None,
        file: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.description, self.total, self.unit = description, total, unit
        self.done = 0
        self.closed = False
        self._log = logger if log is None else log
        self._clock = clock
        self._started = clock()
        show = progress_bars_enabled(file) if bar is None else bar
        self._bar = _open_bar(description, total, unit, file) if show else None
        if self._bar is None:
            expected = f" ({format_size(total, unit)})" if total is not None else ""
            self._log.info("%s: started%s", description, expected)

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def update_to(self, done: int) -> None:
        """The work done so far (it may go back: a retry)."""
        if self.closed:
            return
        if self._bar is not None and done != self.done:
            self._bar.update(done - self.done)  # redraws at most every BAR_INTERVAL
        self.done = done

    def advance(self, amount: int = 1) -> None:
        self.update_to(self.done + amount)

    def set_total(self, total: int | None) -> None:
        if self.closed or total == self.total:
            return
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self, ok: bool = True, note: str = "") -> None:
        """End the bar, or log the end line: size, duration, rate (idempotent)."""
        if self.closed:
            return
        self.closed = True
        elapsed = max(self._clock() - self._started, 0.0)
        if self._bar is not None:
            self._bar.close()
            if not ok:
                self._log.info("%s: stopped after %s%s", self.description, self._size(), note)
            return
        rate = f", {format_size(self.done / elapsed, self.unit)}/s" if elapsed > 0 else ""
        outcome = "done" if ok else "stopped after"
        self._log.info(
            "%s: %s %s in %.1f s%s%s", self.description, outcome, self._size(), elapsed, rate, note
        )

    def _size(self) -> str:
        done = format_size(self.done, self.unit)
        if self.total is None or self.done == self.total:
            return done
        return f"{done} of {format_size(self.total, self.unit)}"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(ok=exc_type is None)


def progress_iter(
    items: Iterable[T],
    description: str,
    *,
    total: int | None = None,
    unit: str = "it",
    log: logging.Logger | None = None,
    bar: bool | None = None,
) -> Iterator[T]:
    """``items``, with a :class:`Progress` counting them (``total``: default ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(description, total=total, unit=unit, log=log, bar=bar) as progress:
        for item in items:
            yield item
            progress.advance()
