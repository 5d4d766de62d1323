"""Real-peer fixtures shared by the averager test modules: a few connected DHTs on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

from swarmtrain.dht import DHT
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {"min_matchmaking_time": 1.0, "request_timeout": 0.5}
#: DHT settings for tests on loopback: no relay or AutoNAT, short waits and bans
FAST_DHT = {**HOST, "wait_timeout": 2.0, "blacklist_time": 1.0}


def group_of(size: int) -> dict:
    return {**FAST, "target_group_size": size, "min_group_size": size}


@contextlib.contextmanager
def swarm(size: int) -> Iterator[tuple[list[DHT], list]]:
    """``size`` connected DHTs and a list for averagers; everything is shut down on exit."""
    dhts = [DHT(**HOST)]
    averagers: list = []
    try:
        for _ in range(size - 1):
            dhts.append(DHT(dhts[0].get_visible_maddrs(), **HOST))
        yield dhts, averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
    assert BackgroundRuntime.active_references() == 0


@contextlib.asynccontextmanager
async def open_dhts(count: int) -> AsyncIterator[list[DHT]]:
    """``count`` trio DHTs on loopback, the others bootstrapped from the first."""
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(DHT.create(**FAST_DHT))
        dhts = [first]
        for _ in range(count - 1):
            dhts.append(
                await stack.enter_async_context(DHT.create(first.get_visible_maddrs(), **FAST_DHT))
            )
        yield dhts
