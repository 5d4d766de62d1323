"""ProgressTracker between real DHT peers (py-libp2p hosts on loopback, gossipsub, no mocks)."""

from __future__ import annotations

import threading
import time
from contextlib import AsyncExitStack

import pytest
import trio
from swarm_util import FAST_DHT, open_dhts

from swarmtrain.dht import (
    DHT,
    DHTRecord,
    Ed25519SignatureValidator,
    generate_private_key,
    get_dht_time,
    serialize,
)
from swarmtrain.optim import AsyncProgressTracker, LocalProgress, ProgressTracker
from swarmtrain.proto.progress_pb2 import ProgressRecord

# Relays and AutoNAT are useless on loopback and slow every host's start.
# DHT fetches every 0.2-0.5 s: progress travels without gossip too
QUICK_REFRESH = {
    "min_refresh_period": 0.2,
    "max_refresh_period": 0.5,
    "default_refresh_period": 0.5,
}
# DHT fetches every 10 s: within a test, only gossip can bring news
SLOW_REFRESH = {
    "min_refresh_period": 10.0,
    "max_refresh_period": 10.0,
    "default_refresh_period": 10.0,
}
MESH_TIMEOUT = 10.0


async def open_tracker(stack: AsyncExitStack, dht, prefix: str, target: int, **settings):
    return await stack.enter_async_context(ProgressTracker.create(dht, prefix, target, **settings))


async def wait_meshes(trackers: list[AsyncProgressTracker], peers: int) -> None:
    with trio.fail_after(MESH_TIMEOUT):
        for tracker in trackers:
            assert tracker.pubsub is not None
            await tracker.pubsub.wait_mesh_peers(tracker.training_progress_key, peers)


async def wait_until(predicate, within: float) -> float:
    """Poll ``predicate``; return the seconds it took. Fails after ``within`` seconds."""
    start = trio.current_time()
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 (polls several trackers at once)
            await trio.sleep(0.01)
    return trio.current_time() - start


@pytest.mark.trio
async def test_peers_reach_the_target_together_and_agree_on_the_epoch():
    async with open_dhts(3) as dhts, AsyncExitStack() as stack:
        trackers = [await open_tracker(stack, d, "together", 60, **QUICK_REFRESH) for d in dhts]
        for samples in (10, 20):
            for tracker in trackers:
                tracker.report_local_progress(0, samples)
            await trio.sleep(0.05)
        assert not any(t.global_progress.epoch for t in trackers)

        await wait_until(
            lambda: all(t.global_progress.samples_accumulated == 60 for t in trackers), 10
        )
        for tracker in trackers:
            progress = tracker.global_progress
            assert (progress.epoch, progress.num_peers, progress.num_clients) == (0, 3, 0)
            assert tracker.ready_to_update_epoch
            assert tracker.estimated_next_update_time <= get_dht_time()
            with tracker.pause_updates():
                assert tracker.update_epoch() == 1
        with trio.fail_after(10):
            for tracker in trackers:
                assert (await tracker.wait_global_epoch(1)).epoch == 1
        await wait_until(
            lambda: all(
                {p.epoch for p in t.peers().values()} == {1} and t.global_epoch == 1
                for t in trackers
            ),
            10,
        )
        for tracker in trackers:
            assert tracker.local_progress.epoch == 1
            assert tracker.global_progress.samples_accumulated == 0
            stats = tracker.statistics()
            assert stats.stores >= 1 and stats.store_failures == 0
            assert stats.num_peers_seen == 2 and stats.gossip_rejected == 0


@pytest.mark.trio
async def test_gossip_brings_an_epoch_update_long_before_the_next_dht_fetch():
    async with open_dhts(3) as dhts, AsyncExitStack() as stack:
        trackers = [await open_tracker(stack, d, "gossip", 1000, **SLOW_REFRESH) for d in dhts]
        await wait_meshes(trackers, 2)
        leader, *others = trackers
        leader.report_local_progress(0, 5)
        await wait_until(lambda: all(t.peers() for t in others), 5)
        assert all(t.global_progress.samples_accumulated == 5 for t in others)

        start = trio.current_time()
        leader.update_epoch(1)
        with trio.fail_after(2):
            for tracker in others:
                await tracker.wait_global_epoch(1)
                assert tracker.ready_to_update_epoch  # the swarm is ahead of it
        elapsed = trio.current_time() - start
        assert elapsed < 2.0
        for tracker in others:
            assert tracker.statistics().fetches == 1  # only the one at creation
            assert tracker.statistics().gossip_received >= 2


