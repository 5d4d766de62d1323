"""Butterfly all-reduce between real py-libp2p hosts on loopback (no mocks)."""

import dataclasses
import math
import threading
import time
from contextlib import AsyncExitStack, asynccontextmanager

import numpy as np
import pytest
import torch
import trio

from swarmtrain.averaging import (
    AllReduceConfig,
    AllReduceGroup,
    AllReduceRunner,
    AllReduceService,
    AveragingMode,
    Failure,
    NonFiniteError,
)
from swarmtrain.averaging.allreduce import rpc_aggregate_part_name, rpc_aggregate_part_v2_name
from swarmtrain.averaging.partition import TensorPartContainer
from swarmtrain.compression import (
    CompressionBase,
    ErrorFeedback,
    Float16Compression,
    NoCompression,
    TopKSparsification,
    serialize_torch_tensor,
)
from swarmtrain.p2p import P2P, Attached, ResourceLimits
from swarmtrain.proto import averaging_pb2

pytestmark = pytest.mark.trio

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
SHAPES = [(100, 100), (5000,), (3, 7, 11)]
FAST = AllReduceConfig(
    part_size_bytes=16 * 1024, sender_timeout=5.0, reducer_timeout=10.0, allreduce_timeout=30.0
)


@asynccontextmanager
async def swarm(n):
    """n connected hosts, each serving all-reduce under the prefix "test"."""
    async with AsyncExitStack() as stack:
        hosts, services = [], []
        for _ in range(n):
            maddrs = [a for host in hosts for a in host.get_visible_maddrs()]
            host = await stack.enter_async_context(P2P.create(initial_peers=maddrs))
            hosts.append(host)
            services.append(await stack.enter_async_context(AllReduceService.create(host, "test")))
        yield hosts, services


def random_tensors(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=generator) for s in SHAPES] for _ in range(n)]


async def run_all(runners):
    results = [None] * len(runners)

    async def run(i):
        results[i] = await runners[i].run()

    async with trio.open_nursery() as nursery:
        for i in range(len(runners)):
            nursery.start_soon(run, i)
    return results


def weighted_mean(tensors, weights, members):
    total = sum(weights[i] for i in members)
    return [sum(tensors[i][t] * weights[i] for i in members) / total for t in range(len(SHAPES))]


def check_averaged(tensors, result, want, **tolerance):
    assert result.deltas is not None
    for local, delta, mean in zip(tensors, result.deltas, want, strict=True):
        assert delta.shape == local.shape and delta.dtype == local.dtype
        torch.testing.assert_close(local + delta, mean, **tolerance)


@pytest.mark.parametrize(
    "fractions, weights",
    [([1, 1, 1, 1], [1, 1, 1, 1]), ([0.1, 0.4, 0.2, 0.3], [1.0, 2.0, 0.5, 0.0])],
    ids=["equal", "weighted"],
)
async def test_four_peers_exact_weighted_mean(fractions, weights):
    tensors = random_tensors(4)
    async with swarm(4) as (hosts, services):
        group = AllReduceGroup(b"round-1", tuple(h.peer_id for h in hosts), tuple(fractions))
        runners = [
            AllReduceRunner(services[i], group, tensors[i], weight=weights[i], config=FAST)
            for i in range(4)
        ]
        start = time.monotonic()
        results = await run_all(runners)
        elapsed = time.monotonic() - start
    want = weighted_mean(tensors, weights, range(4))
    if weights == [1, 1, 1, 1]:
        want_torch = [torch.stack([t[i] for t in tensors]).mean(0) for i in range(len(SHAPES))]
        for a, b in zip(want, want_torch, strict=True):
            torch.testing.assert_close(a, b)
    for i in range(4):
        assert results[i].complete, results[i]
        check_averaged(tensors[i], results[i], want)
    assert elapsed < 10
    # every slice goes out once from each of the 3 other senders and its delta comes back
    # (NoCompression: 4 bytes per float32 value)
    numel = sum(t.numel() for t in tensors[0])
    assert sum(r.payload_bytes_sent for r in results) == 3 * numel * 4 * 2


