"""AllReduceCore wired to other cores in memory: no sockets, no clock (``now`` is a number)."""

import pytest
import torch

from swarmtrain.averaging.allreduce_core import (
    AllReduceCore,
    AllReduceGroup,
    AveragingMode,
    Failure,
    Reject,
)

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX


def make_group(fractions, modes=()):
    return AllReduceGroup(
        b"gid", tuple(f"peer{i}" for i in range(len(fractions))), fractions, modes
    )


def make_cores(group, tensors_by_peer, weights=None, **kwargs):
    kwargs.setdefault("part_size_bytes", 64)
    weights = weights or [1.0] * group.size
    return [
        AllReduceCore(group, i, tensors_by_peer[i], weight=weights[i], now=0.0, **kwargs)
        for i in range(group.size)
    ]


def exchange(cores, *, skip_senders=(), skip_reducers=(), now=1.0, state=None):
    """Every sender streams every part to every remote reducer, in rounds of one part.

    ``state`` (a dict) carries which streams are open and which parts went out across calls.
    """
    state = {} if state is None else state
    opened, sent = state.setdefault("opened", set()), state.setdefault("sent", set())
    progress = True
    while progress:
        progress = False
        for s, sender in enumerate(cores):
            if s in skip_senders or not sender.is_sender:
                continue
            for r in sender.remote_reducers():
                reducer = cores[r]
                if r in skip_reducers or sender.container.reducer_done(r):
                    continue
                if (s, r) not in opened:
                    assert reducer.open_sender(s, b"gid", sender.weight, now) is None
                    opened.add((s, r))
                k = sender.container.num_received(r)
                if reducer.sender_banned(s):
                    continue
                if (s, r, k) not in sent:
                    outcome = reducer.receive_part(s, k, sender.container.input_part(r, k), now)
                    assert outcome.reject is None
                    sent.add((s, r, k))
                    progress = True
                if reducer.is_part_ready(k):
                    delta = reducer.delta_for(s, k, sender.container.input_part(r, k))
                    assert sender.receive_delta(r, k, delta, unchanged=delta is None, now=now)
                    reducer.result_sent(s, k, now)
                    progress = True


def weighted_mean(tensors_by_peer, weights, members):
    total = sum(weights[i] for i in members)
    return [
        sum(tensors_by_peer[i][t] * weights[i] for i in members) / total
        for t in range(len(tensors_by_peer[0]))
    ]


def random_tensors(n, shapes=((13, 7), (50,), (3, 3, 3))):
    return [[torch.randn(*s) for s in shapes] for _ in range(n)]


def test_four_nodes_exact_weighted_mean():
    group = make_group([0.1, 0.4, 0.2, 0.3])
    tensors, weights = random_tensors(4), [1.0, 2.0, 0.5, 0.0]
    cores = make_cores(group, tensors, weights)
    exchange(cores)
    want = weighted_mean(tensors, weights, range(4))
    for i, core in enumerate(cores):
        assert core.finished and core.statistics().finished
        for local, delta, mean in zip(tensors[i], core.deltas(), want, strict=True):
            torch.testing.assert_close(local + delta, mean)


def test_client_and_aux():
    group = make_group([0.5, 0.0, 0.25, 0.25], (NODE, CLIENT, AUX, NODE))
    tensors = random_tensors(4)
    cores = make_cores(group, tensors, [1.0, 3.0, 0.0, 1.0])
    assert cores[1].num_local_parts == 0 and not cores[2].is_sender
    assert cores[2].open_sender(2, b"gid", 1.0, 0.0) == Reject.NOT_A_SENDER
    assert cores[1].open_sender(0, b"gid", 1.0, 0.0) == Reject.NOT_A_REDUCER
    exchange(cores)
    want = weighted_mean(tensors, [1.0, 3.0, 0.0, 1.0], [0, 1, 3])
    assert cores[2].finished and cores[2].deltas() is None
    for i in (0, 1, 3):
        assert cores[i].finished
        for local, delta, mean in zip(tensors[i], cores[i].deltas(), want, strict=True):
            torch.testing.assert_close(local + delta, mean)


