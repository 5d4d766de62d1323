"""The trainer's end of the pipe to a ``ProcessAverager``'s helper process.

A call goes out as ``(call_id, op, args)`` (the ops: ``_process_child``) and its answer comes
back as a ``concurrent.futures.Future``; a step sent with its ``start_step`` call also gets the
helper's reports of its stages and of its end. One reader thread delivers them all.

Error handling: when the helper goes (its end of the pipe closes: it exited, crashed or was
killed), every waiting call and step fails with one :class:`HelperProcessError` naming its exit
code (and the error it reported, if any), and so does every later call. After
:meth:`HelperPipe.begin_shutdown` only the ``shutdown`` call goes out, and what still waits
when the pipe closes fails with the error given to :meth:`HelperPipe.close`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from multiprocessing.connection import Connection
from typing import Any, Protocol

__all__ = ["HelperPipe", "HelperProcessError", "StepReceiver"]

logger = logging.getLogger(__name__)


class HelperProcessError(RuntimeError):
    """The averager's helper process is gone (crashed, killed, or failed to start)."""


class StepReceiver(Protocol):
    """What a step's reports go to (``ProcessStepControl``)."""

    _step_id: int

    def _on_stage(self, stage: Any) -> None: ...

    def _finish(self, ok: bool, value: Any) -> None: ...


class HelperPipe:
    """Calls to one helper process over ``conn`` (see the module docstring).

    :param conn: the trainer's end of a duplex ``multiprocessing`` pipe; closed by :meth:`close`
    :param describe_exit: ``describe_exit("exited")``: a sentence on how the helper ended (for
      :class:`HelperProcessError`)
    """

    def __init__(self, conn: Connection, describe_exit: Callable[[str], str]):
        self._conn = conn
        self._describe_exit = describe_exit
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._steps: dict[int, StepReceiver] = {}
        self._gone: BaseException | None = None  # why calls fail now (helper gone, shut down)
        self._closing = False
        self._reader: threading.Thread | None = None

    @property
    def gone(self) -> BaseException | None:
        """Why calls fail now (None while the helper serves them)."""
        return self._gone

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The helper's start report (its peer id, addresses, ...); raises its start error,
        or :class:`HelperProcessError` if it died or did not report within ``timeout``."""
        if not self._conn.poll(timeout):
            raise HelperProcessError(
                f"the averager's helper process did not start within {timeout} s"
            )
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise HelperProcessError(self._describe_exit("died while starting")) from None
        if message[0] == "failed":
            raise message[1]
        return message[1]

    def start_reading(self) -> None:
        """Start the reader thread (after :meth:`wait_ready`)."""
        self._reader = threading.Thread(
            target=self._read_loop, name="swarmtrain-averager-pipe", daemon=True
        )
        self._reader.start()

    def send(self, op: str, *args: Any, step: StepReceiver | None = None) -> Future:
        """Send a call without waiting: the future of its answer (the helper's error, re-raised
        with its own type, if it failed). ``step`` gets the reports of the step this call
        starts."""
        future: Future = Future()
        with self._lock:
            if self._closing and op != "shutdown":
                raise RuntimeError("the averager was shut down")
            if self._gone is not None:
                raise self._gone
            call_id = next(self._ids)
            self._pending[call_id] = future
            if step is not None:
                self._steps[step._step_id] = step
            try:
                self._conn.send((call_id, op, args))
            except (OSError, ValueError) as e:  # ValueError: the connection was closed
                self._pending.pop(call_id, None)
                raise HelperProcessError(f"the averager's helper process is gone ({e})") from e
        return future

    def call(self, op: str, *args: Any, timeout: float | None) -> Any:
        """Send a call and wait at most ``timeout`` seconds for its answer."""
        future = self.send(op, *args)
        try:
            return future.result(timeout)
        except FutureTimeoutError:
            raise TimeoutError(
                f"the averager's helper process did not answer {op!r} within {timeout} s"
            ) from None

    def forget_step(self, step_id: int) -> None:
        """Deliver no more reports to this step (it failed here)."""
        self._steps.pop(step_id, None)

    def begin_shutdown(self) -> None:
        """From now on refuse every call but ``shutdown``; the pipe's end is no failure."""
        with self._lock:
            self._closing = True

    def close(self, error: BaseException | None = None) -> None:
        """Close the connection (the helper sees EOF), wait for the reader thread, and fail
        what still waits with ``error`` (if given: every later call raises it too)."""
        self._conn.close()
        if self._reader is not None:
            self._reader.join(5)
        if error is not None:
            self._fail_all(error)

    def _read_loop(self) -> None:
        failure: BaseException | None = None
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "reply":
                    _, call_id, ok, value = message
                    future = self._pending.pop(call_id, None)
                    if future is not None and not future.done():
                        (future.set_result if ok else future.set_exception)(value)
                elif message[0] == "step_stage":
                    _, step_id, stage = message
                    step = self._steps.get(step_id)
                    if step is not None:
                        step._on_stage(stage)
                elif message[0] == "step_done":
                    _, step_id, ok, value = message
                    step = self._steps.pop(step_id, None)
                    if step is not None:
                        step._finish(ok, value)
                elif message[0] == "failed":
                    failure = message[1]
        except (EOFError, OSError):
            pass
        if self._closing:
            self._fail_all(RuntimeError("the averager was shut down"))
            return
        error = HelperProcessError(self._describe_exit("exited"))
        if failure is not None:
            error.__cause__ = failure
            error.args = (f"{error.args[0]}: {type(failure).__name__}: {failure}",)
        logger.error("%s", error)
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            if self._gone is None:
                self._gone = error
            pending, self._pending = self._pending, {}
            steps, self._steps = self._steps, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._gone)
        for step in steps.values():
            step._finish(False, self._gone)
