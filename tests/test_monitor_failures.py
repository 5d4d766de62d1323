"""Recent failures and warnings in metrics records: the bounded list (pure), the warnings it
captures from real ``SwarmHealth`` objects, and real peers on loopback, one of them hostile."""

from __future__ import annotations

import logging

import pytest
from swarm_util import open_dhts
from test_monitor_metrics import raw_store, record, wait_metrics

from swarmtrain.dht import DHTRecord, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.monitor import AsyncMetricsPublisher
from swarmtrain.monitor.failures import FailureLogHandler, RecentFailures, failure_from_log_record
from swarmtrain.monitor.metrics import (
    MAX_FAILURE_MESSAGE,
    MAX_FAILURES,
    RecentFailure,
    metrics_key,
    parse_metrics,
)
from swarmtrain.monitor.publisher import add_metrics_validators
from swarmtrain.monitor.state import MonitorState
from swarmtrain.monitor.watch import refresh
from swarmtrain.optim import ClockSkewDetected
from swarmtrain.optim.swarm_health import HealthConfig, SwarmHealth

MARKUP = "<img src=x onerror=\"document.title='pwned'\"><script>alert(1)</script>"

# ---------------------------------------------------------------- pure


def test_a_record_carries_its_failures_through_its_dht_value():
    failures = (
        RecentFailure("lone_peer", "alone for 30 s", 5.0),
        RecentFailure("x_1", MARKUP, 6.0),
    )
    metrics = record(failures=failures)
    assert parse_metrics(metrics.to_dict()) == metrics
    older = metrics.to_dict()
    del older["failures"]  # a record of a version before failures
    assert parse_metrics(older) == record()


@pytest.mark.parametrize(
    "failures",
    [
        [{"kind": "lone_peer", "message": "m", "time": 1.0}] * (MAX_FAILURES + 1),
        [{"kind": "lone_peer", "message": "m" * (MAX_FAILURE_MESSAGE + 1), "time": 1.0}],
        [{"kind": "Lone-Peer", "message": "m", "time": 1.0}],
        [{"kind": "<b>", "message": "m", "time": 1.0}],
        [{"kind": "k" * 33, "message": "m", "time": 1.0}],
        [{"kind": "lone_peer", "message": "line\nbreak", "time": 1.0}],
        [{"kind": "lone_peer", "message": "\x1b[2Jterminal", "time": 1.0}],
        [{"kind": "lone_peer", "message": "m", "time": float("nan")}],
        [{"kind": "lone_peer", "message": "m", "time": 1.0, "extra": "field"}],
        [{"kind": "lone_peer", "message": b"bytes", "time": 1.0}],
        "not a list",
    ],
)
def test_oversized_or_malformed_failure_lists_are_refused(failures):
    assert parse_metrics(record().to_dict() | {"failures": failures}) is None
    with pytest.raises((ValueError, TypeError)):
        record(failures=failures if isinstance(failures, list) else [failures])


def test_recent_failures_keep_the_newest_and_cut_long_messages():
    recent = RecentFailures()
    for i in range(20):
        recent.add("lone_peer", f"warning {i}\n" + "x" * 1000, float(i))
    items = recent.items()
    assert [f.time for f in items] == [float(i) for i in range(20 - MAX_FAILURES, 20)]
    assert all(len(f.message) == MAX_FAILURE_MESSAGE and "\n" not in f.message for f in items)
    assert items[-1].message.startswith("warning 19 x") and items[-1].message.endswith("…")
    with pytest.raises(ValueError):
        recent.add("Not A Kind", "m", 1.0)


def test_warnings_of_swarm_health_and_the_tracker_are_recognised_by_run():
    captured: list[tuple[str, str]] = []
    handler = FailureLogHandler("run", lambda kind, message: captured.append((kind, message)))
    handler.install()
    try:
        health = SwarmHealth("run", HealthConfig(max_state_download_failures=1))
        health.observe_state_download(False, "no donors")
        SwarmHealth(
            "other_run", HealthConfig(max_state_download_failures=1)
        ).observe_state_download(False)
        tracker_logger = logging.getLogger("swarmtrain.optim.progress_tracker")
        tracker_logger.warning("%s: %s", "run", ClockSkewDetected(b"peer", 12.0))
        tracker_logger.warning("could not store progress of %s", "run")  # not a health kind
    finally:
        handler.uninstall()
    assert [kind for kind, _ in captured] == ["state_download_failed", "clock_skew_detected"]
    assert "no donors" in captured[0][1] and not captured[0][1].startswith("run:")
    plain = logging.LogRecord(
        "swarmtrain.optim.x", logging.WARNING, "", 0, "%s", ("run: hi",), None
    )
    assert failure_from_log_record(plain, "run") is None