def test_a_sender_whose_first_request_crawls_in_is_not_banned_as_missing():
    """Over a lossy 300 ms path the first part takes longer than ``sender_timeout`` to arrive
    (the stream opens only then): bytes arriving keep its deadline moving; once they stop it
    is banned one ``sender_timeout`` later, and a silent sender still at ``sender_timeout``."""
    group = make_group([1, 1, 1])
    cores = make_cores(group, random_tensors(3), sender_timeout=5.0, reducer_timeout=10.0)
    core = cores[0]
    assert core.missing_senders_deadline == 5.0
    for second in range(1, 20):  # peer 1's first request: 40 KB/s for 19 s
        core.sender_arriving(1, 40_000, float(second))
    assert core.missing_senders_deadline == 5.0  # peer 2 sent nothing
    assert core.ban_missing_senders(5.0) == ()  # waits for peer 1's part 0 too
    assert core.banned_senders == {"peer2": Failure.TIMEOUT}
    assert core.missing_senders_deadline == 19.0 + 5.0
    assert core.open_sender(1, b"gid", 1.0, 20.0) is None  # it made it
    assert core.missing_senders_deadline == float("inf")
    assert core.ban_missing_senders(100.0) == ()
    assert "peer1" not in core.banned_senders
    core.sender_arriving(1, 1, 21.0)  # no-op once open


def test_a_first_request_that_stops_arriving_is_banned_one_timeout_later():
    group = make_group([1, 1])
    core = make_cores(group, random_tensors(2), sender_timeout=5.0, reducer_timeout=10.0)[0]
    core.sender_arriving(1, 100_000, 4.0)
    assert core.ban_missing_senders(8.9) == ()
    assert core.ban_missing_senders(9.0) != ()
    assert core.banned_senders == {"peer1": Failure.TIMEOUT}


def test_a_trickled_first_request_cannot_hold_the_round_open():
    """One byte per second keeps arriving, but buys only 1 / min_rate s each."""
    group = make_group([1, 1])
    core = make_cores(group, random_tensors(2), sender_timeout=5.0, reducer_timeout=10.0)[0]
    now = 0.0
    while not core.banned_senders:
        now += 1.0
        core.sender_arriving(1, 1, now)
        core.ban_missing_senders(now)
    assert now <= 6.0


def test_missing_sender_is_banned_after_sender_timeout():
    group = make_group([1, 1, 1])
    tensors = random_tensors(3)
    cores = make_cores(group, tensors, sender_timeout=5.0, reducer_timeout=10.0)
    state = {}
    exchange(cores, skip_senders={2}, skip_reducers={2}, state=state)
    assert not cores[0].reducing_finished
    assert cores[0].missing_senders_deadline == 5.0
    assert cores[0].ban_missing_senders(4.9) == ()
    assert cores[0].ban_missing_senders(5.0) == (0,)  # peer1 waits for part 0's result
    cores[1].ban_missing_senders(5.0)
    exchange(cores, skip_senders={2}, skip_reducers={2}, state=state)
    for i in (0, 1):
        assert cores[i].banned_senders == {"peer2": Failure.TIMEOUT}
        assert cores[i].reducer_deadline(2) == 10.0
        cores[i].fail_reducer(2, Failure.TIMEOUT)  # the dead reducer's slice stays local
        assert cores[i].finished
    want = weighted_mean(tensors, [1.0] * 3, [0, 1])
    for i in (0, 1):
        for t, (local, delta) in enumerate(zip(tensors[i], cores[i].deltas(), strict=True)):
            spec_ranges = [
                (p.start, p.stop) for p in cores[i].container.layout[2] if p.tensor_index == t
            ]
            result = (local + delta).reshape(-1)
            expected = want[t].reshape(-1).clone()
            for start, stop in spec_ranges:
                expected[start:stop] = local.reshape(-1)[start:stop]
            torch.testing.assert_close(result, expected)


