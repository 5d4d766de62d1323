"""Averaging arithmetic: numpy fast paths keep torch semantics; user codecs stay off the loop."""

import threading
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from swarmtrain.averaging import AllReduceConfig, AllReduceGroup, AllReduceRunner
from swarmtrain.averaging.allreduce import AllReduceService
from swarmtrain.averaging.async_averager import _add_deltas, _snapshot
from swarmtrain.averaging.part_reducer import TensorPartReducer
from swarmtrain.averaging.partition import (
    TensorPartContainer,
    as_numpy,
    difference,
)
from swarmtrain.compression import CompressionBase, Float16Compression
from swarmtrain.p2p import P2P

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reducer_matches_torch_reference(dtype):
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 1000, generator=generator).to(dtype) for _ in range(2)]
    weights = (0.25, 1.0, 2.5)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    reducer = TensorPartReducer([1000, 1000], [dtype, dtype], num_senders=3)
    for sender, weight in enumerate(weights):
        for k in range(2):
            reducer.accumulate(sender, k, parts[k][sender], weight)
    for k in range(2):
        want = sum(parts[k][s].to(acc) * w for s, w in enumerate(weights)) / sum(weights)
        got = reducer.result(k)
        assert got.dtype == acc
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        local = parts[k][0]
        delta = difference(got, local)
        assert delta.dtype == dtype and delta.shape == (1000,)
        torch.testing.assert_close(delta, (got - local.to(acc)).to(dtype))


def test_zero_weight_sender_adds_nothing_not_even_nan():
    reducer = TensorPartReducer([4], [torch.float32], num_senders=2)
    reducer.accumulate(0, 0, torch.full((4,), float("nan")), 0.0)
    reducer.accumulate(1, 0, torch.arange(4.0), 2.0)
    torch.testing.assert_close(reducer.result(0), torch.arange(4.0))


def test_container_deltas_start_at_zero_and_views_fall_back():
    container = TensorPartContainer([torch.ones(10), torch.ones(3, dtype=torch.bfloat16)], [1, 1])
    assert all(not d.any() for d in container.deltas())
    assert container.deltas()[1].dtype == torch.bfloat16
    assert as_numpy(torch.zeros(3, dtype=torch.bfloat16)) is None
    assert as_numpy(torch.zeros(4, 4).t()) is None  # not contiguous: the torch path


def test_add_deltas_and_snapshot_keep_torch_semantics():
    parameter = torch.nn.Parameter(torch.ones(2, 3))
    half = torch.ones(4, dtype=torch.float16)
    strided = torch.ones(4, 4).t()
    version = parameter._version
    snapshot, _ = _snapshot([parameter, half, strided])
    _add_deltas(
        [parameter, half, strided], [torch.full((2, 3), 0.5), torch.ones(4), torch.ones(4, 4)]
    )
    assert parameter._version > version  # autograd still sees the in-place change
    assert parameter.requires_grad and torch.equal(parameter.detach(), torch.full((2, 3), 1.5))
    assert torch.equal(half, torch.full((4,), 2.0, dtype=torch.float16))
    assert torch.equal(strided, torch.full((4, 4), 2.0))
    assert not snapshot[0].requires_grad and torch.equal(snapshot[0], torch.ones(2, 3))
    assert snapshot[2].shape == (4, 4) and torch.equal(snapshot[2], torch.ones(4, 4))


class ThreadRecordingCodec(CompressionBase):
    """A user codec (not one of the inlined built-ins): must run in a worker thread."""

    def __init__(self):
        self.threads = set()

    def compress(self, tensor, info=None, allow_inplace=False):
        self.threads.add(threading.get_ident())
        return Float16Compression().compress(tensor, info)

    def estimate_compression_ratio(self, info):
        return 0.5


@pytest.mark.trio
async def test_user_codecs_run_in_worker_threads():
    generator = torch.Generator().manual_seed(7)
    tensors = [[torch.randn(5000, generator=generator), torch.randn(7, 11)] for _ in range(2)]
    user_codec = ThreadRecordingCodec()
    configs = [
        AllReduceConfig(part_size_bytes=4096, sender_timeout=5.0, reducer_timeout=10.0),
        AllReduceConfig(compression=user_codec, part_size_bytes=4096, sender_timeout=5.0),
    ]
    async with AsyncExitStack() as stack:
        hosts, services = [], []
        for _ in range(2):
            maddrs = [a for host in hosts for a in host.get_visible_maddrs()]
            hosts.append(await stack.enter_async_context(P2P.create(initial_peers=maddrs)))
            services.append(
                await stack.enter_async_context(AllReduceService.create(hosts[-1], "test"))
            )
        group = AllReduceGroup(b"numpy-paths", tuple(h.peer_id for h in hosts), (1, 1))
        runners = [
            AllReduceRunner(services[i], group, tensors[i], config=configs[i]) for i in (0, 1)
        ]
        results = [None, None]

        async def run(i):
            results[i] = await runners[i].run()

        async with trio.open_nursery() as nursery:
            for i in (0, 1):
                nursery.start_soon(run, i)
    assert user_codec.threads and threading.get_ident() not in user_codec.threads
    mean = [(a + b) / 2 for a, b in zip(*tensors, strict=True)]
    for i in (0, 1):
        assert results[i].complete
        for local, delta, want in zip(tensors[i], results[i].deltas, mean, strict=True):
            torch.testing.assert_close(local + delta, want, rtol=0, atol=1e-2)
