"""Waiting for state that has no event to wait on (py-libp2p's, another process's, the DHT's)."""

import time

import trio


async def wait_until(predicate) -> float:
    """Poll ``predicate`` until it holds (bound it with ``trio.fail_after``); seconds taken."""
    started = time.perf_counter()
    while not predicate():  # noqa: ASYNC110 (nothing to wait on: libp2p state)
        await trio.sleep(0.02)
    return time.perf_counter() - started


async def read_until_found(read, interval: float = 0.1):
    """Await ``read()`` until it returns something other than None, and return that (bound it
    with ``trio.fail_after``): e.g. a DHT get of a record that is still on its way."""
    while (value := await read()) is None:  # noqa: ASYNC110 (a remote record: no event)
        await trio.sleep(interval)
    return value


def wait_for(condition, timeout: float, what: str = "the condition", interval: float = 0.05):
    """Blocking: poll ``condition`` until it returns a true value, and return that value.
    :raises TimeoutError: ``what`` did not hold within ``timeout`` seconds"""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        time.sleep(interval)
