"""hivemind names and keywords that a ported script uses, with hivemind's meaning (issue 16.15).

Each test runs the real thing: DHTs on loopback, real averagers and trackers.
``benchmarks/hivemind_api_compat.py`` runs hivemind's own tests against these names.
"""

from __future__ import annotations

import concurrent.futures

import pydantic
import pytest
import torch

from swarmtrain.compression import CompressionType
from swarmtrain.dht import DHT, SchemaValidator, get_dht_time
from swarmtrain.optim import GradientAverager, ProgressTracker
from swarmtrain.optim.state_averager import ZERO_GRAD_SET_TO_NONE_DEFAULT, TrainingStateAverager

QUICK_REFRESH = {
    "min_refresh_period": 0.2,
    "max_refresh_period": 0.5,
    "default_refresh_period": 0.5,
}


class EpochSchema(pydantic.BaseModel):
    epoch: pydantic.StrictInt


def test_dht_await_ready_false_then_wait_until_ready():
    first = DHT()
    try:
        starting = DHT(initial_peers=first.get_visible_maddrs(), await_ready=False)
        try:
            with pytest.raises(concurrent.futures.TimeoutError, match="not ready within 0 s"):
                starting.wait_until_ready(timeout=0)  # a host never starts instantly
            starting.wait_until_ready(timeout=30)
            assert starting.store("key", "value", get_dht_time() + 30)
            assert first.get("key", latest=True).value == "value"
        finally:
            starting.shutdown()
    finally:
        first.shutdown()


def test_run_in_background_await_ready_false_calls_wait_for_the_start():
    dht = DHT(start=False)
    with pytest.raises(RuntimeError, match="not started"):
        dht.wait_until_ready()
    dht.run_in_background(await_ready=False)
    try:
        # no wait_until_ready: a call made while the node starts waits for it (as hivemind)
        assert dht.store("early", 1, get_dht_time() + 30)
        assert dht.get("early").value == 1
        with pytest.raises(RuntimeError, match="already started"):
            dht.run_in_background()
    finally:
        dht.shutdown()


def test_a_failed_background_start_is_raised_by_wait_until_ready():
    dht = DHT(await_ready=False, host_maddrs=["/ip4/127.0.0.1/tcp/not-a-port"])
    with pytest.raises(ValueError):
        dht.wait_until_ready(timeout=30)
    dht.shutdown()  # returns: the start is over


def test_add_validators_to_a_running_dht():
    dht = DHT(start=False)
    with pytest.raises(RuntimeError):
        dht.add_validators([SchemaValidator(EpochSchema)])  # not running yet, as in hivemind
    dht.run_in_background(await_ready=True)
    try:
        assert dht.store("epoch", "not an int", get_dht_time() + 30)  # no schema yet
        dht.add_validators([SchemaValidator(EpochSchema)])
        assert not dht.store("epoch", "still not an int", get_dht_time() + 30)
        assert dht.store("epoch", 7, get_dht_time() + 30)
        assert dht.get("epoch", latest=True).value == 7
    finally:
        dht.shutdown()


@pytest.mark.parametrize(
    "keyword, value, names",
    [
        ("parallel_rpc", 16, "num_workers"),
        ("cache_refresh_before_expiry", 5, "cache_locally"),
        ("reuse_get_requests", True, "get_many"),
        ("p2p", object(), "DHTNode.create"),
    ],
)
def test_hivemind_only_keywords_fail_naming_our_equivalent(keyword, value, names):
    with pytest.raises(TypeError, match=names):
        DHT(**{keyword: value})


def test_hivemind_only_keywords_with_our_behaviour_are_accepted():
    dht = DHT(parallel_rpc=None, cache_refresh_before_expiry=0, reuse_get_requests=False)
    try:
        assert dht.store("k", 1, get_dht_time() + 30)
    finally:
        dht.shutdown()


def test_progress_tracker_performance_ema_follows_reports():
    dht = DHT()
    try:
        with ProgressTracker(dht, "ema", 1000, **QUICK_REFRESH) as tracker:
            assert tracker.performance_ema.samples_per_second < 1e-6  # nothing reported yet
            tracker.report_local_progress(0, 10)
            tracker.report_local_progress(0, 30)
            speed = tracker.performance_ema.samples_per_second
            assert speed > 1
            assert tracker.local_progress.samples_per_second == speed
            assert tracker.performance_ema.num_updates == 2
    finally:
        dht.shutdown()


def test_gradient_averager_averaged_grads_are_the_averaged_buffers():
    dht = DHT()
    model = torch.nn.Linear(3, 2)
    try:
        with pytest.raises(ValueError, match=r"averaged_grads\[0\] has shape \(2, 3, 1\)"):
            GradientAverager(
                model.parameters(),
                dht=dht,
                prefix="wrong",
                averaged_grads=[torch.zeros(2, 3, 1), torch.zeros(2)],
                start=False,
            )
        with pytest.raises(ValueError, match="1 tensors for 2 parameters"):
            GradientAverager(
                model.parameters(), dht=dht, prefix="few", averaged_grads=[torch.zeros(2, 3)]
            )
        buffers = [torch.zeros(2, 3), torch.zeros(2)]
        averager = GradientAverager(
            model.parameters(), dht=dht, prefix="mine", averaged_grads=buffers, start=True
        )
        try:
            model(torch.ones(1, 3)).sum().backward()
            averager.accumulate_grads_(batch_size=1)
            averager.load_accumulators_into_averager_()
            assert torch.equal(buffers[0], model.weight.grad)  # averaged in the caller's tensors
            assert torch.equal(buffers[1], model.bias.grad)
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()


@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_state_averager_zero_grad_sets_gradients_to_none_by_default(offload_optimizer):
    """hivemind's ``TrainingStateAverager.step(zero_grad=True, set_to_none=...)``."""
    assert ZERO_GRAD_SET_TO_NONE_DEFAULT is True
    dht = DHT()
    try:
        model = torch.nn.Linear(2, 2)
        averager = TrainingStateAverager(
            dht=dht,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            params=model.parameters(),
            offload_optimizer=offload_optimizer,
            prefix=f"zero_{offload_optimizer}",
            start=True,
        )
        try:
            for set_to_none in (None, False):
                extra = {} if set_to_none is None else {"set_to_none": set_to_none}
                model(torch.ones(2)).sum().backward()
                averager.step(optimizer_step=True, zero_grad=True, **extra)
                if set_to_none is None:
                    assert model.weight.grad is None and model.bias.grad is None
                else:
                    assert torch.equal(model.weight.grad, torch.zeros(2, 2))
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()


def test_compression_type_has_the_protobuf_enum_helpers():
    assert CompressionType.values() == list(CompressionType)
    assert CompressionType.values()[0] == 0 and CompressionType.FLOAT16 in CompressionType.values()
    assert CompressionType.keys() == [member.name for member in CompressionType]
    assert dict(CompressionType.items())["UNIFORM_8BIT"] is CompressionType.UNIFORM_8BIT
    assert CompressionType.Name(3) == "UNIFORM_8BIT"
    assert CompressionType.Value("TOPK") is CompressionType.TOPK
    with pytest.raises(ValueError, match="no CompressionType named 'ZIP'"):
        CompressionType.Value("ZIP")
    with pytest.raises(ValueError):
        CompressionType.Name(99)