async def test_client_and_aux_peers():
    tensors = random_tensors(4, seed=1)
    weights = [1.0, 3.0, 0.0, 0.5]
    async with swarm(4) as (hosts, services):
        group = AllReduceGroup(
            b"round-2",
            tuple(h.peer_id for h in hosts),
            (0.5, 0.0, 0.3, 0.2),
            (NODE, CLIENT, AUX, NODE),
        )
        runners = [
            AllReduceRunner(services[i], group, tensors[i], weight=weights[i], config=FAST)
            for i in range(4)
        ]
        results = await run_all(runners)
    want = weighted_mean(tensors, weights, [0, 1, 3])
    for i in (0, 1, 3):
        assert results[i].complete, results[i]
        check_averaged(tensors[i], results[i], want)
    assert results[2].deltas is None and results[2].complete


async def test_one_client_and_one_aux():
    tensors = random_tensors(2, seed=2)
    async with swarm(2) as (hosts, services):
        group = AllReduceGroup(
            b"round-3", (hosts[0].peer_id, hosts[1].peer_id), (0.0, 1.0), (CLIENT, AUX)
        )
        runners = [AllReduceRunner(services[i], group, tensors[i], config=FAST) for i in (0, 1)]
        results = await run_all(runners)
    check_averaged(tensors[0], results[0], tensors[0])  # the only sender: its own values
    assert results[1].deltas is None and results[0].complete and results[1].complete


async def test_fp16_compression_within_tolerance():
    tensors = random_tensors(4, seed=3)
    config = AllReduceConfig(
        compression=Float16Compression(),
        part_size_bytes=16 * 1024,
        sender_timeout=5.0,
        reducer_timeout=10.0,
        allreduce_timeout=30.0,
    )
    async with swarm(4) as (hosts, services):
        group = AllReduceGroup(b"round-4", tuple(h.peer_id for h in hosts), (1, 1, 1, 1))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=config) for i in range(4)]
        results = await run_all(runners)
    want = weighted_mean(tensors, [1] * 4, range(4))
    for i in range(4):
        assert results[i].complete
        check_averaged(tensors[i], results[i], want, atol=5e-3, rtol=0)


async def test_error_feedback_keeps_a_residual_for_every_part_sent():
    """Top-k with error feedback over all-reduce: each part a peer sends to another reducer
    (several per tensor) keeps its own residual, with that part's size."""
    tensors = random_tensors(3, seed=5)
    codecs = [ErrorFeedback(TopKSparsification(ratio=0.25)) for _ in range(3)]
    async with swarm(3) as (hosts, services):
        group = AllReduceGroup(b"round-ef", tuple(h.peer_id for h in hosts), (1, 1, 1))
        runners = [
            AllReduceRunner(
                services[i], group, tensors[i], config=dataclasses.replace(FAST, compression=c)
            )
            for i, c in enumerate(codecs)
        ]
        results = await run_all(runners)
    for runner, codec, result in zip(runners, codecs, results, strict=True):
        assert result.complete
        core = runner.core
        sent = [
            core.container.part_spec(r, k)
            for r in core.remote_reducers()
            for k in range(core.num_parts_for(r))
        ]
        assert len(sent) > len(SHAPES)  # several parts per tensor
        assert codec.num_residuals == len(sent)
        for spec in sent:
            residual = codec.residual(spec.tensor_index, spec.start)
            assert residual is not None and residual.numel() == spec.numel


class StallingCompression(CompressionBase):
    """NoCompression that blocks its worker thread after ``after`` calls until released."""

    def __init__(self, after):
        self.after, self.calls = after, 0
        self.stalled, self.release = threading.Event(), threading.Event()

    def compress(self, tensor, info=None, allow_inplace=False):
        self.calls += 1
        if self.calls > self.after:
            self.stalled.set()
            self.release.wait(timeout=30)
        return NoCompression().compress(tensor, info)

    def estimate_compression_ratio(self, info):
        return 1.0


