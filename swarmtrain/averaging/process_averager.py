"""``ProcessAverager``: ``DecentralizedAverager``'s blocking API, the swarm in a helper process.

The blocking ``DecentralizedAverager`` runs its host, DHT and all-reduce on a trio loop in a
background thread of the trainer's process. A trainer whose main thread is busy in Python
(HF Trainer, many small kernels, data loading in threads) holds the GIL most of the time, and
the loop then gets it only every ``sys.getswitchinterval()`` seconds: an all-reduce round that
takes 0.2 s next to an idle main thread can take seconds (``benchmarks/RESULTS.md``, "helper-
process mode"). ``ProcessAverager`` moves the swarm out of the trainer's GIL::

    if __name__ == "__main__":            # the helper is spawned: scripts need this guard
        averager = ProcessAverager(tensors, initial_peers=[...], prefix="run")
        averager.step()                       # or control = averager.step(wait=False)
        with averager.get_tensors() as tensors:   # averaged in place, as before
            ...
        averager.shutdown()

- The tensors are moved to shared memory (``tensor.share_memory_()``, in place: the same tensor
  objects, e.g. a model's parameters, stay valid) and the helper adds its deltas to them
  directly; ``get_tensors()`` takes a lock shared with the helper. CPU tensors only.
- The helper runs its own DHT (its own host and peer id): pass ``initial_peers`` and
  ``dht_kwargs``, or a running blocking ``dht`` to join the swarm through it (its visible
  addresses and its initial peers; ``client_mode`` and the relay/AutoNAT/``swarm_key``
  settings are inherited).
- Calls go over a pipe; each waits at most ``call_timeout`` seconds (steps and state downloads
  wait as long as their own ``timeout``). An error in the helper is re-raised in the trainer
  with its own type; if the helper dies, every waiting call and step raises
  :class:`HelperProcessError` with its exit code.
- Lifetime: ``shutdown()`` (or leaving ``with``) makes the helper leave the swarm and waits
  for it; at interpreter exit it is shut down like the other swarmtrain objects; if the
  trainer dies, the helper sees its pipe close and exits by itself.

asyncio trainers: ``await averager.aio.step(...)``, ``await averager.aio.load_state_from_peers()``.

Not forwarded: overriding ``get_current_state`` (the helper shares the averaged tensors and
its group bits, like the default).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing
import trio

from swarmtrain.averaging._process_child import child_main
from swarmtrain.averaging.async_averager import GatheredData, _check_group_bits
from swarmtrain.averaging.averager_config import (
    AveragerConfig,
    check_averaged_tensors,
    compute_schema_hash,
)
from swarmtrain.averaging.control import AveragingStage, _check_weight
from swarmtrain.averaging.process_pipe import HelperPipe, HelperProcessError
from swarmtrain.averaging.state_sharing import StateDownloadFailure
from swarmtrain.dht import serialize
from swarmtrain.p2p import PeerID
from swarmtrain.utils import exit_shutdown

__all__ = ["HelperProcessError", "ProcessAverager", "ProcessStepControl"]

logger = logging.getLogger(__name__)
#: DHT keywords a helper takes over from the ``dht`` it joins through
INHERITED_DHT_KEYWORDS = (
    "use_relay",
    "relay_service",
    "use_autonat",
    "swarm_key",
    "request_timeout",
)
#: while waiting for the tensors' lock, how often to check that the helper still lives (s)
_LOCK_SLICE = 0.5


def _step_keywords(arguments: dict[str, Any], **fixed: Any) -> dict[str, Any]:
    """The helper's ``start_step`` keywords: a step method's arguments (its ``locals()`` on
    entry) but ``self`` and ``wait``, and ``fixed``."""
    return {k: v for k, v in {**arguments, **fixed}.items() if k not in ("self", "wait")}


class ProcessStepControl(Future):
    """A step running in the helper (``step(wait=False)``): a ``concurrent.futures.Future`` of
    the gathered data with :class:`StepControl`'s controls, each forwarded to the helper."""

    def __init__(
        self,
        pipe: HelperPipe,
        step_id: int,
        weight: float | None,
        gather: Any = None,
        call_timeout: float | None = None,
    ):
        super().__init__()
        self._pipe, self._step_id, self._call_timeout = pipe, step_id, call_timeout
        self._weight = weight
        self._triggered = False
        self._stage = AveragingStage.IDLE  # as the helper reports it
        #: the serialized ``gather`` of this step (as ``StepControl.data_for_gather``)
        self.data_for_gather: bytes = serialize(gather)

    def _control(self, action: str, value: Any = None) -> Any:
        return self._pipe.call("control", self._step_id, action, value, timeout=self._call_timeout)

    def _control_nowait(self, action: str, value: Any = None) -> None:
        """Send a control without waiting for the answer (the helper applies controls in the
        order they were sent); an error in the helper fails this step."""
        self._pipe.send("control", self._step_id, action, value).add_done_callback(
            self._fail_on_error
        )

    def _fail_on_error(self, answer: Future) -> None:
        """(The pipe's reader thread) the helper refused a start or a control: fail here, and
        stop the step there if it runs."""
        error = answer.exception()
        if error is None:
            return
        self._forget()
        self._finish(False, error)
        with contextlib.suppress(HelperProcessError, RuntimeError):
            self._pipe.send("control", self._step_id, "cancel", None)

    @property
    def stage(self) -> AveragingStage:
        """The step's stage as the helper last reported it (each change is sent to this
        process: reading it asks nothing)."""
        return AveragingStage.FINISHED if self.done() else self._stage

    @property
    def weight(self) -> float | None:
        return self._weight

    @weight.setter
    def weight(self, weight: float) -> None:
        weight = _check_weight(weight)
        if self._triggered:  # all-reduce may have begun: the helper says whether it took it
            self._control("weight", weight)
        else:  # before the trigger the helper always takes it: no wait (never blocks a loop)
            self._control_nowait("weight", weight)
        self._weight = weight

    @property
    def scheduled_time(self) -> None:
        raise AttributeError("read scheduled_time in the helper: only setting it is forwarded")

    @scheduled_time.setter
    def scheduled_time(self, scheduled_time: float) -> None:
        self._control("scheduled_time", scheduled_time)

    @property
    def triggered(self) -> bool:
        """Whether :meth:`allow_allreduce` was called (always true without a trigger)."""
        return self._triggered

    def allow_allreduce(self) -> None:
        """Let a step started with ``require_trigger=True`` run all-reduce once it has a group
        (sent without waiting for the helper's answer)."""
        self._control_nowait("allow_allreduce")
        self._triggered = True

    def cancel(self) -> bool:
        """Stop the step (``result()`` raises ``CancelledError``); False if it had finished.
        Returns at once: the helper cancels its step when the message arrives."""
        if not super().cancel():
            return False
        try:
            self._pipe.send("control", self._step_id, "cancel", None)
        except (HelperProcessError, RuntimeError):
            pass  # the helper is gone or going: the step ends with it
        return True

    async def wait_result(self) -> Any:
        """From a trio task (as ``StepControl.wait_result``): wait for the step without
        blocking the loop, return or raise like :meth:`result`."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()

        def wake(_: Future) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(finished.set)

        self.add_done_callback(wake)
        await finished.wait()
        return self.result(0)

    def __repr__(self) -> str:
        return f"<ProcessStepControl step={self._step_id} done={self.done()}>"

    def _forget(self) -> None:
        """Take no more reports of this step from the helper (it failed here)."""
        self._pipe.forget_step(self._step_id)

    def _on_stage(self, stage: AveragingStage) -> None:
        """(The pipe's reader thread) the helper reports the step's new stage."""
        self._stage = stage

    def _finish(self, ok: bool, value: Any) -> None:
        """(The pipe's reader thread) the helper reports the step's end."""
        try:
            if ok:
                self.set_result(value)
            else:
                self.set_exception(value)
        except InvalidStateError:
            pass  # cancelled meanwhile


class ProcessAverager:
    """``DecentralizedAverager``'s blocking API with the swarm in a helper process (see the
    module docstring). Averager keywords: :class:`AveragerConfig`.

    :param dht: a running blocking ``DHT`` whose swarm the helper joins (optional)
    :param initial_peers: the helper DHT's bootstrap peers (default: from ``dht``)
    :param dht_kwargs: more ``DHT`` keywords for the helper's DHT (host addresses, relays, ...)
    :param start_timeout: seconds the helper may take to start (spawning imports torch)
    :param call_timeout: seconds a call other than a step or a state download may take
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any = None,
        *,
        prefix: str,
        start: bool = True,
        initial_peers: Sequence[str] | None = None,
        dht_kwargs: dict[str, Any] | None = None,
        client_mode: bool | None = None,
        start_timeout: float = 120.0,
        call_timeout: float = 60.0,
        **kwargs: Any,
    ):
        dht_kwargs = dict(dht_kwargs or {})
        if dht is not None:
            if initial_peers is None:
                # a blocking DHT, or a trio AsyncDHT (no bootstrap list or keywords of its own)
                initial_peers = [*dht.get_visible_maddrs(), *getattr(dht, "_initial_peers", ())]
            if client_mode is None:
                client_mode = dht.client_mode
            own = getattr(dht, "_kwargs", {})
            inherited = {k: v for k, v in own.items() if k in INHERITED_DHT_KEYWORDS}
            dht_kwargs = {**inherited, **dht_kwargs}
        if client_mode is None:
            client_mode = bool(dht_kwargs.get("client_mode", False))
        dht_kwargs["client_mode"] = client_mode
        self.config = AveragerConfig(prefix=prefix, client_mode=client_mode, **kwargs)
        tensors = check_averaged_tensors(averaged_tensors)
        for i, tensor in enumerate(tensors):
            if tensor.device.type != "cpu":
                raise TypeError(
                    f"averaged_tensors[{i}] is on {tensor.device}: a ProcessAverager shares CPU "
                    "tensors with its helper (keep a CPU copy of what you average)"
                )
        self._averaged_tensors = tensors
        self.prefix, self.mode, self.client_mode = prefix, self.config.mode, client_mode
        self._initial_peers = list(initial_peers or ())
        self._dht_kwargs = dht_kwargs
        self._averager_kwargs = {"prefix": prefix, "client_mode": client_mode, **kwargs}
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        self._context = torch.multiprocessing.get_context("spawn")
        self.lock_averaged_tensors = self._context.Lock()
        self._process: Any = None
        self._pipe: HelperPipe | None = None
        self._step_ids = itertools.count()
        self._info: dict[str, Any] = {}
        self._shut_down = False
        if start:
            self.run_in_background()

    # ------------------------------------------------------------------ lifetime

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Spawn the helper and wait until its averager serves requests (``await_ready`` is
        accepted for compatibility; ``timeout`` overrides ``start_timeout``)."""
        if self._process is not None or self._shut_down:
            raise RuntimeError("the averager was already started")
        for tensor in self._averaged_tensors:
            tensor.share_memory_()
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=child_main,
            args=(
                child_conn,
                self._averaged_tensors,
                self.lock_averaged_tensors,
                self._initial_peers,
                self._dht_kwargs,
                {**self._averager_kwargs, "_log_level": logging.getLogger("swarmtrain").level},
            ),
            name="swarmtrain-averager",
            daemon=True,
        )
        process.start()
        child_conn.close()  # only the child holds its end now: EOF when either side dies
        self._process, self._pipe = process, HelperPipe(parent_conn, self._exit_text)
        try:
            self._info = self._pipe.wait_ready(self.start_timeout if timeout is None else timeout)
        except BaseException:
            self._kill()
            raise
        self._pipe.start_reading()
        exit_shutdown.track(self)

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.is_alive():
            process.kill()
        if process is not None:
            process.join(5)
        if self._pipe is not None:
            self._pipe.close()

    def _exit_text(self, what: str) -> str:
        process = self._process
        process.join(2)
        code = process.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
        return f"the averager's helper process (pid {process.pid}) {what} ({how})"

    def is_alive(self) -> bool:
        return self._pipe is not None and self._pipe.gone is None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        """The helper process's id (None before it started)."""
        return None if self._process is None else self._process.pid

    def shutdown(self, timeout: float | None = None) -> None:
        """Make the helper leave the swarm and exit (running steps fail); wait for it at most
        ``timeout`` seconds (None: 30), then kill it."""
        if self._shut_down:
            return
        self._shut_down = True
        exit_shutdown.forget(self)
        if self._pipe is None:
            return
        self._pipe.begin_shutdown()
        wait = 30.0 if timeout is None else timeout
        try:
            self._pipe.call("shutdown", timeout=wait)
        except (HelperProcessError, TimeoutError, RuntimeError):
            pass
        self._process.join(wait)
        if self._process.is_alive():
            logger.warning("the averager's helper did not exit within %s s: killing it", wait)
        self._kill()
        self._pipe.close(RuntimeError("the averager was shut down"))

    def __enter__(self) -> ProcessAverager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the pipe

    def _running_pipe(self) -> HelperPipe:
        if self._pipe is None:
            raise RuntimeError("the averager is not running: start it first")
        return self._pipe

    def _send(self, op: str, *args: Any) -> Future:
        """Send ``op`` to the helper: the future of its answer."""
        return self._running_pipe().send(op, *args)

    def _call(self, op: str, *args: Any, timeout: float | None = -1.0) -> Any:
        """Run ``op`` in the helper and wait for its answer (``timeout`` -1: ``call_timeout``)."""
        wait = self.call_timeout if timeout == -1.0 else timeout
        return self._running_pipe().call(op, *args, timeout=wait)

    # ------------------------------------------------------------------ hivemind's API

    @property
    def peer_id(self) -> PeerID:
        """The helper's peer id (it runs a host of its own)."""
        return PeerID(self._info["peer_id"])

    def get_visible_maddrs(self) -> list[str]:
        """The helper host's addresses (others can pass them as ``initial_peers``)."""
        return list(self._info["visible_maddrs"])

    @property
    def schema_hash(self) -> bytes:
        return compute_schema_hash(self._averaged_tensors, self.config.part_size_bytes)

    def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
    ) -> GatheredData | ProcessStepControl:
        """Average once, in the helper (see ``DecentralizedAverager.step``): the gathered data,
        or with ``wait=False`` a :class:`ProcessStepControl`."""
        if wait and require_trigger:
            raise ValueError("a step that waits cannot also wait for a trigger: use wait=False")
        control, started = self._start_step(_step_keywords(locals()))
        try:
            started.result(self.call_timeout)
        except BaseException:
            control._forget()
            raise
        if not wait:
            return control
        try:
            return control.result()
        except BaseException:
            control.cancel()  # Ctrl-C: do not leave the step running
            raise

    def start_step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
    ) -> ProcessStepControl:
        """Start a step in the helper without waiting for its acknowledgement (a trio loop
        calls this: ``step(wait=False)`` would block it for a pipe round trip): its control at
        once; a step the helper refuses fails (``wait_result`` raises)."""
        control, started = self._start_step(_step_keywords(locals()))
        started.add_done_callback(control._fail_on_error)
        return control

    def _start_step(self, kwargs: dict[str, Any]) -> tuple[ProcessStepControl, Future]:
        """Send a step (the helper's ``start_step`` keywords) to the helper: its control, and
        the future of the helper's ack."""
        pipe = self._running_pipe()
        step_id = next(self._step_ids)
        control = ProcessStepControl(
            pipe, step_id, kwargs["weight"], kwargs["gather"], self.call_timeout
        )
        control._triggered = not kwargs["require_trigger"]
        return control, pipe.send("start_step", step_id, kwargs, step=control)

    @contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors (in shared memory), locked: the helper adds no deltas inside
        this block. Do not keep using them in place after the block."""
        lock = self.lock_averaged_tensors
        while not lock.acquire(True, _LOCK_SLICE):
            if self._process is not None and not self._process.is_alive():
                # it may have died holding the lock: the tensors are ours again
                raise HelperProcessError(self._exit_text("died"))
        try:
            yield self._averaged_tensors
        finally:
            lock.release()

    def get_current_state(self) -> Any:
        """What the helper serves to newcomers: ``({"group_bits": ...}, tensor copies)``."""
        bits = self.get_group_bits()
        with self.get_tensors() as tensors:
            return {"group_bits": bits}, [t.detach().clone() for t in tensors]

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None, donors=None, check=None
    ) -> tuple[Any, list[torch.Tensor]] | Future | None:
        """Download ``(metadata, tensors)`` from the best donors, in the helper (None if
        nobody could); as ``DecentralizedAverager.load_state_from_peers``. ``check`` must be
        picklable (a module-level function or class)."""
        future = self._send("call", "load_state_from_peers", (timeout, donors, check))
        return future if not wait else future.result()

    def get_group_bits(self, wait: bool = True) -> str:
        return self._call("call", "get_group_bits", ())

    def set_group_bits(self, group_bits: str, wait: bool = True) -> None:
        self._call("call", "set_group_bits", (_check_group_bits(group_bits),))

    @property
    def bytes_sent(self) -> tuple[int, int]:
        """Encoded tensor bytes sent in all-reduce rounds: (parts, averaged deltas)."""
        return self._call("get", "part_bytes_sent"), self._call("get", "delta_bytes_sent")

    @property
    def banned_peers(self) -> frozenset[PeerID]:
        return self._call("get", "banned_peers")

    @property
    def state_download_failure(self) -> StateDownloadFailure | None:
        return self._call("get", "state_download_failure")

    @property
    def allow_state_sharing(self) -> bool:
        return self._call("get", "allow_state_sharing")

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self._call("set", "allow_state_sharing", value)

    @property
    def state_sharing_priority(self) -> float:
        return self._call("get", "state_sharing_priority")

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._call("set", "state_sharing_priority", value)

    @property
    def aio(self) -> _ProcessAio:
        """asyncio awaitables: ``await averager.aio.step(gather=...)``,
        ``await averager.aio.load_state_from_peers()`` (never block the asyncio loop)."""
        return _ProcessAio(self)

    def _crash_helper_for_tests(self, exit_code: int = 3) -> None:
        """Make the helper exit at once, without a goodbye (tests of the crash path)."""
        self._send("crash", exit_code)


class _ProcessAio:
    """``ProcessAverager.aio``: the waiting calls as asyncio awaitables."""

    def __init__(self, averager: ProcessAverager):
        self._averager = averager

    async def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (asyncio, hivemind keyword)
        allow_retries: bool = True,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
    ) -> GatheredData:
        """As ``ProcessAverager.step``; cancelling the awaiting task cancels the step."""
        keywords = _step_keywords(locals(), require_trigger=False)
        control, started = self._averager._start_step(keywords)
        try:
            await asyncio.wrap_future(started)
        except BaseException:
            control._forget()
            control.cancel()
            raise
        try:
            return await asyncio.wrap_future(control)
        except BaseException:
            control.cancel()
            raise

    async def load_state_from_peers(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 (asyncio, hivemind keyword)
        donors=None,
        check=None,
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """As ``ProcessAverager.load_state_from_peers``."""
        future = self._averager._send("call", "load_state_from_peers", (timeout, donors, check))
        return await asyncio.wrap_future(future)
