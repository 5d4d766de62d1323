"""Metrics records (pure) and their publication between real DHT peers (loopback libp2p)."""

from __future__ import annotations

import math
import time

import pytest
import trio
from swarm_util import FAST_DHT, open_dhts

from swarmtrain.dht import DHT, DHTRecord, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.monitor import AsyncMetricsPublisher, LocalMetrics, MetricsPublisher, read_metrics
from swarmtrain.monitor.metrics import PublishSchedule, metrics_key, parse_metrics
from swarmtrain.monitor.publisher import add_metrics_validators
from swarmtrain.monitor.state import MonitorState
from swarmtrain.monitor.watch import refresh


def record(**changes) -> LocalMetrics:
    return LocalMetrics(**({"peer_id": "QmPeer", "time": 100.0} | changes))


# ---------------------------------------------------------------- pure


def test_record_round_trips_through_its_dht_value():
    metrics = record(loss=1.5, step=3, epoch=2, samples_per_second=40.0, extra={"acc": 0.5})
    assert parse_metrics(metrics.to_dict()) == metrics


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"loss": math.nan}, ValueError),
        ({"loss": math.inf}, ValueError),
        ({"loss": 1e300}, ValueError),
        ({"samples_per_second": -1.0}, ValueError),
        ({"step": -1}, ValueError),
        ({"step": 1.0}, TypeError),
        ({"loss": "low"}, TypeError),
        ({"role": "boss"}, ValueError),
        ({"reachability": "maybe"}, ValueError),
        ({"version": "x" * 65}, ValueError),
        ({"extra": {f"m{i}": 1.0 for i in range(17)}}, ValueError),
        ({"extra": {"acc": math.nan}}, ValueError),
    ],
)
def test_bad_values_are_rejected(changes, error):
    with pytest.raises(error):
        record(**changes)
    value = record().to_dict() | changes
    assert parse_metrics(value) is None  # the DHT schema rejects the same values


def test_schema_rejects_coercion_and_unknown_fields():
    assert parse_metrics(record().to_dict() | {"step": "3"}) is None
    assert parse_metrics(record().to_dict() | {"secret": 1}) is None
    assert parse_metrics("not a dict") is None


def test_schedule_stores_the_latest_report_at_most_once_per_interval():
    schedule = PublishSchedule(min_interval=5.0, refresh_interval=30.0)
    assert schedule.take(0.0) is None and schedule.next_store_time() == math.inf
    schedule.offer(record(step=1))
    first = schedule.take(0.0)
    assert first is not None and first.step == 1 and first.time == 0.0
    for step in range(2, 100):
        schedule.offer(record(step=step))
        assert schedule.take(step * 0.01) is None
    assert schedule.next_store_time() == 5.0
    latest = schedule.take(5.0)
    assert latest is not None and latest.step == 99
    # nothing new: the record is refreshed before it expires
    assert schedule.take(34.9) is None
    refreshed = schedule.take(35.0)
    assert refreshed is not None and refreshed.step == 99 and refreshed.time == 35.0


def test_schedule_rejects_bad_intervals():
    with pytest.raises(ValueError):
        PublishSchedule(0.0, 1.0)
    with pytest.raises(ValueError):
        PublishSchedule(5.0, 1.0)
    with pytest.raises(ValueError):
        metrics_key("")


# ---------------------------------------------------------------- real peers


async def wait_metrics(dht, run_id: str, predicate) -> dict:
    with trio.fail_after(15):
        while True:
            found = await read_metrics(dht, run_id)
            if predicate(found):
                return found
            await trio.sleep(0.05)


@pytest.mark.trio
async def test_peers_publish_and_a_reader_sees_the_latest_of_each():
    async with open_dhts(3) as (reader, a, b):
        async with (
            AsyncMetricsPublisher.create(a, "run", min_interval=0.2) as pub_a,
            AsyncMetricsPublisher.create(b, "run", min_interval=0.2, role="aux") as pub_b,
        ):
            pub_a.report(loss=2.0, step=1, epoch=0, samples_per_second=10.0)
            pub_b.report(loss=3.0, step=5, extra={"acc": 0.25})
            pub_a.report(loss=1.0, step=2)
            found = await wait_metrics(
                reader,
                "run",
                lambda f: f.get(pub_a.subkey, record()).step == 2 and pub_b.subkey in f,
            )
            mine = found[pub_a.subkey]
            assert (mine.loss, mine.epoch, mine.samples_per_second) == (1.0, 0, 10.0)
            assert mine.peer_id == a.peer_id.to_base58() and mine.role == "node"
            assert abs(mine.time - get_dht_time()) < 15
            theirs = found[pub_b.subkey]
            assert (theirs.loss, theirs.role, theirs.extra) == (3.0, "aux", {"acc": 0.25})
            assert pub_a.statistics().reports == 2


async def raw_store(attacker, victims, item: StoreItem) -> list:
    """``item`` sent as is (no validator of the attacker's node involved) to every victim."""
    return [await attacker.node.protocol.call_store(v.peer_id, [item]) for v in victims]


