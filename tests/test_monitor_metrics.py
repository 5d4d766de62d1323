"""Metrics records (pure) and their publication between real DHT peers (loopback libp2p)."""

from __future__ import annotations

import math
import time

import pytest
import trio
from swarm_util import FAST_DHT, open_dhts

from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.monitor import AsyncMetricsPublisher, LocalMetrics, MetricsPublisher, read_metrics
from swarmtrain.monitor.metrics import PublishSchedule, metrics_key, parse_metrics
from swarmtrain.monitor.publisher import add_metrics_validators


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
                lambda f: (
                    f.get(pub_a.local_public_key, record()).step == 2
                    and pub_b.local_public_key in f
                ),
            )
            mine = found[pub_a.local_public_key]
            assert (mine.loss, mine.epoch, mine.samples_per_second) == (1.0, 0, 10.0)
            assert mine.peer_id == a.peer_id.to_base58() and mine.role == "node"
            assert abs(mine.time - get_dht_time()) < 15
            theirs = found[pub_b.local_public_key]
            assert (theirs.loss, theirs.role, theirs.extra) == (3.0, "aux", {"acc": 0.25})
            assert pub_a.statistics().reports == 2


@pytest.mark.trio
async def test_an_outsider_cannot_overwrite_a_peers_metrics():
    async with open_dhts(3) as (reader, victim, outsider):
        async with AsyncMetricsPublisher.create(victim, "run", min_interval=0.2) as publisher:
            publisher.report(loss=1.0, step=7)
            await wait_metrics(reader, "run", lambda f: publisher.local_public_key in f)
            forged = record(peer_id=victim.peer_id.to_base58(), loss=99.0, step=8).to_dict()
            forged["time"] = get_dht_time()
            # the outsider's node cannot sign for the victim's key: every node rejects it
            stored = await outsider.store(
                metrics_key("run"), forged, get_dht_time() + 60, subkey=publisher.local_public_key
            )
            assert not stored
            # nor can it put unsigned records beside the peers' (no owner marker)
            stored = await outsider.store(
                metrics_key("run"), forged, get_dht_time() + 60, subkey=b"plain"
            )
            found = await read_metrics(reader, "run")
            assert set(found) == {publisher.local_public_key}
            assert (
                found[publisher.local_public_key].loss,
                found[publisher.local_public_key].step,
            ) == (
                1.0,
                7,
            )


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
            found = await wait_metrics(reader, "run", lambda f: publisher.local_public_key in f)
            # a correctly signed record with a NaN loss: the schema stops it on every node
            bad = record(peer_id=peer.peer_id.to_base58()).to_dict() | {"loss": math.nan}
            assert not await peer.store(
                metrics_key("run"), bad, get_dht_time() + 60, subkey=publisher.local_public_key
            )
            found = await read_metrics(reader, "run")
            assert found[publisher.local_public_key].loss == 1.0


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
