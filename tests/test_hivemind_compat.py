"""hivemind names and keywords that a ported script uses, with hivemind's meaning (issue 16.15).

Each test runs the real thing: DHTs on loopback, real averagers and trackers.
``benchmarks/hivemind_api_compat.py`` runs hivemind's own tests against these names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing as mp
import pickle
import socket
import time

import pydantic
import pydantic.v1
import pytest
import torch
import trio

from swarmtrain.averaging import StepControl
from swarmtrain.compression import CompressionType
from swarmtrain.dht import (
    DHT,
    DHTID,
    AsyncioDHTNode,
    BytesWithPublicKey,
    CompositeValidator,
    DHTNode,
    DHTRecord,
    Ed25519SignatureValidator,
    RoutingTable,
    SchemaValidator,
    ValueWithExpiration,
    generate_private_key,
    get_dht_time,
    serialize,
)
from swarmtrain.optim import GradientAverager, Optimizer, ProgressTracker
from swarmtrain.optim.state_averager import ZERO_GRAD_SET_TO_NONE_DEFAULT, TrainingStateAverager
from swarmtrain.p2p import P2P, P2PError

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
        ("cache_refresh_before_expiry", 5, "cache_locally"),
        ("reuse_get_requests", True, "get_many"),
        ("p2p", object(), "DHTNode.create"),
    ],
)
def test_hivemind_only_keywords_fail_naming_our_equivalent(keyword, value, names):
    with pytest.raises(TypeError, match=names):
        DHT(**{keyword: value})


def test_hivemind_only_keywords_with_our_behaviour_are_accepted():
    dht = DHT(cache_refresh_before_expiry=0, reuse_get_requests=False)
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
        # stopped, the tracker still reads its last state (as in hivemind); reports raise
        assert not tracker.is_alive()
        assert tracker.performance_ema.samples_per_second == speed
        assert tracker.global_epoch == 0 and tracker.local_progress.samples_accumulated == 30
        with pytest.raises(RuntimeError, match="shut down"):
            tracker.report_local_progress(0, 40)
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


# ------------------------------------------------------------------ DHT ids and routing


def test_dht_id_bytes_common_prefix_and_distances_to_many():
    node_id = DHTID.generate()
    assert bytes(node_id) == node_id.to_bytes() and len(bytes(node_id)) == DHTID.HASH_NBYTES
    assert DHTID.from_bytes(bytes(node_id)) == node_id
    ids = [DHTID(0b1011 << 150), DHTID(0b1010 << 150), DHTID(0b1011 << 150 | 1)]
    assert DHTID.longest_common_prefix_length(*ids) == DHTID.NBITS - 154 + 3
    others = [DHTID.generate() for _ in range(3)]
    assert node_id.xor_distance(others) == [int(node_id) ^ int(other) for other in others]
    assert node_id.xor_distance(others[0]) == int(node_id) ^ int(others[0])


def test_routing_table_hivemind_lookups_and_the_default_clock():
    table = RoutingTable(DHTID.generate(), bucket_size=2, depth_modulo=5)
    before = get_dht_time()
    peers = {DHTID.generate(): f"peer-{index}" for index in range(40)}
    for node_id, peer in peers.items():
        table.add_or_update_node(node_id, peer)  # no `now`: the DHT clock
    main = dict(table)
    assert 0 < len(main) < len(peers)  # buckets of 2: some peers are only replacements
    for node_id, peer in main.items():
        assert node_id in table and peer in table
        assert table[node_id] == peer and table[peer] == node_id
        assert table.get(node_id=node_id) == peer and table.get(peer_id=peer) == node_id
    replacement_id, replacement_peer = next(
        (node_id, peer) for node_id, peer in peers.items() if node_id not in main
    )
    assert replacement_peer not in table and replacement_id not in table
    with pytest.raises(KeyError):
        table[replacement_peer]
    assert table.get(peer_id=replacement_peer, default="none") == "none"
    with pytest.raises(TypeError, match="exactly one"):
        table.get()
    assert all(bucket.nodes_to_peer_id is bucket.nodes for bucket in table.buckets)
    assert all(before <= bucket.last_updated <= get_dht_time() for bucket in table.buckets)


def test_value_with_expiration_indexes_like_hiveminds_tuple():
    found = ValueWithExpiration("value", 123.0)
    assert found[0] == "value" and found[1] == 123.0 and found[:] == ("value", 123.0)
    value, expiration = found
    assert (value, expiration) == ("value", 123.0)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_dht_that_reaches_none_of_its_bootstrap_peers_fails_saying_so():
    peer = "QmdaK4LUeQaKhqSFPRu9N7MvXUEWDxWwtCvPrS444tCgd1"
    address = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{peer}"
    with pytest.raises(P2PError, match="(?s)failed to connect to bootstrap peers.*" + peer):
        DHT(initial_peers=[address])


def test_run_coroutine_that_awaits_asyncio_names_the_trio_equivalent():
    async def hivemind_style(dht, node):
        await asyncio.sleep(0.01)

    async def trio_style(dht, node):
        await trio.sleep(0.01)
        return node.node_id

    async def other_runtime_error(dht, node):
        raise RuntimeError("mine")

    dht = DHT()
    try:
        with pytest.raises(RuntimeError, match=r"trio loop.*anyio\.sleep"):
            dht.run_coroutine(hivemind_style)
        with pytest.raises(RuntimeError, match=r"^mine$"):
            dht.run_coroutine(other_runtime_error)
        assert dht.run_coroutine(trio_style) == dht.run_coroutine(trio_style)
    finally:
        dht.shutdown()


def test_awaiting_a_trio_context_manager_names_the_async_with_form():
    async def hivemind_style():
        with pytest.raises(TypeError, match=r"async with P2P\.create"):
            await P2P.create()
        with pytest.raises(TypeError, match=r"AsyncioDHTNode\.create"):
            await DHTNode.create(None)
        with pytest.raises(TypeError, match=r"async with DHT\.create"):
            await DHT.create()

    asyncio.run(hivemind_style())


@pytest.mark.trio
async def test_the_trio_context_managers_still_enter_and_exit():
    async with DHT.create() as first, contextlib.AsyncExitStack() as stack:
        second = await stack.enter_async_context(
            DHT.create(initial_peers=first.get_visible_maddrs())
        )
        assert await second.store("key", 1, get_dht_time() + 30)
        assert (await first.get("key", latest=True)).value == 1


def test_an_owned_subkey_with_a_foreign_marker_names_our_key_format():
    class Owned(pydantic.BaseModel):
        owned: dict[BytesWithPublicKey, int]

    with pytest.raises(pydantic.ValidationError, match="local_public_key"):
        Owned.model_validate({"owned": {b"uid[owner:public-key]": 1}})
    marker = Ed25519SignatureValidator(generate_private_key()).local_public_key
    assert Owned.model_validate({"owned": {b"uid" + marker: 1}})


# ------------------------------------------------------------------------ asyncio DHTNode


def test_asyncio_dht_node_store_get_find_from_asyncio():
    async def main():
        first = await AsyncioDHTNode.create(num_replicas=2)
        second = await AsyncioDHTNode.create(
            initial_peers=await first.get_visible_maddrs(), num_replicas=2, parallel_rpc=2
        )
        try:
            ticks = 0

            async def tick():  # the asyncio loop keeps running while the nodes work
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.001)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            expiration = get_dht_time() + 30
            assert await second.store("key", [1, "a"], expiration)
            assert await first.get("key") == ValueWithExpiration([1, "a"], expiration)
            stored = await first.store_many(
                ["x", "y", "d"], [1, 2, 3], expiration, subkeys=[None, None, "sub"]
            )
            assert stored == {"x": True, "y": True, ("d", "sub"): True}
            found = await second.get_many(["x", "y", "missing"])
            assert found["x"].value == 1 and found["y"].value == 2 and found["missing"] is None
            assert (await second.get("d", latest=True)).value["sub"].value == 3
            with pytest.raises(ValueError, match="same length"):
                await first.store_many(["x"], [1, 2], expiration)
            nearest = await second.find_nearest_nodes([first.node_id], k_nearest=1)
            assert nearest == {first.node_id: {first.node_id: first.peer_id}}
            both = (await second.find_nearest_nodes([second.node_id], k_nearest=5))[second.node_id]
            assert set(both) == {first.node_id, second.node_id}
            alone = await second.find_nearest_nodes([second.node_id], exclude_self=True)
            assert list(alone[second.node_id]) == [first.node_id]
            assert len(second.protocol.storage) + len(first.protocol.storage) >= 4
            ticker.cancel()
            assert ticks > 0
        finally:
            await asyncio.gather(first.shutdown(), second.shutdown())
        with pytest.raises(RuntimeError, match="shut down"):
            await first.get("key")

    asyncio.run(main())


def test_asyncio_dht_node_takes_one_record_validator():
    class Schema(pydantic.BaseModel):
        epoch: pydantic.StrictInt

    async def main():
        node = await AsyncioDHTNode.create(record_validator=SchemaValidator(Schema))
        try:
            assert not await node.store("epoch", "seven", get_dht_time() + 30)
            assert await node.store("epoch", 7, get_dht_time() + 30)
        finally:
            await node.shutdown()

    asyncio.run(main())


@pytest.mark.trio
async def test_parallel_rpc_caps_the_nodes_concurrent_rpcs():
    with pytest.raises(ValueError, match="parallel_rpc"):
        async with P2P.create() as p2p, DHTNode.create(p2p, parallel_rpc=0):
            pass
    in_flight = peak = 0
    async with (
        P2P.create() as p2p_a,
        DHTNode.create(p2p_a) as first,
        P2P.create(p2p_a.get_visible_maddrs()) as p2p_b,
        DHTNode.create(p2p_b, [*p2p_a.get_visible_maddrs()]) as second,
        P2P.create(p2p_a.get_visible_maddrs()) as p2p_c,
        DHTNode.create(p2p_c, [*p2p_a.get_visible_maddrs()], parallel_rpc=1) as capped,
    ):
        original = capped.protocol.call_store

        async def counting_store(*args):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await original(*args)
            finally:
                in_flight -= 1

        capped.protocol.call_store = counting_store
        await capped.find_nearest_nodes([capped.node_id])  # knows both others
        async with trio.open_nursery() as nursery:
            for index in range(4):
                nursery.start_soon(capped.store, f"k{index}", index, get_dht_time() + 30)
        assert peak == 1  # 4 stores x 2 remote replicas, one RPC at a time
        assert (await first.get("k3")).value == 3 and (await second.get("k0")).value == 0


# ---------------------------------------------------------------------- record validators


class V1Schema(pydantic.v1.BaseModel):
    name: bytes
    counts: dict[bytes, pydantic.v1.conint(ge=0, strict=True)]
    owned: dict[BytesWithPublicKey, pydantic.v1.StrictInt]


def _record(key, value, subkey=None) -> DHTRecord:
    return DHTRecord(
        serialize(key),
        serialize(subkey) if subkey is not None else b"",
        serialize(value),
        get_dht_time() + 30,
    )


def test_schema_validator_checks_pydantic_v1_models_without_conversions():
    validator = SchemaValidator(V1Schema, allow_extra_keys=False)
    owner = Ed25519SignatureValidator().local_public_key
    assert validator.validate(_record("name", b"bytes"))
    assert not validator.validate(_record("name", 666))  # v1 would turn it into b"666"
    assert not validator.validate(_record("name", []))
    assert validator.validate(_record("counts", 7, subkey=b"peer"))
    assert not validator.validate(_record("counts", -1, subkey=b"peer"))
    assert not validator.validate(_record("counts", 7.0, subkey=b"peer"))
    assert not validator.validate(_record("counts", 7, subkey=66))
    assert not validator.validate(_record("counts", ""))  # v1 would turn "" into {}
    assert validator.validate(_record("owned", 1, subkey=b"x" + owner))
    assert not validator.validate(_record("owned", 1, subkey=b"no owner marker"))
    assert not validator.validate(_record("unknown", 1))


def test_bytes_with_public_key_in_pydantic_v2_models():
    class Schema(pydantic.BaseModel):
        owned: dict[BytesWithPublicKey, int]

    validator = SchemaValidator(Schema)
    owner = Ed25519SignatureValidator().local_public_key
    assert validator.validate(_record("owned", 1, subkey=b"x" + owner))
    assert not validator.validate(_record("owned", 1, subkey=b"no owner marker"))
    assert not validator.validate(_record("owned", 1, subkey="x" + owner.decode()))  # str


def test_composite_validator_merges_into_its_members():
    class First(pydantic.BaseModel):
        a: pydantic.StrictInt

    class Second(pydantic.BaseModel):
        b: pydantic.StrictInt

    composite = CompositeValidator([SchemaValidator(First, allow_extra_keys=False)])
    assert not composite.validate(_record("b", 1))
    assert composite.merge_with(SchemaValidator(Second, allow_extra_keys=False))
    assert composite.validate(_record("b", 1)) and not composite.validate(_record("b", "x"))
    assert len(composite.validators) == 1
    assert not composite.merge_with(Ed25519SignatureValidator())  # no member takes it
    assert len(composite.validators) == 1
    with pytest.raises(AttributeError, match="no signature validator"):
        composite.local_public_key  # noqa: B018
    signer = Ed25519SignatureValidator()
    assert composite.merge_with(CompositeValidator([signer]))
    assert len(composite.validators) == 2
    assert composite.local_public_key == signer.local_public_key


def _sign_in_child(connection) -> None:
    validator, record = connection.recv()
    connection.send(validator.sign_value(record))


def test_signature_validator_pickles_with_its_key():
    validator = Ed25519SignatureValidator()
    record = _record("key", b"value", subkey=b"sub" + validator.local_public_key)
    copy = pickle.loads(pickle.dumps(validator))
    assert copy.local_public_key == validator.local_public_key
    assert validator.validate(dataclasses.replace(record, value=copy.sign_value(record)))
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_sign_in_child, args=(child,))
    process.start()
    try:
        parent.send((validator, record))
        assert parent.poll(60)
        signed = parent.recv()
    finally:
        process.join(30)
    assert b"[signature:" in signed
    assert validator.validate(dataclasses.replace(record, value=signed))


def test_generate_private_key_makes_a_new_signing_key_each_time():
    first, second = generate_private_key(), generate_private_key()
    signer = Ed25519SignatureValidator(first)
    assert signer.local_public_key != Ed25519SignatureValidator(second).local_public_key
    record = _record("key", b"value", subkey=b"sub" + signer.local_public_key)
    signed = dataclasses.replace(record, value=signer.sign_value(record))
    assert Ed25519SignatureValidator().validate(signed)


def test_optimizer_scheduled_grads_is_the_pre_scheduled_gradient_round():
    """hivemind's ``Optimizer.scheduled_grads``: the round pre-scheduled before an epoch ends
    (None with no one to average with); after shutdown it is None or done."""
    first = DHT()
    second = DHT(first.get_visible_maddrs())
    dhts, opts, seen = [first, second], [], [[], []]
    try:
        for dht in dhts:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = Optimizer(
                dht=dht,
                run_id="scheduled_grads",
                target_batch_size=64,
                batch_size_per_step=8,
                params=model.parameters(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                matchmaking_time=2.0,
                averaging_timeout=10.0,
                tracker_opts={"gossip_period": 0.1, "min_refresh_period": 0.2},
            )
            opts.append((opt, model))
        assert all(opt.scheduled_grads is None for opt, _ in opts)  # nothing scheduled yet

        def train(index: int) -> None:
            opt, model = opts[index]
            deadline = time.monotonic() + 40
            while opt.local_epoch < 2:
                assert time.monotonic() < deadline, "stuck"
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                seen[index].append(opt.scheduled_grads)
                time.sleep(0.02)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(train, i) for i in range(2)]:
                future.result(timeout=60)
        assert all(any(isinstance(c, StepControl) for c in controls) for controls in seen)
    finally:
        for opt, _ in opts:
            opt.shutdown()
            assert opt.scheduled_grads is None or opt.scheduled_grads.done()
        for dht in reversed(dhts):
            dht.shutdown()