class StallingRunner(AllReduceRunner):
    """A real runner that stops answering after ``after`` results (then it gets killed)."""

    def __init__(self, *args, after, **kwargs):
        super().__init__(*args, **kwargs)
        self.after, self.answered, self.stalled = after, 0, trio.Event()

    async def _result(self, *args):
        self.answered += 1
        if self.answered > self.after:
            self.stalled.set()
            await trio.sleep_forever()
        return await super()._result(*args)


async def test_peer_dies_mid_round():
    tensors = random_tensors(4, seed=4)
    config = AllReduceConfig(
        part_size_bytes=4096, sender_timeout=5.0, reducer_timeout=10.0, allreduce_timeout=30.0
    )
    codec = StallingCompression(after=2)
    dying_config = AllReduceConfig(
        compression=codec,
        part_size_bytes=4096,
        sender_timeout=5.0,
        reducer_timeout=10.0,
        allreduce_timeout=30.0,
    )
    group_ready, box = trio.Event(), {}

    async def dying_peer(maddrs, task_status=trio.TASK_STATUS_IGNORED):
        async with (
            P2P.create(initial_peers=maddrs) as host,
            AllReduceService.create(host, "test") as service,
        ):
            task_status.started(host.peer_id)
            await group_ready.wait()
            dying = StallingRunner(service, box["group"], tensors[3], config=dying_config, after=1)
            async with trio.open_nursery() as nursery:

                async def run_until_stalled():
                    result = await dying.run()
                    box["unstalled"] = result  # it never stalled: the checks below say how
                    dying.stalled.set()

                nursery.start_soon(run_until_stalled)
                await dying.stalled.wait()  # it answered one part and hangs as a reducer...
                if "unstalled" in box:
                    return
                # ...and stopped sending its own parts (a worker thread sets a threading.Event)
                await trio.to_thread.run_sync(codec.stalled.wait, 30)
                nursery.cancel_scope.cancel()
                codec.release.set()  # lets its worker thread return
        # leaving P2P.create: the peer is gone mid-round

    async with swarm(3) as (hosts, services), trio.open_nursery() as nursery:
        maddrs = [a for h in hosts for a in h.get_visible_maddrs()]
        dead_peer = await nursery.start(dying_peer, maddrs)
        peers = (*(h.peer_id for h in hosts), dead_peer)
        box["group"] = group = AllReduceGroup(b"round-5", peers, (1, 1, 1, 1))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=config) for i in range(3)]
        start = time.monotonic()
        group_ready.set()
        results = await run_all(runners)
        elapsed = time.monotonic() - start
    assert "unstalled" not in box, f"the dying peer's round ended before it stalled: {box}"

    mean4 = weighted_mean(tensors, [1] * 4, range(4))
    mean3 = weighted_mean(tensors, [1] * 4, range(3))
    layout = TensorPartContainer(tensors[0], (1, 1, 1, 1), 4096).layout
    final = [
        [(t + d).reshape(-1) for t, d in zip(tensors[i], results[i].deltas, strict=True)]
        for i in range(3)
    ]
    for i in range(3):
        assert not results[i].timed_out
        # the dying peer's round either ended its streams (FINISHED) or its host closed them
        assert set(results[i].failed_reducers) == {dead_peer}
        assert results[i].failed_reducers[dead_peer] in (Failure.REJECTED, Failure.DISCONNECTED)
        assert set(results[i].banned_senders) == {dead_peer}
    saw_mean3 = False
    for reducer, parts in enumerate(layout):
        for spec in parts:
            window = slice(spec.start, spec.stop)
            m4 = mean4[spec.tensor_index].reshape(-1)[window]
            m3 = mean3[spec.tensor_index].reshape(-1)[window]
            values = [final[i][spec.tensor_index][window] for i in range(3)]
            if reducer < 3:  # honest reducers: everyone got the same average, with or without D
                for v in values:
                    torch.testing.assert_close(v, values[0])
                matches3 = torch.allclose(values[0], m3, atol=1e-6)
                assert matches3 or torch.allclose(values[0], m4, atol=1e-6)
                saw_mean3 |= matches3
            else:  # the dead reducer's slice: the average if it arrived, else local values
                for i, v in enumerate(values):
                    local = tensors[i][spec.tensor_index].reshape(-1)[window]
                    assert torch.allclose(v, m4, atol=1e-6) or torch.equal(v, local)
    assert saw_mean3  # the dead peer's missing parts were averaged without it
    assert elapsed < 15


