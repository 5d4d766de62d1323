"""The helper process of a ``ProcessAverager``: its own trio loop, DHT and averager.

The parent (``process_averager.py``) spawns this with the averaged tensors (in shared memory:
the child adds its deltas to the very pages the trainer reads), a cross-process lock around
them, and one end of a pipe (the parent's end: ``process_pipe.py``). Messages on the pipe are
small tuples:

- parent -> child: ``(call_id, op, args)``; ``op`` is one of ``_OPS``;
- child -> parent: ``("ready", info)`` once, then ``("reply", call_id, ok, value)`` per call,
  ``("step_stage", step_id, stage)`` when a step started with ``start_step`` changes stage and
  ``("step_done", step_id, ok, value)`` when it ends; ``("failed", error)`` if the start failed.

Errors travel pickled (``_portable``): the parent re-raises the same type, even for exception
classes whose ``__init__`` does not take their ``args``.

Lifetime: the child leaves its averager and DHT (saying goodbye to the swarm) on the
``shutdown`` op, and also when the pipe reaches EOF -- the parent closed it or died -- so a
killed trainer never leaves an orphaned helper behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import trio

from swarmtrain.averaging.control import AveragingStage

logger = logging.getLogger(__name__)


def _rebuild_exception(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """Unpickled in the parent: ``cls`` with ``args`` and attributes, without its ``__init__``
    (whose signature need not match ``args``)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class _PortableError:
    """Pickles as ``_rebuild_exception(...)``: the parent gets the error itself back."""

    def __init__(self, error: BaseException):
        self.parts = (type(error), error.args, dict(vars(error)))

    def __reduce__(self):
        return _rebuild_exception, self.parts


def _portable(error: BaseException) -> Any:
    """What to send for ``error`` so that the parent re-raises the same type: ``error`` if it
    survives a pickle round trip, else its class, args and attributes (or, if even those do
    not pickle, a ``RuntimeError`` naming it)."""
    for candidate in (error, _PortableError(error)):
        try:
            pickle.loads(pickle.dumps(candidate))
            return candidate
        except Exception:
            continue
    return RuntimeError(f"{type(error).__name__}: {error}")


