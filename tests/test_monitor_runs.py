"""The run directory between real DHT peers, and ``swarmtrain runs`` as a separate process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import trio
from swarm_util import FAST_DHT, open_dhts

from swarmtrain.cli.runs import describe
from swarmtrain.dht import DHT, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.monitor.runs import (
    RUNS_KEY,
    AsyncRunAnnouncer,
    RunAnnouncement,
    add_runs_validators,
    announce_run,
    list_runs,
)
from swarmtrain.monitor.state import MonitorState

ALBERT = RunAnnouncement(
    run_id="albert",
    name="ALBERT-large on wikitext",
    description="a volunteer run",
    model="albert-large-v2",
    initial_peers=("/ip4/1.2.3.4/tcp/31337/p2p/QmBootstrap",),
    command="python run_trainer.py --run_id albert --initial_peers /ip4/1.2.3.4/tcp/31337",
    requirements="1 GPU with 8 GB",
)


async def wait_runs(dht, predicate) -> list[RunAnnouncement]:
    with trio.fail_after(15):
        while True:
            runs = await list_runs(dht)
            if predicate(runs):
                return runs
            await trio.sleep(0.05)


@pytest.mark.parametrize(
    "changes",
    [
        {"run_id": ""},
        {"run_id": "x" * 65},
        {"description": "x" * 1025},
        {"initial_peers": tuple(f"/ip4/1.2.3.4/tcp/{p}" for p in range(9))},
    ],
)
def test_oversized_announcements_are_rejected(changes):
    with pytest.raises(ValueError):
        RunAnnouncement(**(ALBERT.to_dict() | changes))


@pytest.mark.trio
async def test_runs_announce_themselves_and_readers_list_them():
    async with open_dhts(3) as (reader, organiser, other):
        async with AsyncRunAnnouncer.create(organiser, ALBERT, expiration=60):
            await announce_run(other, RunAnnouncement(run_id="gpt", private=True))
            runs = await wait_runs(reader, lambda r: {run.run_id for run in r} == {"albert", "gpt"})
            albert = next(run for run in runs if run.run_id == "albert")
            assert albert.model == ALBERT.model and albert.initial_peers == ALBERT.initial_peers
            assert albert.announcer == organiser.peer_id.to_base58()
            assert abs(albert.time - get_dht_time()) < 15
            assert next(run for run in runs if run.run_id == "gpt").private


@pytest.mark.trio
async def test_nobody_can_rewrite_or_withdraw_another_peers_announcement():
    async with open_dhts(3) as (reader, organiser, outsider):
        await announce_run(organiser, ALBERT)
        (albert,) = await wait_runs(reader, lambda r: len(r) == 1)
        assert albert.announcer == organiser.peer_id.to_base58()
        hijacked = ALBERT.to_dict() | {"initial_peers": ["/ip4/6.6.6.6/tcp/1"], "time": 1.0}
        subkey, now = organiser.peer_id.to_bytes(), get_dht_time()
        # the outsider's node knows the run directory too: it cannot sign for the organiser
        add_runs_validators(outsider)
        assert not await outsider.store(RUNS_KEY, hijacked, now + 60, subkey=subkey)
        assert not await outsider.store(RUNS_KEY, None, now + 60, subkey=subkey)
        assert not await outsider.store(RUNS_KEY, hijacked, now + 60)  # a plain value
        # raw store RPCs (no validator of the outsider's node involved): refused too
        item = StoreItem(serialize(RUNS_KEY), serialize(subkey), serialize(hijacked), now + 60)
        for node in (reader, organiser):
            assert await outsider.node.protocol.call_store(node.peer_id, [item]) == [False]
        (still,) = await list_runs(reader)
        assert still.initial_peers == ALBERT.initial_peers and still.announcer == albert.announcer


@pytest.mark.trio
async def test_an_impostor_announcing_the_same_run_id_is_told_apart():
    """Anyone may announce a ``run_id``, but only under its own peer id: readers see two
    announcers, and a monitor keeps the details of the one it saw first."""
    async with open_dhts(3) as (reader, organiser, impostor):
        own = dataclasses.replace(
            ALBERT, initial_peers=(f"/ip4/1.2.3.4/tcp/31337/p2p/{organiser.peer_id}",)
        )
        await announce_run(organiser, own)
        state = MonitorState()
        state.on_runs(await wait_runs(reader, lambda r: len(r) == 1))
        fake = dataclasses.replace(ALBERT, initial_peers=("/ip4/6.6.6.6/tcp/1",))
        await announce_run(impostor, fake)
        runs = await wait_runs(reader, lambda r: len(r) == 2)
        by = {run.announcer: run for run in runs}
        assert set(by) == {organiser.peer_id.to_base58(), impostor.peer_id.to_base58()}
        assert by[organiser.peer_id.to_base58()].announced_by_initial_peer
        assert not by[impostor.peer_id.to_base58()].announced_by_initial_peer
        state.on_runs(runs)  # the impostor's is newer; the monitor keeps the organiser's
        shown = state.snapshot()["runs"]["albert"]["announcement"]
        assert shown["announcer"] == organiser.peer_id.to_base58()
        assert shown["initial_peers"] == list(own.initial_peers)
        lines = describe(by[impostor.peer_id.to_base58()], get_dht_time(), announcers=2)
        assert f"  announced by peer {impostor.peer_id} (not an initial peer)" in lines
        assert any("2 peers announce run_id 'albert'" in line for line in lines)


def test_the_runs_command_lists_announced_runs():
    organiser = DHT(**FAST_DHT)
    try:
        organiser.run_coroutine(lambda dht, _: announce_run(dht, ALBERT))
        (address,) = [a for a in organiser.get_visible_maddrs() if "/ip4/127.0.0.1/" in a][:1]
        result = subprocess.run(
            [sys.executable, "-m", "swarmtrain.cli.main", "runs", "--initial_peers", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "albert (ALBERT-large on wikitext)" in result.stdout
        assert f"join with: {ALBERT.command}" in result.stdout
        assert "requirements: 1 GPU with 8 GB" in result.stdout
        assert f"announced by peer {organiser.peer_id} (not an initial peer)" in result.stdout
    finally:
        organiser.shutdown()


def test_the_runs_command_says_when_there_are_none():
    node = DHT(**FAST_DHT)
    try:
        address = node.get_visible_maddrs()[0]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "swarmtrain.cli.main", "runs", "--initial-peers", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == "no runs announced"
        assert time.monotonic() - started < 60
    finally:
        node.shutdown()
