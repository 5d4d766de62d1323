"""``ChangeSignal``: wake the tasks that wait for "something changed", from any thread."""

from __future__ import annotations

import threading

import trio


class ChangeSignal:
    """A trio event that is re-armed at every change: ``await signal.wait()`` returns at the
    next ``notify()``. ``notify_threadsafe()`` may be called from any thread (a trainer's),
    and runs ``notify`` on the loop soon. Build it on the loop that waits."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()

    def current(self) -> trio.Event:
        """The event the next change sets: take it *before* looking at the state, then wait on
        it, so a change in between is not missed."""
        return self._event

    async def wait(self) -> None:
        await self._event.wait()

    def notify(self) -> None:
        """Wake every waiter (loop thread only)."""
        self._event.set()
        self._event = trio.Event()

    def notify_threadsafe(self) -> None:
        """:meth:`notify` from any thread; from outside the loop it runs there soon."""
        if threading.get_ident() == self._loop_thread:
            self.notify()
            return
        try:
            self._token.run_sync_soon(self.notify)
        except trio.RunFinishedError:
            pass  # the loop is gone: nobody waits for the change