async def test_peer_sending_wrong_shapes_is_excluded():
    tensors = random_tensors(3, seed=5)
    async with swarm(5) as (hosts, services):
        bad_shape, garbage = hosts[3], hosts[4]
        group = AllReduceGroup(
            b"round-6",
            tuple(h.peer_id for h in hosts),
            (1, 1, 1, 0, 0),
            (NODE, NODE, NODE, CLIENT, CLIENT),
        )
        runners = [AllReduceRunner(services[i], group, tensors[i], config=FAST) for i in range(3)]
        layout = TensorPartContainer(tensors[0], group.fractions, FAST.part_size_bytes).layout
        codes = []

        async def send_bad(host, reducer, make_part):
            numel = layout[reducer][0].numel
            request = averaging_pb2.AveragingRequest(
                group_id=group.group_id, weight=1.0, part_index=0, part=make_part(numel)
            )
            async with host.iterate_protobuf_handler(
                hosts[reducer].peer_id,
                rpc_aggregate_part_name("test"),
                [request],
                averaging_pb2.AveragingResponse,
                stream_input=True,
            ) as responses:
                async for response in responses:
                    codes.append(response.code)

        def wrong_shape(numel):
            message = serialize_torch_tensor(torch.zeros(numel + 1))
            return averaging_pb2.AveragingTensorPart(
                buffer=message.buffer.tobytes(), size=[numel + 1], dtype="float32"
            )

        def garbage_bytes(numel):
            return averaging_pb2.AveragingTensorPart(
                buffer=b"\x01" * (4 * numel - 3), size=[numel], dtype="float32"
            )

        results = [None] * 3

        async def run_honest(i):
            results[i] = await runners[i].run()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run_honest, i)
                nursery.start_soon(send_bad, bad_shape, i, wrong_shape)
                nursery.start_soon(send_bad, garbage, i, garbage_bytes)
    assert codes == [averaging_pb2.AVERAGING_BAD_PART] * 6
    want = weighted_mean(tensors, [1] * 3, range(3))
    for i in range(3):
        assert results[i].banned_senders == {
            bad_shape.peer_id: Failure.BAD_DATA,
            garbage.peer_id: Failure.BAD_DATA,
        }
        assert not results[i].failed_reducers and not results[i].timed_out
        check_averaged(tensors[i], results[i], want)


@pytest.mark.parametrize("codec", [NoCompression(), Float16Compression()], ids=["fp32", "fp16"])
async def test_peer_of_the_v1_wire_takes_part(codec):
    """A peer without rpc_aggregate_part_v2 (an older version): the others send it parts
    inside protobufs (after one NoSuchMethodError), and it sends them its parts so too."""
    tensors = random_tensors(3, seed=8)
    config = dataclasses.replace(FAST, compression=codec)
    async with swarm(3) as (hosts, services):
        old = hosts[2]
        old.remove_protobuf_handler(rpc_aggregate_part_v2_name("test"))
        for host in hosts[:2]:  # what an old peer does: call v1 everywhere
            services[2]._remember_v1_peer(host.peer_id)
        group = AllReduceGroup(b"round-v1", tuple(h.peer_id for h in hosts), (1, 1, 1))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=config) for i in range(3)]
        results = await run_all(runners)
        assert not services[0].speaks_v2(old.peer_id) and not services[1].speaks_v2(old.peer_id)
        assert services[0].speaks_v2(hosts[1].peer_id)
        # the next round goes to v1 at once
        runners = [
            AllReduceRunner(
                services[i], dataclasses.replace(group, group_id=b"round-v1b"), tensors[i]
            )
            for i in range(3)
        ]
        again = await run_all(runners)
    if isinstance(codec, NoCompression):  # parts of the refused v2 attempt are not counted
        numel = sum(t.numel() for t in tensors[0])
        assert sum(r.payload_bytes_sent for r in results) == 2 * numel * 4 * 2
    want = weighted_mean(tensors, [1] * 3, range(3))
    tolerance = {} if isinstance(codec, NoCompression) else {"atol": 5e-3, "rtol": 0}
    for result, local in zip(results + again, tensors + tensors, strict=True):
        assert result.complete, result
        check_averaged(local, result, want, **tolerance)


