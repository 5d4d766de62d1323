"""``DecentralizedAverager``: average tensors with peers found through the DHT (hivemind's API).

One implementation (``AsyncDecentralizedAverager``, trio), three ways in:

- trio::

      async with DHT.create(initial_peers=[...]) as dht:
          async with DecentralizedAverager.create(tensors, dht=dht, prefix="run") as averager:
              gathered = await averager.step(gather={"batch_size": 32})

- plain (blocking) code, on the DHT's background trio loop::

      dht = DHT(initial_peers=[...])
      averager = DecentralizedAverager(tensors, dht=dht, prefix="run", start=True)
      gathered = averager.step()              # or control = averager.step(wait=False)
      with averager.get_tensors() as tensors:  # averaged in place
          ...
      averager.shutdown(); dht.shutdown()

- asyncio, on the same blocking object: ``await averager.aio.step(gather=...)`` and
  ``await averager.aio.load_state_from_peers()`` never block the asyncio loop.

A step: matchmaking (``swarmtrain.averaging.matchmaking``) finds a group under the current
Moshpit bucket ``{prefix}.0b{group_bits}``; the group is load-balanced by bandwidth and
averaged with butterfly all-reduce on a *copy* of the tensors; the resulting deltas
(average - copy) are added to the tensors under ``get_tensors()``'s lock, so updates the trainer
made meanwhile are kept. The bucket then rotates (``next_group_bits``). Failures raise
``MatchmakingError`` with a reason (too few peers, schema mismatch, deadline); an all-reduce in
which some peers failed still applies what was averaged (see ``AllReduceResult``).

Resource handling: ``create`` owns the all-reduce service, matchmaking, state sharing and a task
group for background steps; leaving it cancels running steps (their ``StepControl`` raises
``AveragingError``) and removes the RPC handlers. The DHT belongs to the caller. The blocking
``DecentralizedAverager`` holds a reference to the background loop until ``shutdown()``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, Literal, overload

import torch

from swarmtrain.averaging.async_averager import (
    AsyncDecentralizedAverager,
    GatheredData,
    TensorLock,
    _check_group_bits,
)
from swarmtrain.averaging.averager_config import (
    AveragerConfig,
    check_averaged_tensors,
    compute_schema_hash,
)
from swarmtrain.averaging.control import StepControl
from swarmtrain.averaging.state_checks import StateCheck, TensorsLike
from swarmtrain.averaging.state_sharing import StateDownloadFailure
from swarmtrain.dht import get_dht_time
from swarmtrain.p2p import PeerID
from swarmtrain.utils.background import BackgroundRuntime, BackgroundService
from swarmtrain.utils.facade import aio_property

__all__ = ["AsyncDecentralizedAverager", "DecentralizedAverager", "GatheredData"]


class DecentralizedAverager(BackgroundService):
    """hivemind's ``DecentralizedAverager`` for plain (blocking) code, on the blocking ``DHT``'s
    background trio loop (see the module docstring). Keywords: :class:`AveragerConfig`.

    ``DecentralizedAverager.create(tensors, dht=async_dht, prefix=...)`` is the trio way in.
    """

    create = AsyncDecentralizedAverager.create

    #: asyncio awaitables: ``await averager.aio.step(gather=...)``,
    #: ``await averager.aio.load_state_from_peers()`` (never block the asyncio loop)
    aio = aio_property()
    _aio_methods = {
        "step": AsyncDecentralizedAverager.step,
        "load_state_from_peers": AsyncDecentralizedAverager.load_state_from_peers,
    }

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        start: bool = True,
        prefix: str,
        client_mode: bool | None = None,
        **kwargs: Any,
    ):
        if client_mode is None:
            client_mode = dht.client_mode
        self.config = AveragerConfig(prefix=prefix, client_mode=client_mode, **kwargs)
        self._averaged_tensors = check_averaged_tensors(averaged_tensors)
        self.lock_averaged_tensors: TensorLock = threading.Lock()
        self.dht = dht
        self.prefix, self.mode, self.client_mode = prefix, self.config.mode, client_mode
        if start:
            self.run_in_background()

    # ------------------------------------------------------------------ lifetime

    _service_name = "the averager"

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the averager on the DHT's background loop (the constructor does this unless
        ``start=False``). ``await_ready`` and ``timeout`` are accepted for compatibility: this
        always returns once the averager serves requests."""
        dht_runtime, async_dht = self.dht._running()
        if BackgroundRuntime._instance is not dht_runtime:
            raise RuntimeError("the DHT runs on another background loop (made before a fork?)")
        self._start_in_background(lambda: self.open_async(async_dht))

    def open_async(
        self, async_dht: Any, state_provider: Callable[[], Any] | None = None
    ) -> AbstractAsyncContextManager[AsyncDecentralizedAverager]:
        """The trio averager over this object's tensors, lock and config, on ``async_dht`` (an
        ``AsyncDHT``), to enter on the caller's trio loop: how an object made with
        ``start=False`` (e.g. a ``GradientAverager`` whose buffer methods a trio optimizer
        uses) averages without the background loop. ``state_provider``: what newcomers
        download (default :meth:`get_current_state`)."""
        fields = {k: v for k, v in vars(self.config).items() if k not in ("prefix", "client_mode")}
        return AsyncDecentralizedAverager.create(
            self._averaged_tensors,
            async_dht,
            prefix=self.prefix,
            client_mode=self.client_mode,
            tensor_lock=self.lock_averaged_tensors,
            state_provider=state_provider or self.get_current_state,
            state_check=self._default_state_check(),
            **fields,
        )

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the averager (running steps fail with ``AveragingError``); the DHT stays up.
        ``timeout``: cut the close short after this many seconds."""
        super().shutdown(timeout)

    # ------------------------------------------------------------------ hivemind's API

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    @property
    def schema_hash(self) -> bytes:
        return compute_schema_hash(self._averaged_tensors, self.config.part_size_bytes)

    @overload
    def step(
        self,
        gather: Any = ...,
        scheduled_time: float | None = ...,
        weight: float | None = ...,
        timeout: float | None = ...,
        allow_retries: bool = ...,
        require_trigger: bool = ...,
        wait: Literal[True] = ...,
        expected_group_size: int | None = ...,
        group_bits: str | None = ...,
    ) -> GatheredData: ...

    @overload
    def step(
        self,
        gather: Any = ...,
        scheduled_time: float | None = ...,
        weight: float | None = ...,
        timeout: float | None = ...,
        allow_retries: bool = ...,
        require_trigger: bool = ...,
        *,
        wait: Literal[False],
        expected_group_size: int | None = ...,
        group_bits: str | None = ...,
    ) -> StepControl: ...

    @overload
    def step(
        self,
        gather: Any = ...,
        scheduled_time: float | None = ...,
        weight: float | None = ...,
        timeout: float | None = ...,
        allow_retries: bool = ...,
        require_trigger: bool = ...,
        wait: bool = ...,
        expected_group_size: int | None = ...,
        group_bits: str | None = ...,
    ) -> GatheredData | StepControl: ...

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
    ) -> GatheredData | StepControl:
        """Average once (see :meth:`AsyncDecentralizedAverager.step`): the gathered data, or
        with ``wait=False`` a :class:`StepControl` (``require_trigger`` needs ``wait=False``)."""
        if wait and require_trigger:
            raise ValueError("a step that waits cannot also wait for a trigger: use wait=False")
        runtime, core = self._running()
        control: StepControl = runtime.call_sync(
            functools.partial(
                core.start_step,
                gather,
                scheduled_time,
                weight,
                timeout,
                allow_retries,
                require_trigger,
                expected_group_size,
                group_bits,
            )
        )
        if not wait:
            return control
        try:
            return control.result()
        except BaseException:
            control.cancel()  # Ctrl-C: do not leave the step running
            raise

    @contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors, locked: no step modifies them inside this block. Do not keep
        using them in place after the block."""
        with self.lock_averaged_tensors:
            yield self._averaged_tensors

    def get_current_state(self) -> Any:
        """What newcomers download: ``(metadata, tensors)`` or ``(metadata, tensors, infos)``.
        Runs in a worker thread; override it to share more."""
        bits = self._service.get_group_bits() if self._service is not None else ""
        with self.get_tensors() as tensors:
            return {"group_bits": bits}, [t.detach().cpu().clone() for t in tensors]

    def _default_state_check(self) -> StateCheck | None:
        """Tensors like our averaged tensors, if donors serve those (``get_current_state`` is
        not overridden); else None (any tensors)."""
        if type(self).get_current_state is DecentralizedAverager.get_current_state:
            return TensorsLike.of(self._averaged_tensors)
        return None

    @overload
    def load_state_from_peers(
        self, wait: Literal[True] = ..., timeout: float | None = ..., donors=..., check=...
    ) -> tuple[Any, list[torch.Tensor]] | None: ...

    @overload
    def load_state_from_peers(
        self, wait: Literal[False], timeout: float | None = ..., donors=..., check=...
    ) -> Future: ...

    @overload
    def load_state_from_peers(
        self, wait: bool = ..., timeout: float | None = ..., donors=..., check=...
    ) -> tuple[Any, list[torch.Tensor]] | Future | None: ...

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None, donors=None, check=None
    ) -> tuple[Any, list[torch.Tensor]] | Future | None:
        """Download ``(metadata, tensors)`` from the best donors (None if nobody could);
        ``donors``: only from these peers (``PeerID`` or bytes); ``check``: a
        ``state_checks.StateCheck`` a donor's state must pass (NaN / inf never pass). Without
        one, an averager that shares the default state (its averaged tensors) takes only
        tensors of their shapes and dtypes (``state_checks.TensorsLike``); a subclass that
        overrides ``get_current_state`` should pass its own check (default: any tensors). A
        donor whose state fails is banned for 10 minutes and the next donor is tried."""
        runtime, core = self._running()
        fn = functools.partial(core.load_state_from_peers, timeout, donors, check)
        if not wait:
            return runtime.portal.start_task_soon(fn)
        return runtime.call(fn)

    def get_group_bits(self, wait: bool = True) -> str:
        runtime, core = self._running()
        return runtime.call_sync(core.get_group_bits)

    def set_group_bits(self, group_bits: str, wait: bool = True) -> None:
        runtime, core = self._running()
        runtime.call_sync(core.set_group_bits, _check_group_bits(group_bits))

    @property
    def bytes_sent(self) -> tuple[int, int]:
        """Encoded tensor bytes sent to other peers in all-reduce rounds so far:
        ``(parts as a sender, averaged deltas as a reducer)``; framing not counted."""
        _, core = self._running()
        return core.part_bytes_sent, core.delta_bytes_sent

    @property
    def banned_peers(self) -> frozenset[PeerID]:
        """Members avoided in matchmaking now, for having sent poison (``ban_duration``)."""
        _, core = self._running()
        return frozenset(core.bans.banned(get_dht_time()))

    @property
    def state_download_failure(self) -> StateDownloadFailure | None:
        """Why the last :meth:`load_state_from_peers` got no state: ``donors == 0`` when no
        peer declared one; None when it got one, timed out, or none ran."""
        return self._running()[1].state_download_failure

    @property
    def allow_state_sharing(self) -> bool:
        runtime, core = self._running()
        return runtime.call_sync(lambda: core.allow_state_sharing)

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        runtime, core = self._running()
        runtime.call_sync(setattr, core, "allow_state_sharing", value)

    @property
    def state_sharing_priority(self) -> float:
        runtime, core = self._running()
        return runtime.call_sync(lambda: core.state_sharing_priority)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        runtime, core = self._running()
        runtime.call_sync(setattr, core, "state_sharing_priority", value)