def test_a_snapshot_lists_the_newest_failures_of_the_run_once():
    state = MonitorState(max_failures=5)
    full = [RecentFailure("lone_peer", "m" * MAX_FAILURE_MESSAGE, float(t)) for t in range(8)]
    state.on_metrics(
        "run",
        {b"p%d" % i: record(peer_id=f"p{i}", failures=full[i % 3 :]) for i in range(100)},
        1.0,
    )
    run = state.snapshot()["runs"]["run"]
    assert [f["time"] for f in run["failures"]] == [7.0] * 5  # the newest 5 of all peers
    assert {p["failures"] for p in run["peers"]} == {8, 7, 6}  # per peer: only a count


# ---------------------------------------------------------------- real peers


@pytest.mark.trio
async def test_a_peers_health_warnings_reach_the_monitor_and_a_hostile_list_does_not():
    """An honest peer's real ``SwarmHealth`` warning goes out with its metrics; a hostile peer
    stores, under its own id and correctly signed, a record with an oversized failure list (its
    own node knows no schema) and a record whose message is markup. Nodes that know the run's
    schema refuse the oversized one, the monitor's reader drops it wherever it is stored, and the
    markup arrives as plain text."""
    async with open_dhts(4) as (monitor_dht, honest, hostile, schema_node):
        add_metrics_validators(schema_node, "run")
        add_metrics_validators(hostile)  # its node signs its records, and knows no schema
        async with AsyncMetricsPublisher.create(honest, "run", min_interval=0.1) as publisher:
            publisher.report(loss=1.0, step=3)
            health = SwarmHealth("run", HealthConfig(max_schema_mismatches=1))
            health.observe_state_download(False, "every donor timed out")
            health.observe_state_download(False)
            health.observe_state_download(False)  # third in a row: a warning, logged
            await wait_metrics(
                monitor_dht,
                "run",
                lambda f: publisher.subkey in f and f[publisher.subkey].failures,
            )

            key, now = metrics_key("run"), get_dht_time()
            hostile_id = hostile.peer_id.to_bytes()
            markup = record(
                peer_id=hostile.peer_id.to_base58(),
                time=now,
                failures=[RecentFailure("lone_peer", MARKUP, now)],
            )
            assert await hostile.store(key, markup.to_dict(), now + 60, subkey=hostile_id)
            await wait_metrics(monitor_dht, "run", lambda f: hostile_id in f)
            state = MonitorState()
            await refresh(monitor_dht, state, "run")
            failures = state.snapshot()["runs"]["run"]["failures"]
            kinds = {(f["peer_id"], f["kind"]) for f in failures}
            assert kinds == {
                (honest.peer_id.to_base58(), "state_download_failed"),
                (hostile.peer_id.to_base58(), "lone_peer"),
            }
            (honest_failure,) = [f for f in failures if f["kind"] == "state_download_failed"]
            assert "3 state downloads" in honest_failure["message"]
            assert len(honest_failure["message"]) <= MAX_FAILURE_MESSAGE
            (text,) = [f["message"] for f in failures if f["kind"] == "lone_peer"]
            assert text == MARKUP  # plain text: the page escapes it (test_monitor_browser.py)

            bloated = record(peer_id=hostile.peer_id.to_base58(), time=now).to_dict() | {
                "failures": [{"kind": "lone_peer", "message": "x" * 4000, "time": now}] * 100
            }
            signer = hostile.node.record_validator
            signed = signer.sign_value(
                DHTRecord(serialize(key), serialize(hostile_id), serialize(bloated), now + 90)
            )
            item = StoreItem(serialize(key), serialize(hostile_id), signed, now + 90)
            assert await raw_store(hostile, [schema_node], item) == [[False]]
            assert await hostile.store(key, bloated, now + 90, subkey=hostile_id)  # elsewhere
            found = await wait_metrics(monitor_dht, "run", lambda f: hostile_id not in f)
            assert set(found) == {publisher.subkey}  # the bloated record is dropped when read
            await refresh(monitor_dht, state, "run")
            (failure,) = state.snapshot()["runs"]["run"]["failures"]
            assert failure["kind"] == "state_download_failed"  # the honest peer is still shown