async def test_malformed_attached_parts_are_rejected():
    tensors = random_tensors(2, seed=9)
    async with swarm(3) as (hosts, services):
        bad = hosts[2]
        group = AllReduceGroup(
            b"round-v2-bad", tuple(h.peer_id for h in hosts), (1, 1, 0), (NODE, NODE, CLIENT)
        )
        runners = [AllReduceRunner(services[i], group, tensors[i], config=FAST) for i in range(2)]
        layout = TensorPartContainer(tensors[0], group.fractions, FAST.part_size_bytes).layout
        codes = []

        async def send_bad(reducer, make_item):
            numel = layout[reducer][0].numel
            request = averaging_pb2.AveragingRequest(
                group_id=group.group_id,
                weight=1.0,
                part_index=0,
                part=averaging_pb2.AveragingTensorPart(size=[numel], dtype="float32"),
            )
            async with bad.iterate_protobuf_handler(
                hosts[reducer].peer_id,
                rpc_aggregate_part_v2_name("test"),
                [make_item(request, numel)],
                averaging_pb2.AveragingResponse,
                stream_input=True,
                attachments=True,
                bulk=True,
            ) as responses:
                async for response in responses:
                    assert not isinstance(response, Attached)
                    codes.append(response.code)

        def short(request, numel):  # three bytes missing
            return Attached(request, np.zeros(4 * numel - 3, np.uint8))

        def no_attachment(request, numel):
            return request

        results = [None] * 2

        async def run_honest(i):
            results[i] = await runners[i].run()

        async with trio.open_nursery() as nursery:
            for i, make_item in enumerate((short, no_attachment)):
                nursery.start_soon(run_honest, i)
                nursery.start_soon(send_bad, i, make_item)
    assert codes == [averaging_pb2.AVERAGING_BAD_PART] * 2
    want = weighted_mean(tensors, [1] * 2, range(2))
    for i in range(2):
        assert results[i].banned_senders == {bad.peer_id: Failure.BAD_DATA}
        check_averaged(tensors[i], results[i], want)


@pytest.mark.parametrize("absence", ["wait_expired", "not_joining", "joining_another", "released"])
async def test_absent_peer_rejects_unknown_groups_and_is_banned_without_waiting(absence):
    tensors = random_tensors(2, seed=6)
    # a long sender_timeout: the absent peer's answer to our stream ("no such round") bans it
    # as a sender at once, without waiting for its parts until the timeout
    config = AllReduceConfig(
        part_size_bytes=16 * 1024, sender_timeout=20.0, reducer_timeout=25.0, allreduce_timeout=30.0
    )
    async with swarm(3) as (hosts, services):
        # hosts[2] serves all-reduce but never starts this round: its streams wait, then fail
        services[2].group_wait_timeout = 0.2 if absence == "wait_expired" else 20.0
        if absence == "not_joining":  # e.g. its step was cancelled while a join was in flight
            services[2].may_join_unknown_groups = lambda leader: False
        elif absence == "joining_another":  # looking again: a join request to another leader
            services[2].may_join_unknown_groups = lambda leader: leader in (b"", b"another")
        elif absence == "released":  # assembled, then its step was cancelled before the round
            services[2].may_join_unknown_groups = lambda leader: False
            services[2].expect(b"round-7")
            assert services[2]._may_start(b"round-7")
            services[2].release(b"round-7")
        peer_ids = tuple(h.peer_id for h in hosts)
        group = AllReduceGroup(b"round-7", peer_ids, (1, 1, 1), leader=hosts[0].peer_id)
        runners = [AllReduceRunner(services[i], group, tensors[i], config=config) for i in (0, 1)]
        start = time.monotonic()
        results = await run_all(runners)
        elapsed = time.monotonic() - start
    absent = hosts[2].peer_id
    want = weighted_mean(tensors, [1, 1], (0, 1))
    layout = TensorPartContainer(tensors[0], (1, 1, 1), 16 * 1024).layout
    for i in (0, 1):
        assert results[i].banned_senders == {absent: Failure.REJECTED}
        assert results[i].failed_reducers == {absent: Failure.REJECTED}
        for t, (local, delta) in enumerate(zip(tensors[i], results[i].deltas, strict=True)):
            expected = want[t].reshape(-1).clone()
            for spec in layout[2]:
                if spec.tensor_index == t:
                    expected[spec.start : spec.stop] = local.reshape(-1)[spec.start : spec.stop]
            torch.testing.assert_close((local + delta).reshape(-1), expected)
    assert elapsed < 4