@pytest.mark.trio
async def test_a_peer_cannot_publish_metrics_under_another_peers_id():
    """Issue 21: metrics records are bound to peer ids. The attacker is a publishing peer of
    the run (its node knows the metrics key); the monitor's view of the victim stays as the
    victim published it, and the victim's later reports still reach the monitor."""
    async with open_dhts(3) as (monitor_dht, victim, attacker):
        state = MonitorState()
        async with (
            AsyncMetricsPublisher.create(victim, "run", min_interval=0.2) as publisher,
            AsyncMetricsPublisher.create(attacker, "run", min_interval=0.2) as own,
        ):
            publisher.report(loss=1.0, step=7)
            own.report(loss=5.0, step=1)
            await wait_metrics(
                monitor_dht, "run", lambda f: {publisher.subkey, own.subkey} <= set(f)
            )
            key, now = metrics_key("run"), get_dht_time()
            forged = record(peer_id=victim.peer_id.to_base58(), loss=99.0, step=8, time=now)
            victim_id = victim.peer_id.to_bytes()
            # through its own node: unsigned under the victim's id (its node cannot sign it)
            assert not await attacker.store(key, forged.to_dict(), now + 60, subkey=victim_id)
            # nor a plain value over everybody's records, nor a record under a made-up id
            assert not await attacker.store(key, forged.to_dict(), now + 60)
            assert not await attacker.store(key, forged.to_dict(), now + 60, subkey=b"plain")
            # raw store RPCs to the honest nodes: unsigned, and signed by the attacker's key
            unsigned = StoreItem(
                serialize(key), serialize(victim_id), serialize(forged.to_dict()), now + 60
            )
            signer = attacker.node.record_validator
            mine = DHTRecord(
                serialize(key),
                serialize(attacker.peer_id.to_bytes()),
                serialize(forged.to_dict()),
                now + 60,
            )
            moved = StoreItem(
                serialize(key), serialize(victim_id), signer.sign_value(mine), now + 60
            )
            honest = [monitor_dht, victim]
            assert await raw_store(attacker, honest, unsigned) == [[False], [False]]
            assert await raw_store(attacker, honest, moved) == [[False], [False]]
            # under its own id, a record that claims to be the victim's: stored, dropped by readers
            assert await attacker.store(key, forged.to_dict(), now + 60, subkey=own.subkey)
            found = await read_metrics(monitor_dht, "run")
            assert set(found) == {victim_id}
            assert (found[victim_id].loss, found[victim_id].step) == (1.0, 7)
            await refresh(monitor_dht, state, "run")
            (peer,) = state.snapshot()["runs"]["run"]["peers"]
            assert (peer["peer_id"], peer["loss"], peer["step"]) == (
                victim.peer_id.to_base58(),
                1.0,
                7,
            )
            # the victim keeps publishing
            publisher.report(loss=0.5, step=8)
            found = await wait_metrics(
                monitor_dht, "run", lambda f: victim_id in f and f[victim_id].step == 8
            )
            assert found[victim_id].loss == 0.5


@pytest.mark.trio
async def test_bad_values_are_refused_locally_and_by_other_nodes():
    async with open_dhts(3) as (reader, peer, bystander):
        add_metrics_validators(reader, "run")  # nodes that know the run enforce its schema
        async with (
            AsyncMetricsPublisher.create(peer, "run", min_interval=0.2) as publisher,
            AsyncMetricsPublisher.create(bystander, "run", min_interval=0.2),
        ):
            publisher.report(loss=1.0)
            with pytest.raises(ValueError):
                publisher.report(loss=math.nan, step=3)
            assert publisher.statistics().reports == 1
            found = await wait_metrics(reader, "run", lambda f: publisher.subkey in f)
            # a correctly signed record with a NaN loss: the schema stops it on every node
            bad = record(peer_id=peer.peer_id.to_base58()).to_dict() | {"loss": math.nan}
            assert not await peer.store(
                metrics_key("run"), bad, get_dht_time() + 60, subkey=publisher.subkey
            )
            found = await read_metrics(reader, "run")
            assert found[publisher.subkey].loss == 1.0


@pytest.mark.trio
async def test_reports_every_few_milliseconds_store_at_most_once_per_interval():
    async with open_dhts(2) as (_, peer):
        async with AsyncMetricsPublisher.create(peer, "run", min_interval=1.0) as publisher:
            started = trio.current_time()
            step = 0
            while trio.current_time() - started < 2.5:
                step += 1
                publisher.report(loss=1.0 / step, step=step)
                await trio.sleep(0.01)
            elapsed = trio.current_time() - started
            stats = publisher.statistics()
            assert stats.reports == step
            assert 1 <= stats.stores + stats.store_failures <= math.floor(elapsed / 1.0) + 1


def test_blocking_publisher_from_a_training_thread():
    first = DHT(**FAST_DHT)
    peer = DHT(first.get_visible_maddrs(), **FAST_DHT)
    try:
        with MetricsPublisher(peer, "run", min_interval=0.2) as publisher:
            publisher.report(loss=0.5, step=1, samples_per_second=3.0)
            until = time.monotonic() + 15
            found = {}
            while time.monotonic() < until:
                found = first.run_coroutine(lambda dht, _: read_metrics(dht, "run"))
                if found:
                    break
                time.sleep(0.05)
            assert [m.loss for m in found.values()] == [0.5]
    finally:
        peer.shutdown()
        first.shutdown()
