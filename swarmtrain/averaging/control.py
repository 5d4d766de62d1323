"""``StepControl``: one averaging step running in the background (``step(..., wait=False)``).

A ``StepControl`` is a ``concurrent.futures.Future`` of the gathered data, so plain code calls
``control.result()``, asyncio code awaits ``asyncio.wrap_future(control)``, and trio code
(on the averager's own loop) awaits ``control.wait_result()``. Every method may be called from
any thread: what must happen on the averager's trio loop is sent there.

Until all-reduce begins, ``weight`` and ``scheduled_time`` may change; ``allow_allreduce()``
releases a step started with ``require_trigger=True``; ``cancel()`` stops the step at any stage
(the local tensors stay as they were unless the deltas were already applied).
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import trio

__all__ = ["AveragingStage", "StepControl"]

logger = logging.getLogger(__name__)


class AveragingStage(enum.Enum):
    """Where a step is (hivemind's names and values)."""

    IDLE = 0  # created, not started yet
    LOOKING_FOR_GROUP = 1  # matchmaking
    AWAITING_TRIGGER = 2  # a group is assembled; waiting for allow_allreduce()
    RUNNING_ALLREDUCE = 3  # exchanging tensors with the group
    FINISHED = 4  # done, failed or cancelled


def _check_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight must be a number, got {weight!r}")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"weight must be finite and non-negative, got {weight}")
    return float(weight)


class StepControl(Future):
    """Control and result of one step; built by the averager (see the module docstring).

    :param scheduled_time: DHT time at which we intend to begin all-reduce
    :param deadline: DHT time after which matchmaking gives up (``inf``: never)
    :param allow_retries: look for another group after a failed attempt, until the deadline
    :param weight: our weight in the average
    :param gather: the serialized data to share with the group
    :param require_trigger: wait for :meth:`allow_allreduce` before all-reduce
    """

    def __init__(
        self,
        *,
        scheduled_time: float,
        deadline: float,
        allow_retries: bool,
        weight: float,
        gather: bytes,
        require_trigger: bool,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
    ):
        super().__init__()
        # Built on the averager's loop thread: the trio objects below belong to that loop.
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._stage = AveragingStage.IDLE
        self._weight = _check_weight(weight)
        self._scheduled_time = float(scheduled_time)
        self._deadline = float(deadline)
        self._allow_retries = bool(allow_retries)
        self._gather = gather
        self.expected_group_size = expected_group_size  #: see ``step``; read at each attempt
        self.group_bits = group_bits  #: see ``step`` (None: the averager's group bits)
        self._trigger = trio.Event()
        if not require_trigger:
            self._trigger.set()
        self._finished = trio.Event()
        self._cancel_scope = trio.CancelScope()
        self._on_scheduled_time: Callable[[float], None] | None = None
        #: called with each new stage before FINISHED (a helper process reports them)
        self._on_stage: Callable[[AveragingStage], None] | None = None
        #: all-reduce attempts this step began (a step whose group failed and that found
        #: another one has several), and how many of them failed
        self.attempts = self.failed_attempts = 0
        #: encoded tensor bytes this step sent, over all its attempts: ``(parts as a sender,
        #: averaged deltas as a reducer)``; ``failed_bytes_sent``: those of failed attempts
        self.bytes_sent: tuple[int, int] = (0, 0)
        self.failed_bytes_sent: tuple[int, int] = (0, 0)
        self._attempt_bytes: tuple[int, int] = (0, 0)

    # ------------------------------------------------------------ thread hopping

    def _in_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def _run_in_loop(self, fn: Callable[[], Any]) -> None:
        if self._in_loop_thread():
            fn()
        else:
            try:
                self._token.run_sync_soon(fn)
            except trio.RunFinishedError:
                pass  # the loop is gone, and so is the step

    # ------------------------------------------------------------ what the user sees

    @property
    def stage(self) -> AveragingStage:
        return self._stage

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def allow_retries(self) -> bool:
        return self._allow_retries

    @property
    def data_for_gather(self) -> bytes:
        return self._gather

    @property
    def triggered(self) -> bool:
        return self._trigger.is_set()

    @property
    def began_allreduce(self) -> bool:
        return self._stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED)

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, weight: float) -> None:
        weight = _check_weight(weight)
        with self._lock:
            if self.began_allreduce:
                raise RuntimeError("too late to change the weight: all-reduce has begun")
            self._weight = weight

    @property
    def scheduled_time(self) -> float:
        return self._scheduled_time

    @scheduled_time.setter
    def scheduled_time(self, scheduled_time: float) -> None:
        scheduled_time = float(scheduled_time)
        if math.isnan(scheduled_time):
            raise ValueError("scheduled_time must be a number")
        with self._lock:
            if self.began_allreduce:
                raise RuntimeError("too late to change scheduled_time: all-reduce has begun")
            self._scheduled_time = scheduled_time
            listener = self._on_scheduled_time
        if scheduled_time >= self._deadline:
            logger.warning("scheduled_time is past the step's deadline; the step will likely fail")
        if listener is not None:
            self._run_in_loop(lambda: listener(scheduled_time))

    def allow_allreduce(self) -> None:
        """Let a step started with ``require_trigger=True`` run all-reduce once it has a group."""
        if self._trigger.is_set():
            logger.warning("allow_allreduce() was already called for this step")
            return
        self._run_in_loop(self._trigger.set)

    def cancel(self) -> bool:
        """Stop the step at whatever stage it is; ``result()`` raises ``CancelledError``.
        False if the step had already finished."""
        if not super().cancel():
            return False
        self._run_in_loop(self._cancel_scope.cancel)
        return True

    def result(self, timeout: float | None = None) -> Any:
        """Block until the step is done: the gathered data ``{peer_id: gather}``, or the error
        (``AveragingError`` subclasses say why). From trio, use :meth:`wait_result`."""
        if self._in_loop_thread() and not self.done():
            raise RuntimeError(
                "StepControl.result() would block the averager's own trio loop; "
                "use `await control.wait_result()` there"
            )
        return super().result(timeout)

    async def wait_result(self) -> Any:
        """trio (on the averager's loop): wait for the step, return or raise like :meth:`result`."""
        await self._finished.wait()
        return super().result(0)

    def __repr__(self) -> str:
        return f"<StepControl stage={self._stage.name} done={self.done()}>"

    # ------------------------------------------------------------ the averager's side

    def _set_stage(self, stage: AveragingStage) -> None:
        self._stage = stage
        if self._on_stage is not None:
            self._on_stage(stage)

    async def _wait_for_trigger(self) -> None:
        await self._trigger.wait()

    def _begin_allreduce(self) -> float:
        """Enter RUNNING_ALLREDUCE and fix the weight (atomically with the setters)."""
        with self._lock:
            self._stage = AveragingStage.RUNNING_ALLREDUCE
            self.attempts += 1
            self._attempt_bytes = (0, 0)
            weight = self._weight
        if self._on_stage is not None:
            self._on_stage(AveragingStage.RUNNING_ALLREDUCE)
        return weight

    def _count_bytes(self, parts: int, deltas: int) -> None:
        """The attempt under way sent these bytes (once per attempt, when its all-reduce ends)."""
        self._attempt_bytes = (parts, deltas)
        self.bytes_sent = (self.bytes_sent[0] + parts, self.bytes_sent[1] + deltas)

    def _attempt_failed(self) -> None:
        """The attempt under way failed: its bytes count as failed ones."""
        self.failed_attempts += 1
        failed, attempt = self.failed_bytes_sent, self._attempt_bytes
        self.failed_bytes_sent = (failed[0] + attempt[0], failed[1] + attempt[1])
        self._attempt_bytes = (0, 0)

    def _finish(self, result: Any = None, exception: BaseException | None = None) -> None:
        self._stage = AveragingStage.FINISHED
        try:
            if exception is not None:
                self.set_exception(exception)
            else:
                self.set_result(result)
        except InvalidStateError:
            pass  # cancelled meanwhile
        self._finished.set()