def test_slow_sender_deadline_follows_its_last_result():
    group = make_group([1, 0.0], (NODE, CLIENT))
    core = make_cores(group, random_tensors(2), sender_timeout=2.0, reducer_timeout=3.0)[0]
    assert core.open_sender(1, b"gid", 1.0, now=1.0) is None
    assert core.sender_deadline(1) == 3.0
    part = core.container.input_part(0, 0)
    assert core.receive_part(1, 0, part, now=1.5).completed == (0,)
    core.result_sent(1, 0, now=2.5)
    assert core.sender_deadline(1) == 4.5
    assert core.ban_sender(1, Failure.TIMEOUT) == tuple(range(1, core.num_local_parts))
    assert core.finished
    assert core.receive_part(1, 1, part, now=5).reject == Reject.BANNED
    assert core.open_sender(1, b"gid", 1.0, now=5) == Reject.BANNED


def test_bad_parts_ban_the_sender():
    group = make_group([1, 0, 0, 0])
    core = make_cores(group, random_tensors(4))[0]
    for peer in (1, 2, 3):
        assert core.open_sender(peer, b"gid", 1.0, 0.0) is None
    assert core.open_sender(1, b"gid", 1.0, 0.0) == Reject.DUPLICATE_SENDER
    shape = core.local_part_shape(0)[0]
    assert core.receive_part(1, 0, torch.zeros(shape[0] + 1), 0.0).reject == Reject.BAD_PART
    assert core.receive_part(2, 1, torch.zeros(shape), 0.0).reject == Reject.BAD_PART
    assert core.receive_part(3, 0, None, 0.0).reject == Reject.BAD_PART  # undecodable
    assert set(core.banned_senders) == {"peer1", "peer2", "peer3"}
    assert core.finished  # only our own contribution is left: deltas are zero
    assert all(bool((d == 0).all()) for d in core.deltas())


def test_open_sender_rejections():
    group = make_group([1, 1], (NODE, NODE))
    core = make_cores(group, random_tensors(2))[0]
    assert core.open_sender(1, b"other", 1.0, 0.0) == Reject.BAD_GROUP_ID
    assert core.open_sender(None, b"gid", 1.0, 0.0) == Reject.NOT_A_SENDER
    assert core.open_sender(0, b"gid", 1.0, 0.0) == Reject.NOT_A_SENDER  # ourselves
    assert core.open_sender(1, b"gid", float("nan"), 0.0) == Reject.BAD_PART
    assert core.open_sender(1, b"gid", 1.0, 0.0) == Reject.BANNED


def test_bad_delta_fails_the_reducer_and_keeps_local_values():
    group = make_group([1, 1])
    tensors = random_tensors(2)
    core = make_cores(group, tensors)[0]
    numel = core.container.part_spec(1, 0).numel
    assert core.receive_delta(1, 0, torch.ones(numel), unchanged=False, now=1.0)
    assert core.reducer_deadline(1) == float("inf")
    assert not core.receive_delta(1, 1, torch.ones(numel + 1), unchanged=False, now=1.0)
    assert core.failed_reducers == {"peer1": Failure.BAD_DATA}
    assert not core.receive_delta(1, 1, torch.ones(numel), unchanged=False, now=1.0)


def test_zero_weights_keep_local_values():
    group = make_group([1, 1, 1])
    tensors = random_tensors(3)
    cores = make_cores(group, tensors, [0.0, 0.0, 0.0])
    exchange(cores)
    for core in cores:
        assert core.finished
        assert all(bool((d == 0).all()) and not d.isnan().any() for d in core.deltas())


