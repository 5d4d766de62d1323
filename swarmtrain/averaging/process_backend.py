"""``HelperProcessBackend``: run any ``DecentralizedAverager`` subclass's swarm in a helper process.

A subclass such as ``GradientAverager`` keeps its own logic (accumulators, triggers, weights)
in the trainer's process and reaches the swarm only through ``DecentralizedAverager``'s
methods (``step``, ``get_tensors``, ...). Listing this class after it puts a
:class:`~swarmtrain.averaging.process_averager.ProcessAverager` behind those methods::

    class ProcessGradientAverager(GradientAverager, HelperProcessBackend):
        pass

The subclass's ``super().step(...)`` then reaches ``HelperProcessBackend.step`` (it comes
before ``DecentralizedAverager`` in the method resolution order), which forwards to the helper.
Extra keywords for the helper: ``dht_kwargs``, ``initial_peers``, ``start_timeout``,
``call_timeout`` (see ``ProcessAverager``). A subclass that overrides ``get_current_state``
cannot be backed by a helper (the helper serves the averaged tensors itself): that raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio

from swarmtrain.averaging._process_child import _ThreadingStyleLock
from swarmtrain.averaging.averager import DecentralizedAverager
from swarmtrain.averaging.process_averager import ProcessAverager

__all__ = ["HelperProcessBackend"]

_HELPER_OPTIONS = ("dht_kwargs", "initial_peers", "start_timeout", "call_timeout")


class HelperProcessBackend(DecentralizedAverager):
    """``DecentralizedAverager``'s methods, forwarded to a ``ProcessAverager`` (see the module
    docstring)."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        start: bool = True,
        prefix: str,
        client_mode: bool | None = None,
        **kwargs: Any,
    ):
        if type(self).get_current_state is not HelperProcessBackend.get_current_state:
            raise TypeError(
                f"{type(self).__name__} overrides get_current_state: its state cannot be served "
                "from a helper process (the helper shares the averaged tensors only)"
            )
        options = {k: kwargs.pop(k) for k in _HELPER_OPTIONS if k in kwargs}
        self._helper = ProcessAverager(
            averaged_tensors,
            dht,
            prefix=prefix,
            client_mode=client_mode,
            start=False,
            **options,
            **kwargs,
        )
        self.config = self._helper.config
        self._averaged_tensors = self._helper._averaged_tensors
        self.lock_averaged_tensors = _ThreadingStyleLock(self._helper.lock_averaged_tensors)
        self.dht = dht
        self.prefix, self.mode, self.client_mode = (
            prefix,
            self.config.mode,
            self._helper.client_mode,
        )
        if start:
            self.run_in_background()

    @property
    def helper(self) -> ProcessAverager:
        """The ``ProcessAverager`` that runs this averager's swarm."""
        return self._helper

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        self._helper.run_in_background(await_ready, timeout)

    @asynccontextmanager
    async def open_async(  # type: ignore[override]
        self, async_dht: Any, state_provider: Any = None
    ) -> AsyncIterator[HelperProcessBackend]:
        """For a trio optimizer (an object made with ``start=False``): start the helper (in a
        worker thread), yield this object, whose :meth:`start_step` controls have an awaitable
        ``wait_result()``; stop the helper on the way out. ``async_dht`` is not used (the
        helper runs its own DHT, bootstrapped from the one given to the constructor)."""
        if state_provider is not None:
            raise TypeError("the helper process serves this averager's state: no state_provider")
        await trio.to_thread.run_sync(self.run_in_background)
        try:
            yield self
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.shutdown)

    def start_step(self, **kwargs: Any) -> Any:
        """Start a step in the helper: its ``ProcessStepControl`` at once (as
        ``AsyncDecentralizedAverager.start_step``; a trio loop calls this, so it does not wait
        for the helper's acknowledgement: ``ProcessAverager.start_step``)."""
        return self._helper.start_step(**kwargs)

    def shutdown(self, timeout: float | None = None) -> None:
        self._helper.shutdown(timeout)

    def is_alive(self) -> bool:
        return self._helper.is_alive()

    @property
    def aio(self) -> Any:  # type: ignore[override]
        return self._helper.aio

    @property
    def peer_id(self):  # type: ignore[override]
        return self._helper.peer_id

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._helper.step(*args, **kwargs)

    def get_tensors(self):  # type: ignore[override]
        return self._helper.get_tensors()

    def get_current_state(self) -> Any:
        raise RuntimeError("the helper process serves this averager's state")

    def load_state_from_peers(self, *args: Any, **kwargs: Any) -> Any:
        return self._helper.load_state_from_peers(*args, **kwargs)

    def get_group_bits(self, wait: bool = True) -> str:
        return self._helper.get_group_bits()

    def set_group_bits(self, group_bits: str, wait: bool = True) -> None:
        self._helper.set_group_bits(group_bits)

    @property
    def bytes_sent(self) -> tuple[int, int]:  # type: ignore[override]
        return self._helper.bytes_sent

    @property
    def banned_peers(self):  # type: ignore[override]
        return self._helper.banned_peers

    @property
    def state_download_failure(self):  # type: ignore[override]
        return self._helper.state_download_failure

    @property
    def allow_state_sharing(self) -> bool:  # type: ignore[override]
        return self._helper.allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self._helper.allow_state_sharing = value

    @property
    def state_sharing_priority(self) -> float:  # type: ignore[override]
        return self._helper.state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._helper.state_sharing_priority = value