@pytest.mark.parametrize("suffix", [b"", b".p"], ids=["same_id", "derived_id"])
async def test_expected_group_waits_for_its_late_round(suffix):
    """A member that assembled the group but starts its round late is waited for, even when
    it is not looking for another group (``may_join_unknown_groups`` says no); so are rounds
    whose ids extend the group's (PowerSGD runs two per group)."""
    tensors = random_tensors(3, seed=8)
    async with swarm(3) as (hosts, services):
        services[2].may_join_unknown_groups = lambda leader: False
        services[2].expect(b"round-8")
        group = AllReduceGroup(b"round-8" + suffix, tuple(h.peer_id for h in hosts), (1, 1, 1))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=FAST) for i in range(3)]
        results = [None] * 3

        async def run(i, delay):
            await trio.sleep(delay)
            results[i] = await runners[i].run()

        async with trio.open_nursery() as nursery:
            for i, delay in enumerate((0.0, 0.0, 1.0)):
                nursery.start_soon(run, i, delay)
    want = weighted_mean(tensors, [1, 1, 1], range(3))
    for i in range(3):
        assert results[i].complete, results[i]
        check_averaged(tensors[i], results[i], want)


async def test_allreduce_timeout_keeps_local_values():
    tensors = random_tensors(2, seed=7)
    config = AllReduceConfig(sender_timeout=None, reducer_timeout=None, allreduce_timeout=0.5)
    async with swarm(2) as (hosts, services):
        group = AllReduceGroup(b"round-8", (hosts[0].peer_id, hosts[1].peer_id), (1, 1))
        start = time.monotonic()
        result = await AllReduceRunner(services[0], group, tensors[0], config=config).run()
        elapsed = time.monotonic() - start
    assert result.timed_out and not result.complete
    assert all(bool((d == 0).all()) for d in result.deltas)
    assert math.isclose(elapsed, 0.5, abs_tol=1.5)


class HostileRunner(AllReduceRunner):
    """A runner without the sender's own finiteness check: it sends whatever it holds."""

    def _non_finite_message(self):
        return None