class _ThreadingStyleLock:
    """A ``multiprocessing`` lock with ``threading.Lock``'s ``acquire(blocking, timeout)``
    signature, which the averager uses."""

    def __init__(self, lock: Any):
        self._lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking:
            return self._lock.acquire(False)
        return self._lock.acquire(True, None if timeout is None or timeout < 0 else timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


class _Child:
    """Serves the parent's calls on one averager (see the module docstring)."""

    def __init__(self, conn: Connection, averager: Any, nursery: trio.Nursery):
        self.conn, self.averager, self.nursery = conn, averager, nursery
        self.controls: dict[int, Any] = {}
        self.stop = trio.Event()

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self.stop.set()  # the parent is gone

    async def receive_loop(self) -> None:
        while not self.stop.is_set():
            await trio.lowlevel.wait_readable(self.conn.fileno())
            try:
                call_id, op, args = self.conn.recv()
            except (EOFError, OSError):
                logger.info("the parent closed the pipe (or died): the averager's helper stops")
                self.stop.set()
                return
            if op in _IN_ORDER:  # never await: served here, in the order they were sent
                await self.serve_call(call_id, op, args)
            else:
                self.nursery.start_soon(self.serve_call, call_id, op, args)

    async def serve_call(self, call_id: int, op: str, args: tuple) -> None:
        try:
            value = await _OPS[op](self, *args)
        except Exception as e:
            self.send(("reply", call_id, False, _portable(e)))
        else:
            self.send(("reply", call_id, True, value))

    # ----------------------------------------------------------------- ops

    async def start_step(self, step_id: int, kwargs: dict) -> None:
        control = self.averager.start_step(**kwargs)
        self.controls[step_id] = control

        def report_stage(stage: Any) -> None:
            self.send(("step_stage", step_id, stage))

        control._on_stage = report_stage  # the parent reads the stage without asking
        if control.stage is not AveragingStage.IDLE and not control.done():
            report_stage(control.stage)
        self.nursery.start_soon(self._report_step, step_id, control)

    async def _report_step(self, step_id: int, control: Any) -> None:
        try:
            value = await control.wait_result()
        except BaseException as e:  # StepControl re-raises the step's error
            if isinstance(e, trio.Cancelled):
                raise
            self.send(("step_done", step_id, False, _portable(e)))
        else:
            self.send(("step_done", step_id, True, value))
        finally:
            self.controls.pop(step_id, None)

    async def control(self, step_id: int, action: str, value: Any = None) -> Any:
        control = self.controls.get(step_id)
        if control is None:
            return None  # finished meanwhile: its step_done is on the way
        if action == "stage":
            return control.stage
        if action == "allow_allreduce":
            return control.allow_allreduce()
        if action == "cancel":
            return control.cancel()
        if action in ("weight", "scheduled_time"):
            setattr(control, action, value)
            return None
        raise ValueError(f"unknown step control action {action!r}")

    async def call(self, name: str, args: tuple) -> Any:
        if name not in _METHODS:
            raise ValueError(f"the averager's helper has no method {name!r}")
        value = getattr(self.averager, name)(*args)
        if name == "load_state_from_peers":
            value = await value
        return value

    async def get(self, name: str) -> Any:
        if name not in _ATTRIBUTES:
            raise ValueError(f"the averager's helper has no attribute {name!r}")
        if name == "banned_peers":
            from swarmtrain.dht import get_dht_time

            return frozenset(self.averager.bans.banned(get_dht_time()))
        return getattr(self.averager, name)

    async def set(self, name: str, value: Any) -> None:
        if name not in _SETTABLE:
            raise ValueError(f"the averager's helper cannot set {name!r}")
        setattr(self.averager, name, value)

    async def shutdown(self) -> None:
        self.stop.set()

    async def crash(self, exit_code: int) -> None:
        """For tests: the helper dies at once, as a segfault or the OOM killer would do it."""
        os._exit(exit_code)


#: ops that never await (a parent that does not wait for their answers relies on the order)
_IN_ORDER = frozenset({"start_step", "control"})
_METHODS = frozenset({"get_group_bits", "set_group_bits", "load_state_from_peers"})
_SETTABLE = frozenset({"allow_state_sharing", "state_sharing_priority"})
_ATTRIBUTES = _SETTABLE | {
    "part_bytes_sent",
    "delta_bytes_sent",
    "state_download_failure",
    "banned_peers",
    "steps_started",
}
_OPS: dict[str, Callable[..., Any]] = {
    "start_step": _Child.start_step,
    "control": _Child.control,
    "call": _Child.call,
    "get": _Child.get,
    "set": _Child.set,
    "shutdown": _Child.shutdown,
    "crash": _Child.crash,
}


async def _serve(conn: Connection, tensors, lock, initial_peers, dht_kwargs, averager_kwargs):
    from swarmtrain.averaging.async_averager import AsyncDecentralizedAverager
    from swarmtrain.dht import DHT
    from swarmtrain.utils.gc_tuning import freeze_startup_objects

    async with DHT.create(initial_peers, **dht_kwargs) as dht:
        async with AsyncDecentralizedAverager.create(
            tensors, dht, tensor_lock=_ThreadingStyleLock(lock), **averager_kwargs
        ) as averager:
            info = {
                "peer_id": dht.peer_id.to_bytes(),
                "visible_maddrs": [str(a) for a in dht.get_visible_maddrs()],
                "client_mode": averager.client_mode,
                "mode": averager.mode,
            }
            # this process holds only the swarm: its startup objects live as long as it does
            freeze_startup_objects()
            conn.send(("ready", info))
            async with trio.open_nursery() as nursery:
                child = _Child(conn, averager, nursery)
                nursery.start_soon(child.receive_loop)
                await child.stop.wait()
                nursery.cancel_scope.cancel()


def child_main(conn: Connection, tensors, lock, initial_peers, dht_kwargs, averager_kwargs):
    """Entry point of the spawned helper (``multiprocessing`` target)."""
    from swarmtrain.utils.exception_groups import collapse_exception_groups

    # Ctrl-C reaches the whole process group: the parent decides, then sends ``shutdown``
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = averager_kwargs.pop("_log_level", None)
    if level:  # the parent shows swarmtrain's logs (verbose=True): so does its helper
        from swarmtrain.utils.logs import show_logs

        show_logs(level)
    try:
        with collapse_exception_groups():
            trio.run(_serve, conn, tensors, lock, initial_peers, dht_kwargs, averager_kwargs)
    except BaseException as e:
        try:
            conn.send(("failed", _portable(e)))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        conn.close()
