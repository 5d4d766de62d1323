"""Connect to several peers in turn without waiting for each dead one ("happy eyeballs").

A peer killed without saying goodbye leaves its offers in the DHT (a state to share, for
``declare_state_period`` seconds). Tried one after another, each such donor cost a full dial
timeout when its host is gone from the network (the SYN gets no answer): two dead donors
before a live one delayed a newcomer's state download by ~10 s.

:func:`staggered_connect` starts the attempts in order, each one ``delay`` seconds after the
one before or at once when the one before failed (RFC 8305's connection attempt delay), and
hands the peers out in the order their connections succeeded. While a peer handed out is in
use, no new attempt starts (a newcomer that downloads from its first donor does not dial every
other one); asking for the next peer means the last one is done with.

Resource handling: the attempts run in a task group owned by the ``async with``; leaving it
cancels the attempts still running (the caller's ``connect`` must be cancellable).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

import trio

from swarmtrain.utils.exception_groups import collapse_exception_groups

__all__ = ["StaggeredConnect", "staggered_connect"]

T = TypeVar("T")


class StaggeredConnect(Generic[T]):
    """The attempts of one :func:`staggered_connect`; read them with :meth:`next`."""

    def __init__(
        self,
        peers: Sequence[T],
        connect: Callable[[T], Awaitable[object]],
        delay: float,
        errors: tuple[type[BaseException], ...],
    ):
        if not (delay >= 0 and math.isfinite(delay)):
            raise ValueError(f"delay must be non-negative and finite, got {delay!r}")
        self._peers, self._connect, self._delay, self._errors = list(peers), connect, delay, errors
        self._send, self._receive = trio.open_memory_channel[tuple[T, BaseException | None]](
            len(self._peers)  # one result per peer: sending never blocks
        )
        self._remaining = len(self._peers)
        self._usable = 0  # connected peers not yet moved past by the caller
        self._holding = False  # the last peer handed out was a connected one
        self._usable_changed = trio.Event()
        self.started = 0  #: attempts started so far

    async def next(self) -> tuple[T, BaseException | None] | None:
        """The next peer whose attempt ended, with its error (None: connected), or None when
        every attempt ended. Calling it again means the peer it returned is done with."""
        if self._holding:
            self._holding = False
            self._usable -= 1
            self._usable_changed.set()
        if not self._remaining:
            return None
        self._remaining -= 1
        peer, error = await self._receive.receive()
        self._holding = error is None
        return peer, error

    async def _launch(self) -> None:
        async with trio.open_nursery() as nursery:
            for peer in self._peers:
                while self._usable:  # a connected peer is ready or in use: no more dials
                    self._usable_changed = trio.Event()
                    await self._usable_changed.wait()
                failed = trio.Event()
                self.started += 1
                nursery.start_soon(self._attempt, peer, failed)
                with trio.move_on_after(self._delay):
                    await failed.wait()

    async def _attempt(self, peer: T, failed: trio.Event) -> None:
        try:
            await self._connect(peer)
        except self._errors as e:
            failed.set()
            self._send.send_nowait((peer, e))
            return
        self._usable += 1
        self._send.send_nowait((peer, None))


@asynccontextmanager
async def staggered_connect(
    peers: Sequence[T],
    connect: Callable[[T], Awaitable[object]],
    delay: float,
    *,
    errors: tuple[type[BaseException], ...] = (Exception,),
) -> AsyncIterator[StaggeredConnect[T]]:
    """Connect to ``peers`` in turn, ``delay`` seconds apart (see the module docstring);
    ``errors``: what a failed ``connect`` raises (anything else propagates)."""
    attempts = StaggeredConnect(peers, connect, delay, errors)
    with collapse_exception_groups():  # the caller's errors come out as they went in
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempts._launch)
            try:
                yield attempts
            finally:
                nursery.cancel_scope.cancel()
