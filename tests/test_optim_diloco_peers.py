"""``RunPresence``: who is in a DiLoCo run; a donor that died without saying goodbye (SIGKILL,
a lost host) is not counted as present once a dial to it failed; records are owned per peer
(issue 17.3): an outsider cannot mark a peer gone or wipe the run; the record is kept alive by
a task (no thread) and a declared step reaches the others at once.

Real trio DHTs over loopback, in one trio run. The dead donor stored its presence record and
left without its goodbye record; its port then drops every SYN (a host gone from the network:
each dial hangs).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest
import trio
from dead_hosts import silent_port
from swarm_util import FAST_DHT, open_dhts

from swarmtrain.dht import DHT, PeerRecordValidator, get_dht_time
from swarmtrain.optim.diloco_peers import PRESENCE_KEY_PATTERN, RunPresence, presence_key


async def wait_until(predicate, seconds: float) -> None:
    """Await ``predicate()`` (async: a DHT read) until it is true, at most ``seconds``."""
    with trio.fail_after(seconds):
        while not await predicate():  # noqa: ASYNC110 (nothing to wait on: DHT records)
            await trio.sleep(0.05)


@pytest.mark.trio
async def test_a_dead_donor_is_not_present_after_one_failed_dial():
    traps: list = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            bootstrap = await stack.enter_async_context(DHT.create(**FAST_DHT))
            maddrs = bootstrap.get_visible_maddrs()
            live, observer = [
                await stack.enter_async_context(DHT.create(maddrs, **FAST_DHT)) for _ in range(2)
            ]
            await stack.enter_async_context(RunPresence.create(live, "presence_run", donor=True))
            async with DHT.create(maddrs, **FAST_DHT) as ghost:
                # killed: its record stays, with no refresh and no goodbye record
                ghost.add_validators([PeerRecordValidator([PRESENCE_KEY_PATTERN])])
                assert await ghost.store(
                    presence_key("presence_run"),
                    {"donor": True},
                    get_dht_time() + 30,
                    subkey=ghost.peer_id.to_bytes(),
                )
                ghost_id = ghost.peer_id
                ghost_addrs = [re.sub(r"/p2p/.*$", "", str(a)) for a in ghost.get_visible_maddrs()]
            for addr in ghost_addrs:
                traps += silent_port(int(re.search(r"/tcp/(\d+)", addr).group(1)))
            observer.p2p.add_addrs(ghost_id, ghost_addrs)  # as the DHT taught it while it lived
            presence = await stack.enter_async_context(
                RunPresence.create(observer, "presence_run", donor=True, probe_timeout=2.0)
            )
            started = time.monotonic()
            present = {p.peer_id for p in await presence.others()}
            took = time.monotonic() - started
            assert present == {live.peer_id.to_bytes()}, present  # before: the ghost too
            assert took < 2.0 + 3.0, took  # probe_timeout, and the DHT read
            assert {p.peer_id for p in await presence.others()} == present  # no new dial
    finally:
        for sock in traps:
            sock.close()


@pytest.mark.trio
async def test_an_outsider_cannot_mark_a_peer_gone_or_wipe_the_run():
    async with open_dhts(3) as (first, second, evil):
        async with (
            RunPresence.create(first, "run", donor=True) as one,
            RunPresence.create(second, "run", donor=True) as two,
        ):
            key, target = presence_key("run"), first.peer_id.to_bytes()
            assert [p.peer_id for p in await two.others()] == [target]

            # "first left" under first's subkey, and a plain value over everyone, "forever"
            far = get_dht_time() + 10**9
            evil.add_validators([PeerRecordValidator([PRESENCE_KEY_PATTERN])])
            assert not await evil.store(key, None, far, subkey=target)
            assert not await evil.store(key, "gone", far)

            assert [p.peer_id for p in await two.others()] == [target]
            assert [p.peer_id for p in await one.others()] == [second.peer_id.to_bytes()]


@pytest.mark.trio
async def test_a_declared_step_reaches_the_other_peers_and_leaving_says_goodbye():
    threads_before = threading.active_count()
    async with open_dhts(2) as (first, second):
        async with RunPresence.create(second, "run", donor=True) as observer:
            async with RunPresence.create(first, "run", donor=True) as declaring:
                assert threading.active_count() == threads_before  # a task, not a thread
                assert [p.step for p in await observer.others()] == [None]  # no round yet
                declaring.declare_step(42)  # stored by the refresh task, at once

                async def step_42() -> bool:
                    return [p.step for p in await observer.others()] == [42]

                await wait_until(step_42, 10)

            async def nobody() -> bool:
                return await observer.others() == []

            await wait_until(nobody, 10)  # the goodbye record


@pytest.mark.trio
async def test_the_record_is_refreshed_before_it_expires():
    async with open_dhts(2) as (first, second):
        async with (
            RunPresence.create(second, "run", donor=True) as observer,
            RunPresence.create(first, "run", donor=True, ttl=1.5),
        ):
            deadline = time.monotonic() + 4.0  # over two ttls: only refreshes keep it alive
            while time.monotonic() < deadline:
                assert [p.peer_id for p in await observer.others()] == [first.peer_id.to_bytes()]
                await trio.sleep(0.25)