@pytest.mark.parametrize(
    "codec, bad",
    [(NoCompression(), math.nan), (NoCompression(), math.inf), (Float16Compression(), math.nan)],
    ids=["fp32-nan", "fp32-inf", "fp16-nan"],
)
# the hostile reducer (in this process) averages its own inf: numpy warns on its inf - inf
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
async def test_hostile_non_finite_sender_is_excluded_and_named(codec, bad, caplog):
    tensors = random_tensors(2, seed=11)
    hostile_tensors = [torch.full(s, bad) for s in SHAPES]
    hostile_tensors[1][::2] = 1.0  # finite values too: any NaN or inf in a part rejects it
    config = dataclasses.replace(FAST, compression=codec)
    async with swarm(3) as (hosts, services):
        group = AllReduceGroup(b"round-nan", tuple(h.peer_id for h in hosts), (1, 1, 1))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=config) for i in (0, 1)]
        runners.append(HostileRunner(services[2], group, hostile_tensors, config=config))
        start = time.monotonic()
        results = await run_all(runners)
        elapsed = time.monotonic() - start
    hostile = hosts[2].peer_id
    want = weighted_mean(tensors, [1, 1], range(2))
    layout = TensorPartContainer(tensors[0], group.fractions, FAST.part_size_bytes).layout
    for i in (0, 1):
        result = results[i]
        assert result.banned_senders == {hostile: Failure.NON_FINITE}
        assert result.failed_reducers == {hostile: Failure.NON_FINITE}
        averaged = [t + d for t, d in zip(tensors[i], result.deltas, strict=True)]
        assert all(bool(torch.isfinite(a).all()) for a in averaged)
        for reducer, parts in enumerate(layout):
            for spec in parts:
                got = averaged[spec.tensor_index].reshape(-1)[spec.start : spec.stop]
                if reducer == 2:  # the hostile reducer's slice keeps our own values
                    local = tensors[i][spec.tensor_index].reshape(-1)[spec.start : spec.stop]
                    assert torch.equal(got, local)
                else:  # the honest slices: the mean of the honest peers
                    mean = want[spec.tensor_index].reshape(-1)[spec.start : spec.stop]
                    torch.testing.assert_close(got, mean, atol=1e-2, rtol=1e-3)
    named = [r.getMessage() for r in caplog.records if "NaN or inf" in r.getMessage()]
    assert any(str(hostile) in m and "left out" in m for m in named), named
    assert any(str(hostile) in m and "keeps this peer's own values" in m for m in named), named
    assert elapsed < 10  # excluded at once, not after a timeout


async def test_sender_with_non_finite_tensors_sends_zero_weight_and_others_go_on(caplog):
    tensors = random_tensors(3, seed=12)
    tensors[2][0][3, 4] = math.nan
    async with swarm(3) as (hosts, services):
        group = AllReduceGroup(b"round-own-nan", tuple(h.peer_id for h in hosts), (1, 1, 1))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=FAST) for i in range(3)]
        results = [None] * 3
        errors = []

        async def run(i):
            try:
                results[i] = await runners[i].run()
            except NonFiniteError as e:
                errors.append(e)

        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run, i)
        elapsed = time.monotonic() - start
    assert len(errors) == 1 and results[2] is None
    assert "tensor 0 of the 3 to average holds NaN or inf" in str(errors[0])
    assert any("skips all-reduce" in r.getMessage() for r in caplog.records)
    want = weighted_mean(tensors, [1, 1, 1], range(2))  # every slice, the NaN peer's too
    for i in (0, 1):
        assert results[i].complete  # it took part, with weight 0: nobody waited or failed
        check_averaged(tensors[i], results[i], want)
    assert elapsed < FAST.sender_timeout