def test_expire_fails_everything_pending():
    group = make_group([1, 1, 1])
    cores = make_cores(group, random_tensors(3), sender_timeout=1.0, reducer_timeout=2.0)
    assert cores[0].open_sender(1, b"gid", 1.0, 0.0) is None
    completed = cores[0].expire(now=100.0)
    assert completed == tuple(range(cores[0].num_local_parts))
    assert cores[0].finished
    assert cores[0].failed_reducers == {"peer1": Failure.DEADLINE, "peer2": Failure.DEADLINE}
    assert cores[0].banned_senders == {"peer1": Failure.DEADLINE, "peer2": Failure.DEADLINE}
    assert all(bool((d == 0).all()) for d in cores[0].deltas())


def test_group_and_core_validation():
    with pytest.raises(ValueError):
        make_group([0.0, 0.0])
    with pytest.raises(ValueError):
        make_group([1.0, 1.0], (NODE, CLIENT))
    with pytest.raises(ValueError):
        AllReduceGroup(b"", ("a",), (1.0,))
    with pytest.raises(ValueError):
        AllReduceGroup(b"g", ("a", "a"), (1.0, 1.0))
    with pytest.raises(ValueError):
        AllReduceGroup(b"g", ("a",), (1.0,), part_layout=99)
    one_part = AllReduceCore(
        AllReduceGroup(b"g", ("a",), (1.0,), part_layout=1), 0, [torch.zeros(99)]
    )
    assert one_part.num_local_parts == 1
    group = make_group([1.0])
    with pytest.raises(ValueError):
        AllReduceCore(group, 0, [torch.zeros(3)], sender_timeout=2.0, reducer_timeout=1.0)
    with pytest.raises(ValueError):
        AllReduceCore(group, 0, [torch.zeros(3)], weight=-1)
    with pytest.raises(ValueError):
        AllReduceCore(group, 1, [torch.zeros(3)])


def test_single_peer_is_done_at_once():
    core = AllReduceCore(make_group([1.0]), 0, [torch.randn(100)], part_size_bytes=64)
    assert core.finished and bool((core.deltas()[0] == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_part_bans_its_sender_and_never_enters_the_average(bad, dtype):
    group = make_group([1, 1, 1])
    tensors = [[t.to(dtype) for t in peer] for peer in random_tensors(3)]
    cores = make_cores(group, tensors)
    hostile, reducer = 2, cores[0]
    assert reducer.open_sender(hostile, b"gid", 1.0, 0.0) is None
    part = cores[hostile].container.input_part(0, 0).clone()
    part[len(part) // 2] = bad
    outcome = reducer.receive_part(hostile, 0, part, 0.0)
    assert outcome.reject == Reject.BAD_PART
    assert reducer.banned_senders == {"peer2": Failure.NON_FINITE}
    exchange(cores, skip_senders={hostile}, skip_reducers={hostile})
    for core in cores[:2]:
        deltas = core.deltas()
        assert all(bool(torch.isfinite(d).all()) for d in deltas)
    # peer 0's slice: the mean of the two honest peers, exactly as if peer 2 had failed
    spec = reducer.container.part_spec(0, 0)
    honest = [cores[i].container.input_part(0, 0).float() for i in (0, 1)]
    got = (
        reducer.container.input_part(0, 0).float()
        + reducer.deltas()[spec.tensor_index].reshape(-1)[spec.start : spec.stop].float()
    )
    torch.testing.assert_close(got, (honest[0] + honest[1]) / 2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_delta_fails_the_reducer_and_keeps_local_values(bad):
    group = make_group([1, 1])
    core = make_cores(group, random_tensors(2))[0]
    numel = core.container.part_spec(1, 0).numel
    delta = torch.ones(numel)
    delta[-1] = bad
    assert not core.receive_delta(1, 0, delta, unchanged=False, now=1.0)
    assert core.failed_reducers == {"peer1": Failure.NON_FINITE}
    for d in core.deltas():
        assert bool(torch.isfinite(d).all())
