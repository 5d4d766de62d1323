"""DecentralizedAverager between real DHTs and py-libp2p hosts on loopback (no mocks)."""

from __future__ import annotations

import functools
import math
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch
import trio

from swarmtrain.averaging import (
    AsyncDecentralizedAverager,
    AveragerConfig,
    AveragingStage,
    DecentralizedAverager,
    FailureReason,
    MatchmakingError,
    StepControl,
    async_averager,
    partition,
)
from swarmtrain.averaging.partition import PART_LAYOUT
from swarmtrain.compression import Float16Compression, NoCompression
from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {"min_matchmaking_time": 1.0, "request_timeout": 0.5}
# Exactly four peers per group (else a leader may assemble a smaller group at its expiration).
FULL4 = {"target_group_size": 4, "min_group_size": 4, "min_matchmaking_time": 2.0}
SHAPES = [(16, 16), (50,)]


def random_tensors(seed: int, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


class Swarm:
    """Peers (a DHT and an averager each) running in their own tasks, so any can be killed."""

    def __init__(self, nursery: trio.Nursery, prefix: str = "test"):
        self.nursery = nursery
        self.prefix = prefix
        self.bootstrap: list[str] = []
        self._stops: dict[int, tuple[trio.Event, trio.Event]] = {}

    async def _run(self, tensors, client_mode, kwargs, dht_kwargs, *, task_status):
        stop, done = trio.Event(), trio.Event()
        try:
            async with DHT.create(
                self.bootstrap, client_mode=client_mode, **HOST, **dht_kwargs
            ) as dht:
                async with DecentralizedAverager.create(
                    tensors, dht, prefix=self.prefix, **kwargs
                ) as averager:
                    task_status.started((dht, averager, stop, done))
                    await stop.wait()
        finally:
            done.set()

    async def add(self, tensors, *, client_mode=False, dht_kwargs=None, **kwargs):
        dht, averager, stop, done = await self.nursery.start(
            self._run, tensors, client_mode, {**FAST, **kwargs}, dht_kwargs or {}
        )
        if len(self.bootstrap) < 4 and not client_mode:
            self.bootstrap += dht.get_visible_maddrs()
        self._stops[id(averager)] = (stop, done)
        return averager

    async def kill(self, averager) -> None:
        stop, done = self._stops.pop(id(averager))
        stop.set()
        await done.wait()

    def stop_all(self) -> None:
        for stop, _ in self._stops.values():
            stop.set()


async def step_all(averagers, **kwargs_per_peer):
    """Run one step on every averager at once; a list of results or exceptions."""
    results: list = [None] * len(averagers)

    async def step(i):
        kwargs = {k: v[i] for k, v in kwargs_per_peer.items()}
        try:
            results[i] = await averagers[i].step(**kwargs)
        except MatchmakingError as e:
            results[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(step, i)
    return results


def local(averager) -> list[torch.Tensor]:
    with averager.get_tensors() as tensors:
        return [t.clone() for t in tensors]


async def wait_for(condition, seconds: float = 5.0) -> None:
    """Poll ``condition`` (state owned by other tasks) until it holds."""
    with trio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 (polling is the point of this test helper)
            await trio.sleep(0.02)


# ------------------------------------------------------------------------------- averaging


@pytest.mark.trio
@pytest.mark.parametrize("weights", [None, [1.0, 2.0, 0.5, 0.0]], ids=["mean", "weighted"])
async def test_four_peers_average_exactly(weights):
    tensors = [random_tensors(i) for i in range(4)]
    w = weights or [1.0] * 4
    want = [sum(w[i] * tensors[i][t] for i in range(4)) / sum(w) for t in range(len(SHAPES))]
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averagers = [await swarm.add([t.clone() for t in tensors[i]], **FULL4) for i in range(4)]
        start = time.monotonic()
        results = await step_all(
            averagers, gather=list(range(4)), weight=weights or [None] * 4, timeout=[10] * 4
        )
        elapsed = time.monotonic() - start
        for i, averager in enumerate(averagers):
            assert results[i] == {a.peer_id: j for j, a in enumerate(averagers)}
            for got, expected in zip(local(averager), want, strict=True):
                torch.testing.assert_close(got, expected)
            assert averager.get_group_bits() == ""
        swarm.stop_all()
    assert elapsed < 10, elapsed  # a full group assembles at once (no waiting for expiry)


@pytest.mark.trio
async def test_group_agrees_on_the_part_layout_of_its_oldest_member(monkeypatch):
    """Members cut slices into parts the same way: the newest layout all of them speak (one
    part per small slice here), or the original one as soon as one member is older."""
    layouts: list[int] = []
    make_group = AsyncDecentralizedAverager._allreduce_group

    def recording(group, total_size, suffix=b""):
        allreduce_group = make_group(group, total_size, suffix)
        layouts.append(allreduce_group.part_layout)
        return allreduce_group

    monkeypatch.setattr(AsyncDecentralizedAverager, "_allreduce_group", staticmethod(recording))
    tensors = [random_tensors(20 + i) for i in range(4)]
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        # 64-byte parts: ~5 parts per slice in layout 0, one (or two, at a tensor's end) in 1
        averagers = [
            await swarm.add([t.clone() for t in tensors[i]], part_size_bytes=64, **FULL4)
            for i in range(4)
        ]
        for old in (None, averagers[2]):
            if old is not None:
                old._matchmaking.part_layout = 0  # as a peer of an older version says
            layouts.clear()
            before = [local(a) for a in averagers]
            want = [sum(b[t] for b in before) / 4 for t in range(len(SHAPES))]
            results = await step_all(averagers, timeout=[10] * 4)
            assert all(isinstance(r, dict) and len(r) == 4 for r in results), results
            assert layouts == [0 if old is not None else PART_LAYOUT] * 4
            for averager in averagers:
                for got, expected in zip(local(averager), want, strict=True):
                    torch.testing.assert_close(got, expected)
        swarm.stop_all()


@pytest.mark.trio
async def test_after_a_round_its_links_held_back_the_averager_offers_finer_parts():
    """A large round whose payload crawled (a slow uplink) makes the next rounds offer
    LINK_BOUND_LAYOUT (~8 parts per slice, so the group's lowest is that); a fast one restores
    what was offered before; a small one, or the first (it opens the connections), says
    nothing; ``adapt_part_layout=False`` pins it."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averager = await swarm.add(random_tensors(1))
        offered = averager._matchmaking
        big = partition.MIN_MEASURED_PAYLOAD_BYTES
        slow = 2 * big / partition.LINK_BOUND_BYTES_PER_SECOND  # seconds: half the threshold
        assert offered.part_layout == PART_LAYOUT != partition.LINK_BOUND_LAYOUT
        averager._adapt_part_layout(big, slow)  # the first round
        assert offered.part_layout == PART_LAYOUT
        averager._adapt_part_layout(big - 1, 1000.0)
        assert offered.part_layout == PART_LAYOUT
        for _ in range(2):
            averager._adapt_part_layout(big, slow)
            assert offered.part_layout == partition.LINK_BOUND_LAYOUT
        averager._adapt_part_layout(big - 1, 0.001)  # too small to tell: no change
        assert offered.part_layout == partition.LINK_BOUND_LAYOUT
        averager._adapt_part_layout(big, slow / 4)
        assert offered.part_layout == PART_LAYOUT
        averager.adapt_part_layout = False
        averager._adapt_part_layout(big, slow)
        assert offered.part_layout == PART_LAYOUT
        swarm.stop_all()


def test_small_cpu_tensors_are_copied_on_the_loop():
    limit = async_averager.INLINE_COPY_MAX_BYTES
    assert async_averager._copies_on_loop([torch.zeros(10), torch.zeros(3, 3).double()])
    assert async_averager._copies_on_loop([torch.zeros(limit // 8), torch.zeros(limit // 8)])
    assert not async_averager._copies_on_loop([torch.zeros(limit // 4 + 1)])
    assert not async_averager._copies_on_loop([torch.zeros(4, device="meta")])


@pytest.mark.trio
@pytest.mark.parametrize("on_loop", [True, False], ids=["loop", "thread"])
async def test_snapshot_and_deltas_on_the_loop_or_in_threads(monkeypatch, on_loop):
    if not on_loop:
        monkeypatch.setattr(async_averager, "INLINE_COPY_MAX_BYTES", 0)
    tensors = [random_tensors(30 + i) for i in range(2)]
    pair = {"target_group_size": 2, "min_group_size": 2}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averagers = [await swarm.add([t.clone() for t in tensors[i]], **pair) for i in range(2)]
        assert all(async_averager._copies_on_loop(local(a)) == on_loop for a in averagers)
        for _ in range(2):  # the second round reuses the first one's buffers
            before = [local(a) for a in averagers]
            want = [(before[0][t] + before[1][t]) / 2 for t in range(len(SHAPES))]
            results = await step_all(averagers, timeout=[10] * 2)
            assert all(isinstance(r, dict) and len(r) == 2 for r in results), results
            for averager in averagers:
                for got, expected in zip(local(averager), want, strict=True):
                    torch.testing.assert_close(got, expected)
                with averager.get_tensors() as live:
                    live[0].add_(1.0)  # the next round starts from other values
        swarm.stop_all()


@pytest.mark.trio
async def test_client_and_auxiliary_peers():
    tensors = [random_tensors(10 + i) for i in range(4)]
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        node0 = await swarm.add([t.clone() for t in tensors[0]], **FULL4)
        node1 = await swarm.add([t.clone() for t in tensors[1]], **FULL4)
        client = await swarm.add([t.clone() for t in tensors[2]], client_mode=True, **FULL4)
        aux = await swarm.add([t.clone() for t in tensors[3]], auxiliary=True, **FULL4)
        assert client.client_mode and not client.allow_state_sharing
        assert not aux.allow_state_sharing and node0.allow_state_sharing
        averagers = [node0, node1, client, aux]
        results = await step_all(averagers, gather=["n0", "n1", "client", "aux"], timeout=[10] * 4)
        want = [(tensors[0][t] + tensors[1][t] + tensors[2][t]) / 3 for t in range(len(SHAPES))]
        for averager in (node0, node1, client):
            for got, expected in zip(local(averager), want, strict=True):
                torch.testing.assert_close(got, expected)
        for got, original in zip(local(aux), tensors[3], strict=True):
            assert torch.equal(got, original)  # an auxiliary peer only helps
        assert results[2][aux.peer_id] == "aux" and results[3][client.peer_id] == "client"
        swarm.stop_all()


async def step_staggered(averagers, first: int, delay: float = 0.3, **kwargs):
    """Step ``averagers[first]`` alone, then ``delay`` s later every other one (so its first
    expiration is earlier than any potential leader's); results or MatchmakingErrors, and how
    long each step took."""
    results: list = [None] * len(averagers)
    durations: list = [None] * len(averagers)

    async def step(i):
        start = time.monotonic()
        try:
            results[i] = await averagers[i].step(gather=i, **kwargs)
        except MatchmakingError as e:
            results[i] = e
        durations[i] = time.monotonic() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step, first)
        await trio.sleep(delay)
        for i in range(len(averagers)):
            if i != first:
                nursery.start_soon(step, i)
    return results, durations


@pytest.mark.trio
async def test_client_that_steps_first_joins_a_group_with_two_auxiliary_peers_and_a_node():
    """The group of issue 16: 1 client, 2 auxiliary peers, 1 node, target 4. The client steps
    first, so every leader declares an expiration later than the client's first one: it used to
    be eligible for none of them until that expiration, and the others averaged without it."""
    tensors = [random_tensors(20 + i) for i in range(4)]
    kinds = [{"client_mode": True}, {"auxiliary": True}, {"auxiliary": True}, {}]
    config = {"target_group_size": 4, "min_matchmaking_time": 5.0, "request_timeout": 2.0}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averagers = [None] * 4
        for i in (3, 1, 2, 0):  # the client joins through the others
            averagers[i] = await swarm.add([t.clone() for t in tensors[i]], **kinds[i], **config)
        for _ in range(2):  # two rounds
            before = [local(a) for a in averagers]
            results, durations = await step_staggered(averagers, first=0, timeout=8.0)
            # the group is full as soon as the client joined: no wait for an expiration
            assert durations[0] < config["min_matchmaking_time"], durations
            peer_ids = {a.peer_id for a in averagers}
            for result in results:
                assert not isinstance(result, MatchmakingError), result
                assert set(result) == peer_ids and sorted(result.values()) == [0, 1, 2, 3]
            # client and node average; the auxiliary peers only help
            want = [(before[0][t] + before[3][t]) / 2 for t in range(len(SHAPES))]
            for i in (0, 3):
                for got, expected in zip(local(averagers[i]), want, strict=True):
                    torch.testing.assert_close(got, expected)
            for i in (1, 2):
                for got, original in zip(local(averagers[i]), before[i], strict=True):
                    assert torch.equal(got, original)
            with averagers[3].get_tensors() as live:
                live[0].add_(1.0)  # the next round starts from other values
        swarm.stop_all()


@pytest.mark.trio
async def test_clients_and_an_auxiliary_peer_average_without_any_node():
    tensors = [random_tensors(30 + i) for i in range(3)]
    config = {"target_group_size": 3, "min_matchmaking_time": 2.0, "request_timeout": 1.0}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        aux = await swarm.add([t.clone() for t in tensors[0]], auxiliary=True, **config)
        clients = [
            await swarm.add([t.clone() for t in tensors[i]], client_mode=True, **config)
            for i in (1, 2)
        ]
        results, _ = await step_staggered([*clients, aux], first=0, timeout=8.0)
        for result in results:
            assert not isinstance(result, MatchmakingError), result
            assert sorted(result.values()) == [0, 1, 2]
        want = [(tensors[1][t] + tensors[2][t]) / 2 for t in range(len(SHAPES))]
        for client in clients:
            for got, expected in zip(local(client), want, strict=True):
                torch.testing.assert_close(got, expected)
        for got, original in zip(local(aux), tensors[0], strict=True):
            assert torch.equal(got, original)
        swarm.stop_all()


@pytest.mark.trio
@pytest.mark.parametrize(
    "kinds, reason",
    [
        ([{"auxiliary": True}] * 2, FailureReason.AUXILIARY_ONLY),
        ([{"client_mode": True}] * 2, FailureReason.NO_LEADER),
    ],
    ids=["auxiliary-only", "clients-only"],
)
async def test_group_that_cannot_average_fails_fast_with_its_reason(kinds, reason):
    async with DHT.create([], **HOST) as bootstrap:  # clients need a node to join the DHT
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery)
            swarm.bootstrap = bootstrap.get_visible_maddrs()
            averagers = [await swarm.add(random_tensors(i), **kind) for i, kind in enumerate(kinds)]
            start = time.monotonic()
            results = await step_all(averagers, timeout=[20.0] * len(averagers))
            elapsed = time.monotonic() - start
            for result in results:
                assert isinstance(result, MatchmakingError), result
                assert result.reason == reason, result
            # the end of the first window (min_matchmaking_time=1), no retries, not the deadline
            assert elapsed < 5, elapsed
            swarm.stop_all()


@pytest.mark.trio
async def test_moshpit_groups_of_two_converge():
    n, max_rounds = 8, 5
    values = [float(i) for i in range(n)]
    mean = sum(values) / n
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averagers = [
            await swarm.add(
                [torch.full((4,), values[i])],
                target_group_size=2,
                initial_group_bits=format(i % 4, "02b"),
                # 8 peers on one trio loop (and busy cores) make a DHT read take seconds: the
                # declaration window must outlast a store plus a read, or partners never see
                # each other; a full pair assembles at once, so a wide window costs no time.
                min_matchmaking_time=4.0,
                request_timeout=1.5,
                next_chunk_timeout=2.0,
                dht_kwargs={"num_replicas": 3, "bucket_size": 4},  # fewer RPCs per read
            )
            for i in range(n)
        ]
        spreads = [max(abs(v - mean) for v in values)]
        failures = 0
        # With full pairs every round, 2 bits and groups of 2 average 8 peers exactly in 3
        # rounds (see next_group_bits); a round that misses a pair only slows this down.
        while len(spreads) <= max_rounds and spreads[-1] > spreads[0] / 10:
            results = await step_all(averagers, timeout=[10] * n)
            failures += sum(isinstance(r, MatchmakingError) for r in results)
            current = [local(a)[0][0].item() for a in averagers]
            assert sum(current) / n == pytest.approx(mean)  # pairwise means keep the total
            spreads.append(max(abs(v - mean) for v in current))
        bits = {a.get_group_bits() for a in averagers}
        swarm.stop_all()
    assert spreads[-1] <= spreads[0] / 10, (spreads, failures)
    assert all(len(b) == 2 for b in bits) and len(bits) > 1


# ------------------------------------------------------------------------------- failures


@pytest.mark.trio
async def test_expected_group_size_and_per_step_group_bits():
    """A leader assembles once the expected peers are in, long before its declaration ends;
    steps under other per-step group bits never meet, and the averager's own bits stay."""
    tensors = [random_tensors(i) for i in range(3)]
    want = [sum(tensors[i][t] for i in range(3)) / 3 for t in range(len(SHAPES))]
    slow = {"min_matchmaking_time": 30.0, "request_timeout": 1.0}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averagers = [await swarm.add([t.clone() for t in tensors[i]], **slow) for i in range(3)]
        start = time.monotonic()
        results = await step_all(
            averagers, expected_group_size=[3] * 3, group_bits=["0101"] * 3, timeout=[60] * 3
        )
        elapsed = time.monotonic() - start
        for i, averager in enumerate(averagers):
            assert isinstance(results[i], dict) and len(results[i]) == 3, results[i]
            for got, expected in zip(local(averager), want, strict=True):
                torch.testing.assert_close(got, expected)
            assert averager.get_group_bits() == ""  # per-step bits do not rotate its own
        results = await step_all(
            averagers[:2], expected_group_size=[2, 2], group_bits=["0", "1"], timeout=[2.0, 2.0]
        )
        for result in results:
            assert isinstance(result, MatchmakingError), result
            assert result.reason == FailureReason.TOO_FEW_PEERS, result
        swarm.stop_all()
    assert elapsed < 15, elapsed  # without expected_group_size the leader would wait 30 s


@pytest.mark.trio
async def test_joiners_learn_how_fast_their_leader_answers():
    """Matchmaking times each leader's first answer (``AnswerTimes``); a leader that answered
    slowly gets a longer timeout in the next round (the round's core is built with it)."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        averagers = [await swarm.add(random_tensors(i), **FAST) for i in range(2)]
        results = await step_all(averagers, expected_group_size=[2, 2], timeout=[20, 20])
        assert all(isinstance(r, dict) and len(r) == 2 for r in results), results
        matchmakers = [a._matchmaking for a in averagers]
        ids = [a.peer_id.to_bytes() for a in averagers]
        # the joiner (whoever it was) timed its leader's first answer; the leader asked nobody
        asked = [m.answer_times.peers() for m in matchmakers]
        assert sorted(map(len, asked)) == [0, 1], asked
        joiner = 0 if asked[0] else 1
        leader = ids[1 - joiner]
        assert asked[joiner] == [leader]
        now = get_dht_time()
        assert 0 < matchmakers[joiner].answer_times.slowest(leader, now) < 20
        # as a slow relayed answer: twice that, capped at a matchmaking window (1 s here)
        matchmakers[joiner].answer_times.observe(leader, 0.6, now)
        assert matchmakers[joiner]._request_timeouts(now) == {leader: 1.0}
        swarm.stop_all()


@pytest.mark.trio
async def test_too_few_peers_and_schema_mismatch_say_why():
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        alone = await swarm.add(random_tensors(0))
        start = time.monotonic()
        with pytest.raises(MatchmakingError) as info:
            await alone.step(timeout=1.5)
        assert info.value.reason == FailureReason.TOO_FEW_PEERS
        assert "min_group_size=2" in str(info.value)
        assert 1.4 < time.monotonic() - start < 4

        other = await swarm.add(random_tensors(1, shapes=[(3, 3)]))
        results = await step_all([alone, other], timeout=[2.0, 2.0])
        for result in results:
            assert isinstance(result, MatchmakingError), result
            assert result.reason == FailureReason.SCHEMA_MISMATCH, result
        swarm.stop_all()


def test_config_errors_are_real_errors():
    with pytest.raises(ValueError, match="prefix"):
        AveragerConfig(prefix="a.b")
    with pytest.raises(ValueError, match="initial_group_bits"):
        AveragerConfig(prefix="p", initial_group_bits="012")
    with pytest.raises(ValueError, match="request_timeout"):
        AveragerConfig(prefix="p", min_matchmaking_time=1.0, request_timeout=2.0)
    with pytest.raises(ValueError, match="auxiliary"):
        AveragerConfig(prefix="p", client_mode=True, auxiliary=True)
    with pytest.raises(ValueError, match="client-mode"):
        AveragerConfig(prefix="p", client_mode=True, allow_state_sharing=True)
    with pytest.raises(ValueError, match="target_group_size"):
        AveragerConfig(prefix="p", target_group_size=2, min_group_size=3)
    with pytest.raises(ValueError, match="bandwidth"):
        AveragerConfig(prefix="p", bandwidth=-1.0)
    with pytest.raises(TypeError, match="compression"):
        AveragerConfig(prefix="p", compression="fp16")
    with pytest.raises(ValueError, match="reducer_timeout"):
        AveragerConfig(prefix="p", sender_timeout=5.0, reducer_timeout=1.0)
    config = AveragerConfig(prefix="p", next_chunk_timeout=4.0)
    assert config.allreduce_config().sender_timeout == 4.0
    assert config.allreduce_config().reducer_timeout == 8.0
    assert config.allow_state_sharing is True
    assert AveragerConfig(prefix="p", auxiliary=True).allow_state_sharing is False


# ------------------------------------------------------------------------------- StepControl


@pytest.mark.trio
async def test_trigger_weight_change_and_cancel():
    a_tensors, b_tensors = random_tensors(20), random_tensors(21)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        a = await swarm.add([t.clone() for t in a_tensors], target_group_size=2)
        b = await swarm.add([t.clone() for t in b_tensors], target_group_size=2)

        control = a.start_step(require_trigger=True, timeout=10)
        assert isinstance(control, StepControl)
        b_control = b.start_step(timeout=10)
        await wait_for(lambda: control.stage == AveragingStage.AWAITING_TRIGGER)
        assert not control.triggered and not control.done()
        control.weight = 3.0  # allowed until all-reduce begins
        control.allow_allreduce()
        gathered = await control.wait_result()
        await b_control.wait_result()
        assert set(gathered) == {a.peer_id, b.peer_id}
        assert control.stage == AveragingStage.FINISHED and control.began_allreduce
        with pytest.raises(RuntimeError, match="all-reduce has begun"):
            control.weight = 1.0
        assert not control.cancel()  # too late: it is done
        want = [(3 * x + y) / 4 for x, y in zip(a_tensors, b_tensors, strict=True)]
        for averager in (a, b):
            for got, expected in zip(local(averager), want, strict=True):
                torch.testing.assert_close(got, expected)

        lonely = a.start_step(timeout=30)
        await wait_for(lambda: lonely.stage == AveragingStage.LOOKING_FOR_GROUP)
        before = local(a)
        assert lonely.cancel()
        with pytest.raises(CancelledError):
            await lonely.wait_result()
        assert lonely.cancelled() and lonely.stage == AveragingStage.FINISHED
        for got, expected in zip(local(a), before, strict=True):
            assert torch.equal(got, expected)
        # the averager still works after a cancelled step
        results = await step_all([a, b], timeout=[10, 10])
        assert all(isinstance(r, dict) for r in results), results
        swarm.stop_all()


@pytest.mark.trio
async def test_member_cancelled_after_assembly_is_dropped_at_once():
    """A member that cancels between assembly and the all-reduce answers the others' streams
    at once, so they finish without it instead of waiting ``sender_timeout`` (30 s here)."""
    tensors = [random_tensors(40 + i) for i in range(3)]
    slow = {"sender_timeout": 30.0, "target_group_size": 3, "min_group_size": 3}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        a, b, x = [await swarm.add([t.clone() for t in tensors[i]], **slow) for i in range(3)]
        x_control = x.start_step(require_trigger=True, timeout=60)
        with trio.fail_after(20):  # well under the 30 s the others would otherwise wait
            async with trio.open_nursery() as steps:
                steps.start_soon(functools.partial(a.step, timeout=60))
                steps.start_soon(functools.partial(b.step, timeout=60))
                await wait_for(lambda: x_control.stage == AveragingStage.AWAITING_TRIGGER, 15)
                assert x_control.cancel()
        for t, (got_a, got_b) in enumerate(zip(local(a), local(b), strict=True)):
            mean = (tensors[0][t] + tensors[1][t]) / 2
            # a and b averaged their own slices without x; x's slice kept their local values
            averaged = torch.isclose(got_a, mean) & torch.isclose(got_b, mean)
            kept = torch.eq(got_a, tensors[0][t]) & torch.eq(got_b, tensors[1][t])
            assert bool((averaged | kept).all())
            assert bool(averaged.any()) or t > 0
        for got, original in zip(local(x), tensors[2], strict=True):
            assert torch.equal(got, original)
        swarm.stop_all()


# ------------------------------------------------------------------------------- state sharing


@pytest.mark.trio
async def test_load_state_prefers_the_donor_with_higher_priority():
    low_state, high_state = random_tensors(30), random_tensors(31)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        low = await swarm.add(low_state)
        high = await swarm.add(high_state, state_compression=Float16Compression())
        high.state_sharing_priority = 5.0
        low.state_sharing_priority = 1.0
        newcomer = await swarm.add(random_tensors(32), allow_state_sharing=False)
        with trio.fail_after(5):
            while True:  # priorities are re-declared right after they change
                loaded = await newcomer.load_state_from_peers(timeout=3)
                if loaded is not None and torch.allclose(loaded[1][0], high_state[0], atol=1e-2):
                    break
                await trio.sleep(0.05)
        metadata, tensors = loaded
        assert metadata == {"group_bits": ""}
        for got, expected in zip(tensors, high_state, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)  # float16 on the wire
        assert not torch.equal(tensors[0], high_state[0])

        high.allow_state_sharing = False  # the next download comes from the other donor
        with trio.fail_after(5):
            while True:
                metadata, tensors = await newcomer.load_state_from_peers(timeout=3)
                if torch.equal(tensors[0], low_state[0]):
                    break
                await trio.sleep(0.05)
        for got, expected in zip(tensors, low_state, strict=True):
            assert torch.equal(got, expected)
        swarm.stop_all()


class GateCompression(NoCompression):
    """Compresses tensor 0 at once, then holds until released (so a test can kill the donor)."""

    def __init__(self):
        self.reached = threading.Event()
        self.release = threading.Event()

    def compress(self, tensor, info=None, allow_inplace=False):
        if info is not None and info.key != 0:
            self.reached.set()
            self.release.wait(10)
        return super().compress(tensor, info, allow_inplace)


@pytest.mark.trio
async def test_load_state_resumes_from_the_next_donor_when_the_best_dies():
    shapes = [(64, 64), (300,), (7, 9)]
    best_state, second_state = random_tensors(40, shapes), random_tensors(41, shapes)
    gate = GateCompression()
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        best = await swarm.add(best_state, state_compression=gate)
        second = await swarm.add(second_state)
        best.state_sharing_priority = 10.0
        second.state_sharing_priority = 1.0
        newcomer = await swarm.add(
            [torch.zeros(s) for s in shapes], allow_state_sharing=False, next_chunk_timeout=5.0
        )
        await trio.sleep(0.3)  # let the new priorities reach the DHT
        result: list = []

        async def load():
            result.append(await newcomer.load_state_from_peers(timeout=20))

        nursery.start_soon(load)
        assert await trio.to_thread.run_sync(gate.reached.wait, 10)  # tensor 0 was sent

        # Kill it while its download handler is stuck in the compression thread: the host closes
        # its connections (the download fails mid-transfer) but waits for that thread to end.
        nursery.start_soon(swarm.kill, best)
        await wait_for(lambda: result, seconds=15)  # resumed from the next donor meanwhile
        gate.release.set()
        metadata, tensors = result[0]
        assert metadata == {"group_bits": ""}
        assert torch.equal(tensors[0], best_state[0])  # from the donor that died
        for got, expected in zip(tensors[1:], second_state[1:], strict=True):
            assert torch.equal(got, expected)  # resumed from the next donor
        swarm.stop_all()


# ------------------------------------------------------------------------------- blocking


def test_blocking_facade_two_peers_with_threads():
    first = DHT(**HOST)
    second = DHT(first.get_visible_maddrs(), **HOST)
    tensors = [random_tensors(50), random_tensors(51)]
    want = [(x + y) / 2 for x, y in zip(*tensors, strict=True)]
    averagers = [
        DecentralizedAverager(
            [t.clone() for t in tensors[i]], dht, prefix="blocking", start=True, **FAST
        )
        for i, dht in enumerate((first, second))
    ]
    try:
        results: list = [None, None]

        def run(i):
            results[i] = averagers[i].step(gather=f"peer{i}", timeout=10)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert results[0] == {averagers[0].peer_id: "peer0", averagers[1].peer_id: "peer1"}
        assert results[1] == results[0]
        for averager in averagers:
            with averager.get_tensors() as local_tensors:
                for got, expected in zip(local_tensors, want, strict=True):
                    torch.testing.assert_close(got, expected)
            assert averager.get_group_bits() == ""

        control = averagers[0].step(wait=False, timeout=1.5)  # nobody else steps: it fails
        assert isinstance(control, StepControl)
        with pytest.raises(MatchmakingError) as info:
            control.result(timeout=10)
        assert info.value.reason == FailureReason.TOO_FEW_PEERS
        with pytest.raises(ValueError, match="wait=False"):
            averagers[0].step(require_trigger=True)
        assert averagers[1].allow_state_sharing
        averagers[1].state_sharing_priority = 2.0
        assert averagers[1].state_sharing_priority == 2.0
        loaded = averagers[0].load_state_from_peers(timeout=5)
        assert loaded is not None and loaded[0] == {"group_bits": ""}
        assert math.isclose(loaded[1][1][0].item(), want[1][0].item(), rel_tol=1e-6)
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
    assert BackgroundRuntime.active_references() == 0


@pytest.mark.trio
async def test_a_donor_with_nan_state_is_skipped_with_a_warning(caplog):
    clean, poisoned = random_tensors(40), random_tensors(41)
    poisoned[1][0] = float("nan")
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        bad = await swarm.add(poisoned)
        bad.state_sharing_priority = 9.0  # asked first
        newcomer = await swarm.add(random_tensors(42), allow_state_sharing=False)
        with trio.fail_after(10):
            assert await newcomer.load_state_from_peers(timeout=3) is None  # the only donor
            good = await swarm.add(clean)
            while True:  # the clean donor's declaration arrives
                loaded = await newcomer.load_state_from_peers(timeout=3)
                if loaded is not None:
                    break
                await trio.sleep(0.05)
        for got, expected in zip(loaded[1], clean, strict=True):
            assert torch.equal(got, expected)
        assert good is not None
        swarm.stop_all()
    assert any(
        "NaN or inf values" in r.getMessage()
        and "banned for 600 s" in r.getMessage()
        and str(bad.peer_id) in r.getMessage()
        for r in caplog.records
    )