@pytest.mark.trio
async def test_departure_record_removes_the_peer():
    async with open_dhts(2) as dhts:
        async with ProgressTracker.create(dhts[0], "leave", 1000, **SLOW_REFRESH) as watcher:
            async with ProgressTracker.create(dhts[1], "leave", 1000, **SLOW_REFRESH) as peer:
                await wait_meshes([watcher, peer], 1)
                peer.report_local_progress(0, 7)
                await wait_until(lambda: len(watcher.peers()) == 1, 5)
                assert watcher.global_progress.num_peers == 1
            await wait_until(lambda: not watcher.peers(), 2)  # gossip, not the next fetch
            assert watcher.global_progress.num_peers == 0
            # and the DHT says the same to a newcomer
            async with ProgressTracker.create(dhts[1], "leave", 1000, use_pubsub=False) as new:
                assert new.peers() == {} and new.statistics().fetches == 1


@pytest.mark.trio
async def test_dht_delivers_when_a_peer_hears_no_gossip():
    async with open_dhts(3) as dhts, AsyncExitStack() as stack:
        leader = await open_tracker(stack, dhts[0], "fallback", 100, **QUICK_REFRESH)
        gossiper = await open_tracker(stack, dhts[1], "fallback", 100, **QUICK_REFRESH)
        deaf = await open_tracker(
            stack, dhts[2], "fallback", 100, use_pubsub=False, **QUICK_REFRESH
        )
        assert deaf.pubsub is None
        await wait_meshes([leader, gossiper], 1)
        leader.report_local_progress(0, 40)
        deaf.report_local_progress(0, 30)
        await wait_until(
            lambda: all(t.global_progress.samples_accumulated == 70 for t in (leader, deaf)), 5
        )
        leader.update_epoch(1)

        def sees_leader_at_1(tracker):
            record = tracker.peers().get(leader.local_public_key)
            return record is not None and record.epoch == 1

        took = await wait_until(lambda: sees_leader_at_1(deaf), 5)
        assert took < 3.0
        await wait_until(lambda: sees_leader_at_1(gossiper), 2)
        # one of the two voters is no quorum: the swarm's epoch moves when the deaf one steps
        assert deaf.global_epoch == 0
        deaf.update_epoch(1)
        await wait_until(lambda: gossiper.global_epoch == 1, 5)
        stats = deaf.statistics()
        assert stats.gossip_received == stats.gossip_sent == 0
        assert stats.fetches >= 2 and stats.stores >= 1


@pytest.mark.trio
async def test_a_third_party_cannot_overwrite_a_peers_progress():
    async with open_dhts(3) as dhts, AsyncExitStack() as stack:
        victim, observer, attacker = [
            await open_tracker(stack, d, "secure", 1000, **SLOW_REFRESH) for d in dhts
        ]
        await wait_meshes([victim, observer, attacker], 2)
        # trackers in one process are distinct owners (not the process's default key)
        assert len({t.local_public_key for t in (victim, observer, attacker)}) == 3
        victim.report_local_progress(0, 10)
        await wait_until(lambda: victim.local_public_key in observer.peers(), 5)

        key = observer.training_progress_key
        forged = LocalProgress(victim.dht.peer_id.to_bytes(), 99, 999, 1.0, get_dht_time(), False)
        expiration = get_dht_time() + 120
        # 1. through the DHT, under the victim's subkey: unsigned, so every node refuses it
        assert not await attacker.dht.store(
            key, forged.to_dict(), expiration, subkey=victim.local_public_key
        )
        # 2. a plain value standing in for the whole dictionary: refused as well
        assert not await attacker.dht.store(
            key, {victim.local_public_key: forged.to_dict()}, expiration
        )
        # 3. over gossip, signed with the attacker's own key, then moved to the victim's subkey
        signer = Ed25519SignatureValidator(generate_private_key())  # the attacker's own key
        own = DHTRecord(
            serialize(key), serialize(signer.local_public_key), serialize(forged.to_dict()), 0.0
        )
        own = DHTRecord(own.key, own.subkey, own.value, expiration)
        signed = signer.sign_value(own)
        assert signed != own.value
        assert attacker.pubsub is not None
        for subkey in (serialize(victim.local_public_key), b""):
            message = ProgressRecord(subkey=subkey, value=signed, expiration_time=expiration)
            await attacker.pubsub.publish_protobuf(key, message)
        await wait_until(lambda: observer.statistics().gossip_rejected >= 2, 5)
        assert victim.statistics().gossip_rejected >= 2

        await observer.refresh()
        for tracker in (observer, attacker):
            record = tracker.peers()[victim.local_public_key]
            assert (record.epoch, record.samples_accumulated) == (0, 10)
            assert tracker.global_epoch == 0


