"""SwarmHealth: each warning from observations with an injected clock, and the schema-mismatch
reason of a real averaging round between two peers with different tensors."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarmtrain.averaging import (
    AveragingError,
    DecentralizedAverager,
    FailureReason,
    MatchmakingError,
)
from swarmtrain.dht import DHT
from swarmtrain.optim.swarm_health import (
    HealthConfig,
    SwarmHealth,
    describe_parameters,
    model_fingerprint,
)
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {"min_matchmaking_time": 1.0, "request_timeout": 0.5}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_health(**config) -> tuple[SwarmHealth, Clock]:
    clock = Clock()
    return SwarmHealth("run", HealthConfig(**config), clock=clock, log=False), clock


def kinds(warnings) -> list[str]:
    return [w.kind for w in warnings]


def progress(health, *, epoch=0, samples=0, target=100, peers=3, eta=None):
    return health.observe_progress(
        global_epoch=epoch,
        samples_accumulated=samples,
        target_batch_size=target,
        num_peers=peers,
        eta=eta,
    )


def test_target_not_reached_after_stall_factor_times_the_expected_epoch():
    health, clock = make_health(stall_factor=3.0, min_stall_time=10.0, repeat_interval=100.0)
    assert progress(health, samples=0, eta=20.0) == []  # expected epoch: 20 s
    for t, samples in ((30, 40), (59, 60)):
        clock.now = 1000.0 + t
        assert progress(health, samples=samples, eta=5.0) == []
    clock.now = 1060.0  # 3 x 20 s
    (warning,) = progress(health, samples=61)
    assert warning.kind == "target_not_reached"
    assert "61 of target_batch_size=100" in str(warning) and "expected to take 20 s" in str(warning)
    assert "same run_id and target_batch_size" in str(warning)
    clock.now = 1100.0  # at most once per repeat_interval
    assert progress(health, samples=62) == []
    clock.now = 1161.0
    assert kinds(progress(health, samples=63)) == ["target_not_reached"]
    # a new epoch starts the count again
    clock.now = 1162.0
    assert progress(health, epoch=1, samples=0, eta=20.0) == []
    clock.now = 1200.0
    assert progress(health, epoch=1, samples=50) == []


def test_target_not_reached_when_samples_are_stuck_without_an_eta():
    health, clock = make_health(stuck_time=30.0)
    assert progress(health, samples=10) == []
    clock.now += 29
    assert progress(health, samples=10) == []
    clock.now += 1
    (warning,) = progress(health, samples=10)
    assert "unchanged for 30 s" in str(warning)
    health, clock = make_health(stuck_time=30.0)
    for _ in range(5):  # samples keep growing: no warning
        clock.now += 20
        assert progress(health, samples=int(clock.now) % 97) == []


def test_lone_peer():
    health, clock = make_health(lone_peer_timeout=30.0, repeat_interval=1000.0)
    assert progress(health, peers=1) == []
    clock.now += 29
    assert progress(health, peers=1, samples=1) == []
    clock.now += 1
    (warning,) = progress(health, peers=1, samples=2)
    assert warning.kind == "lone_peer" and "initial_peers" in str(warning)
    assert "30 s" in str(warning)
    clock.now += 1  # company arrives, then leaves: the timer starts again, the limit holds
    assert progress(health, peers=2, samples=3) == []
    assert progress(health, peers=1, samples=4) == []
    clock.now += 60
    assert progress(health, peers=1, samples=5) == []  # repeat_interval not over


def test_clock_skew():
    health, _ = make_health(max_clock_skew=10.0)
    assert health.observe_peer_time("A", 1_000_009.0, 1_000_000.0) == []
    # an old DHT record says nothing about clocks (max_age=inf); a fresh one does
    assert health.observe_peer_time("B", 999_000.0, 1_000_000.0) == []
    (warning,) = health.observe_peer_time("C", 999_980.0, 1_000_000.0, max_age=0.5)
    assert warning.kind == "clock_skew" and "19.5 s behind ours" in str(warning)
    assert "NTP" in str(warning)
    health, _ = make_health(max_clock_skew=10.0)
    (warning,) = health.observe_peer_time("D", 1_000_030.0, 1_000_000.0)
    assert "peer D's clock is 30.0 s ahead of ours" in str(warning)


def test_model_mismatch_needs_repeated_schema_mismatches():
    model = torch.nn.Linear(3, 2)
    clock = Clock()
    health = SwarmHealth(
        "run", HealthConfig(max_schema_mismatches=2), parameters=model, clock=clock, log=False
    )
    mismatch = MatchmakingError(FailureReason.SCHEMA_MISMATCH, "1 peer(s) average another schema")
    assert health.observe_averaging_failure(MatchmakingError(FailureReason.DEADLINE, "x")) == []
    assert health.observe_averaging_failure(AveragingError("all-reduce failed")) == []
    assert health.observe_averaging_failure(mismatch) == []
    health.observe_averaging_success()  # a group formed: the count starts over
    assert health.observe_averaging_failure(mismatch) == []
    (warning,) = health.observe_averaging_failure(mismatch)
    assert warning.kind == "model_mismatch"
    assert model_fingerprint(model) in str(warning) and "same model" in str(warning)


def test_repeated_state_download_failures(caplog):
    clock = Clock()
    health = SwarmHealth("run", HealthConfig(max_state_download_failures=2), clock=clock)
    with caplog.at_level(logging.WARNING, logger="swarmtrain.optim.swarm_health"):
        assert health.observe_state_download(False, "no donors") == []
        assert health.observe_state_download(True) == []
        assert health.observe_state_download(False, "timeout") == []
        (warning,) = health.observe_state_download(False, "timeout")
    assert warning.kind == "state_download_failed" and "(last: timeout)" in str(warning)
    assert "load_state_timeout" in str(warning)
    assert [r.getMessage() for r in caplog.records] == [str(warning)]  # logged once
    assert health.given == [warning]


def test_fingerprint_and_config_errors():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert model_fingerprint(a) == model_fingerprint(b) == model_fingerprint(b.named_parameters())
    assert model_fingerprint(a) != model_fingerprint(torch.nn.Linear(2, 3))
    assert model_fingerprint(a) != model_fingerprint(a.double())
    assert describe_parameters(a).startswith("2 tensors, 8 values, fingerprint ")
    with pytest.raises(TypeError, match="parameters"):
        model_fingerprint([torch.ones(1), "x"])
    with pytest.raises(ValueError, match="stall_factor"):
        HealthConfig(stall_factor=0)
    with pytest.raises(ValueError, match="max_state_download_failures"):
        HealthConfig(max_state_download_failures=0)
    with pytest.raises(ValueError, match="lone_peer_timeout"):
        HealthConfig(lone_peer_timeout=math.inf)


def test_schema_mismatch_of_a_real_round_is_recognised():
    """Two peers whose models differ: matchmaking says SCHEMA_MISMATCH, which SwarmHealth turns
    into a model-mismatch warning naming this peer's fingerprint."""
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)]
    dhts = [DHT(**HOST)]
    averagers = []
    try:
        dhts.append(DHT(dhts[0].get_visible_maddrs(), **HOST))
        for dht, model in zip(dhts, models, strict=True):
            tensors = [p.detach().clone() for p in model.parameters()]
            averagers.append(DecentralizedAverager(tensors, dht, prefix="mismatch", **FAST))

        def step(averager):
            try:
                return averager.step(timeout=2.0)
            except MatchmakingError as e:
                return e

        with ThreadPoolExecutor(2) as pool:
            errors = list(pool.map(step, averagers))
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
    assert BackgroundRuntime.active_references() == 0
    for error, model in zip(errors, models, strict=True):
        assert isinstance(error, MatchmakingError), error
        health = SwarmHealth(
            "run", HealthConfig(max_schema_mismatches=1), parameters=model, log=False
        )
        (warning,) = health.observe_averaging_failure(error)
        assert warning.kind == "model_mismatch"
        assert model_fingerprint(model) in str(warning)
