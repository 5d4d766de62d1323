"""Waiting for state py-libp2p has no event for."""

import time

import trio


async def wait_until(predicate) -> float:
    """Poll ``predicate`` until it holds (bound it with ``trio.fail_after``); seconds taken."""
    started = time.perf_counter()
    while not predicate():  # noqa: ASYNC110 (nothing to wait on: libp2p state)
        await trio.sleep(0.02)
    return time.perf_counter() - started