def test_blocking_facade_over_the_blocking_dht():
    start = time.perf_counter()
    first = DHT(**FAST_DHT)
    second = DHT(first.get_visible_maddrs(), **FAST_DHT)
    try:
        with (
            ProgressTracker(first, "blocking", 20, **QUICK_REFRESH) as a,
            ProgressTracker(second, "blocking", 20, use_pubsub=False, **QUICK_REFRESH) as b,
        ):
            a.report_local_progress(0, 12)
            b.report_local_progress(0, 8)
            deadline = time.monotonic() + 10
            while a.global_progress.samples_accumulated < 20:  # b's record, from the DHT
                assert time.monotonic() < deadline
                time.sleep(0.02)
            progress = a.wait_ready_to_update_epoch(timeout=1)
            assert progress.samples_accumulated == 20 and a.ready_to_update_epoch
            with a.pause_updates():
                assert a.update_epoch() == 1
            deadline = time.monotonic() + 10
            while getattr(b.peers().get(a.local_public_key), "epoch", 0) != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # a alone is no quorum of two, but its 12 samples still count: b is ready
            assert b.local_progress.epoch == 0 and b.ready_to_update_epoch
            assert b.refresh().epoch == 0
            b.update_epoch()
            assert b.wait_global_epoch(1, timeout=10).epoch == 1
            with pytest.raises(TimeoutError):
                b.wait_global_epoch(5, timeout=0.1)
            assert a.statistics().stores >= 1
        with pytest.raises(RuntimeError):
            a.report_local_progress(1, 1)
    finally:
        second.shutdown()
        first.shutdown()
    assert time.perf_counter() - start < 30


def test_blocking_reports_do_not_wait_for_a_busy_loop():
    """A training step reports progress from its own thread: while the background loop is
    busy (here: blocked outright), the report returns at once, the local view is current, and
    the record goes out once the loop is free."""
    first = DHT(**FAST_DHT)
    second = DHT(first.get_visible_maddrs(), **FAST_DHT)
    try:
        with (
            ProgressTracker(first, "busy", 100, **QUICK_REFRESH) as a,
            ProgressTracker(second, "busy", 100, **QUICK_REFRESH) as b,
        ):
            runtime, _ = a._running()
            started, released = threading.Event(), threading.Event()

            def block_the_loop() -> None:
                started.set()
                released.wait(10)

            blocker = threading.Thread(target=runtime.call_sync, args=(block_the_loop,))
            blocker.start()
            try:
                assert started.wait(10)
                for samples in range(1, 21):
                    a.report_local_progress(0, samples)
                assert a.local_progress.samples_accumulated == 20
                assert a.global_progress.samples_accumulated == 20
                with a.pause_updates():
                    assert a.update_epoch() == 1
                assert a.global_epoch == 1 and a.local_progress.epoch == 1
                assert blocker.is_alive()  # all of the above ran while the loop was blocked
            finally:
                released.set()
                blocker.join(10)
            assert b.wait_global_epoch(1, timeout=10).epoch == 1  # published afterwards
    finally:
        second.shutdown()
        first.shutdown()


def test_a_report_just_before_leaving_does_not_outlive_the_departure():
    """A trainer's last step reports, and its shutdown follows at once: the departure must be
    the record the swarm keeps (a store of the last report after it announced this peer, at
    its last epoch, for metadata_expiration seconds after it left)."""
    other = DHT(**FAST_DHT)
    dht = DHT(other.get_visible_maddrs(), **FAST_DHT)
    try:
        for attempt in range(6):  # the store of the last report raced the departure
            prefix = f"last_report{attempt}"
            tracker = ProgressTracker(dht, prefix, 1000, **SLOW_REFRESH)
            tracker.report_local_progress(0, 7)  # its store starts
            time.sleep(0.005 * attempt)
            tracker.report_local_progress(3, 9)  # the last step: stored once the first is done
            tracker.shutdown()
            found = other.get(f"{prefix}_progress", latest=True)
            assert found is not None and len(found.value) == 1, found
            assert [item.value for item in found.value.values()] == [None], found
    finally:
        dht.shutdown()
        other.shutdown()