@pytest.mark.parametrize("after_half", ["silence", "trickle"])
async def test_a_sender_stalling_inside_its_first_part_is_banned_in_bounded_time(after_half):
    """Bytes arriving keep a slow sender's deadline moving (issue 18: a part crawling over a
    lossy path is not a stalled sender), but one that stops inside its first part, or
    trickles a byte at a time to hold the round open, is still banned within about
    ``sender_timeout`` (plus one second per ``min_rate`` bytes it sent) and the round ends
    without it."""
    from swarmtrain.p2p.framing import attached_message_header, encode_header
    from swarmtrain.p2p.rpc import RPC_PROTOCOL_ID
    from swarmtrain.proto import p2p_pb2

    config = dataclasses.replace(FAST, sender_timeout=2.0, reducer_timeout=4.0)
    tensors = random_tensors(2, seed=11)
    async with swarm(3) as (hosts, services):
        bad = hosts[2]
        group = AllReduceGroup(
            b"round-stall", tuple(h.peer_id for h in hosts), (1, 1, 0), (NODE, NODE, CLIENT)
        )
        runners = [AllReduceRunner(services[i], group, tensors[i], config=config) for i in range(2)]
        layout = TensorPartContainer(tensors[0], group.fractions, FAST.part_size_bytes).layout

        async def stall(reducer, task_status=trio.TASK_STATUS_IGNORED):
            numel = layout[reducer][0].numel
            request = averaging_pb2.AveragingRequest(
                group_id=group.group_id,
                weight=1.0,
                part_index=0,
                part=averaging_pb2.AveragingTensorPart(size=[numel], dtype="float32"),
            ).SerializeToString()
            open_frame = p2p_pb2.RPCFrameHeader(
                kind=p2p_pb2.RPCFrameHeader.OPEN, method=rpc_aggregate_part_v2_name("test")
            )
            stream = await bad.new_stream(hosts[reducer].peer_id, RPC_PROTOCOL_ID)
            await stream.write(
                encode_header(open_frame)
                + attached_message_header(len(request), 4 * numel)
                + request
                + bytes(2 * numel)  # half of the part
            )
            task_status.started()
            try:
                while after_half == "trickle":
                    await trio.sleep(0.2)
                    await stream.write(b"\0")
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await stream.close()

        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            for reducer in range(2):
                await nursery.start(stall, reducer)
            results = await run_all(runners)
            elapsed = time.monotonic() - start
            nursery.cancel_scope.cancel()
    want = weighted_mean(tensors, [1] * 2, range(2))
    for i in range(2):
        assert not results[i].timed_out
        assert results[i].banned_senders == {bad.peer_id: Failure.TIMEOUT}
        check_averaged(tensors[i], results[i], want)
    # sender_timeout, plus ~2 s bought by the half part and the trickle (4 KiB/s)
    assert config.sender_timeout <= elapsed < config.sender_timeout + 6


async def test_a_lane_its_reducer_takes_as_the_round_starts_does_not_fail_the_slice():
    """The reducer's host, full of lanes, takes the idle lane a sender is about to reuse for a
    newcomer: the reducer read none of the call (NOT_SERVED), so the sender sends it again
    (here over libp2p: the newcomer's fresh lane fills the reducer) and the round completes."""
    tensors = random_tensors(2, seed=9)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(P2P.create(limits=ResourceLimits(max_lanes_total=1)))
        b = await stack.enter_async_context(P2P.create(initial_peers=a.get_visible_maddrs()))
        services = [
            await stack.enter_async_context(AllReduceService.create(host, "test"))
            for host in (a, b)
        ]
        a.lanes.open_lanes.stale_after = 0.2  # (16 s by default)
        group = AllReduceGroup(b"round-1", (a.peer_id, b.peer_id), (1.0, 1.0))

        async def round_of(group):
            runners = [AllReduceRunner(services[i], group, tensors[i], config=FAST) for i in (0, 1)]
            return await run_all(runners)

        first = await round_of(group)
        assert all(r.complete for r in first)
        assert b.statistics()["lanes_opened"] == 1  # b's lane to a, idle in b's pool now
        await trio.sleep(0.3)  # the idle time under test: a may take the lane now
        taken: list[trio.CancelScope] = []
        acquire = b._bulk_pool.acquire

        async def acquire_as_a_newcomer_arrives(peer_id, max_message_size):
            stream, reused = await acquire(peer_id, max_message_size)
            if reused and peer_id == a.peer_id and not taken:
                newcomer = trio.CancelScope()  # a's book takes b's idle lane for it
                taken.append(newcomer)
                for token in a.lanes.open_lanes.admit(newcomer, "newcomer", trio.current_time()):
                    token.cancel()
            return stream, reused

        b._bulk_pool.acquire = acquire_as_a_newcomer_arrives
        second = await round_of(dataclasses.replace(group, group_id=b"round-2"))
        assert taken and a.lanes.open_lanes.evicted == 1
        want = weighted_mean(tensors, [1, 1], range(2))
        for i in (0, 1):
            assert second[i].complete, second[i]
            check_averaged(tensors[i], second[i], want)
        # b's parts were counted once, not once per call it sent
        assert second[1].part_bytes_sent == first[1].part_bytes_sent
        a.lanes.open_lanes.done(taken[0])
