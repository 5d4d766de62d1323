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
    with pytest.raises(ValueError, match="repeat_interval"):
        HealthConfig(repeat_interval=0)
    with pytest.raises(ValueError, match="max_state_download_failures"):
        HealthConfig(max_state_download_failures=0)
    with pytest.raises(ValueError, match="repeat_interval"):
        HealthConfig(repeat_interval=math.inf)


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
