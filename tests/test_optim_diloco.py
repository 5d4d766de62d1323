"""DiLoCoOptimizer: peers in threads over real DHTs on loopback, checked against references."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import inspect
import threading
import time
from collections.abc import Callable

import pytest
import torch
from polling import wait_for
from torch import nn

from swarmtrain.compression import Float16Compression, NoCompression
from swarmtrain.dht import DHT
from swarmtrain.optim._textdata import stdlib_text
from swarmtrain.optim.async_diloco import AsyncDiLoCoOptimizer
from swarmtrain.optim.diloco import DiLoCoOptimizer, pack_state, unpack_state
from swarmtrain.optim.diloco_core import OuterState
from swarmtrain.optim.diloco_simulation import (
    SimulationConfig,
    TinyTransformer,
    TinyTransformerConfig,
    _build,
    _loss,
    _samplers,
    default_inner_optimizer,
    run_diloco,
)
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
MODEL = TinyTransformerConfig(context=8, d_model=8, n_layers=1, n_heads=2)
# A round waits up to 1 s for a full group; averaging_timeout bounds matchmaking retries.
FAST = {"matchmaking_time": 1.0, "averaging_timeout": 10.0}


def model_factory() -> nn.Module:
    return TinyTransformer(MODEL)


@pytest.fixture(scope="module")
def data():
    return stdlib_text(100_000)


@pytest.fixture
def dhts():
    """``make(n)`` starts ``n`` more DHTs, all bootstrapped from the first; all closed after."""
    made: list[DHT] = []

    def make(n: int) -> list[DHT]:
        initial = made[0].get_visible_maddrs() if made else []
        new = []
        for _ in range(n):
            dht = DHT(initial, **HOST)
            initial = initial or dht.get_visible_maddrs()
            new.append(dht)
        made.extend(new)
        return new

    yield make
    for dht in reversed(made):
        dht.shutdown()
    assert BackgroundRuntime.active_references() == 0


def in_threads(functions: list[Callable[[], None]], timeout: float = 60) -> None:
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in functions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a peer hung"
    if errors:
        raise errors[0]


class Peer:
    """One worker of ``run_diloco``'s setup (same init, data shard, sampler and inner steps),
    with a networked DiLoCoOptimizer instead of the in-process average."""

    def __init__(self, config: SimulationConfig, index: int, dht: DHT, data, **kwargs):
        self.config = config
        self.model = copy.deepcopy(_build(config, model_factory))
        self.sampler = _samplers(config, data)[index]
        self.opt = DiLoCoOptimizer(
            self.model.parameters(),
            dht=dht,
            run_id=kwargs.pop("run_id", "test"),
            inner_optimizer=kwargs.pop("inner_optimizer", default_inner_optimizer),
            inner_steps=config.inner_steps,
            batch_size_per_step=config.batch_size,
            num_fragments=config.num_fragments,
            delay=config.delay,
            alpha=config.alpha,
            **{**FAST, **kwargs},
        )
        self.after_step: list[list[torch.Tensor]] = []  # local parameters after inner steps
        self.opt.inner_optimizer.register_step_post_hook(self._record)

    def _record(self, optimizer, args, kwargs) -> None:
        self.after_step.append([p.detach().clone() for p in self.model.parameters()])

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            _loss(self.model, self.sampler.next()).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
            self.opt.step()


def assert_params_close(got, want, **tolerance) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance)


# ------------------------------------------------------------------------------- vs references


@pytest.mark.parametrize(
    ("workers", "fragments", "inner_steps", "delay", "alpha"),
    [(3, 1, 3, 0, 0.0), (2, 1, 3, 1, 0.5), (3, 3, 3, 0, 0.0), (2, 2, 4, 1, 0.5)],
    ids=["3-peers", "2-peers-delayed", "3-peers-3-fragments", "2-peers-2-fragments-delayed"],
)
def test_networked_rounds_equal_run_diloco(
    data, dhts, workers, fragments, inner_steps, delay, alpha
):
    config = SimulationConfig(
        num_workers=workers,
        inner_steps=inner_steps,
        outer_steps=2,
        batch_size=4,
        context=MODEL.context,
        num_fragments=fragments,
        delay=delay,
        alpha=alpha,
        eval_windows=2,
    )
    # SGD inner steps: AdamW turns the last-bit differences between a butterfly all-reduce
    # and torch.mean (3e-8 after round 1) into 2e-4 after round 2 (m / sqrt(v) near v = 0).
    inner = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    reference = run_diloco(config, model_factory, data, inner_optimizer=inner)
    peers = [
        Peer(
            config,
            i,
            dht,
            data,
            inner_optimizer=inner,
            pseudo_grad_compression=NoCompression(),
            **_full(workers),
        )
        for i, dht in enumerate(dhts(workers))
    ]
    try:
        opt = peers[0].opt
        numels = [p.numel() for p in peers[0].model.parameters()]
        # Fragments cover every parameter exactly once, each averager holds its fragment.
        assert sorted(i for group in opt.fragments.groups for i in group) == list(
            range(len(numels))
        )
        assert len(opt.averagers) == fragments
        for averager, group in zip(opt.averagers, opt.fragments.groups, strict=True):
            with averager.get_tensors() as buffers:
                assert [b.numel() for b in buffers] == [numels[i] for i in group]

        in_threads([lambda p=p: p.train(config.total_steps) for p in peers])
        for peer in peers:
            peer.opt.wait_for_pending_rounds()  # run_diloco applies them at the end
            stats = peer.opt.statistics()
            rounds = 2 * fragments
            assert (stats.outer_step, stats.rounds_averaged, stats.rounds_alone) == (
                rounds,
                rounds,
                0,
            )
            assert stats.last_group_size == workers and stats.bytes_sent > 0
            last = stats.last_round
            assert last is not None and last.group_size == workers
            assert last.attempts - last.failed_attempts == 1  # retries are counted apart
            assert last.bytes_sent_as_sender - last.failed_bytes_as_sender > 0
            assert peer.opt.local_epoch == 2 and peer.opt.inner_step == config.total_steps
            assert_params_close(peer.opt.shared_parameters(), reference.params)
            if delay == 0 and fragments == 1:  # right after the outer step: the shared values
                assert_params_close([p.detach() for p in peer.model.parameters()], reference.params)
        # Bytes, counted as senders and as reducers: with NoCompression each peer sends the
        # others' slices and returns its own slice to each other peer, per round. A round may
        # have retried after a failed all-reduce attempt (a busy machine): exactly one attempt
        # per round succeeded, and the bytes of the failed ones are counted apart.
        stats = [peer.opt.statistics() for peer in peers]
        for s in stats:
            assert s.allreduce_attempts - s.failed_allreduce_attempts == 2 * fragments, s
        per_round = (workers - 1) * sum(numels) * 4
        assert_successful_bytes(stats, 2 * per_round)
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_fp16_pseudo_gradients(data, dhts):
    config = SimulationConfig(
        num_workers=2, inner_steps=4, outer_steps=1, batch_size=4, context=MODEL.context
    )
    exact = run_diloco(config, model_factory, data)
    reference = run_diloco(config, model_factory, data, codec=Float16Compression())
    peers = [Peer(config, i, dht, data, **_full(2)) for i, dht in enumerate(dhts(2))]
    assert isinstance(peers[0].opt.averager.config.compression, Float16Compression)
    try:
        in_threads([lambda p=p: p.train(config.total_steps) for p in peers])
        shared = [p.opt.shared_parameters() for p in peers]
    finally:
        for peer in peers:
            peer.opt.shutdown()
    # A reducer keeps its own part of the average in fp32 and sends it to the others in fp16:
    # peers' results differ by fp16 rounding (times the outer lr).
    assert_params_close(shared[0], shared[1], rtol=1e-3, atol=1e-5)
    assert_params_close(shared[0], reference.params, rtol=1e-3, atol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(shared[0], exact.params, strict=True))
    assert peers[0].opt.statistics().bytes_sent < 0.6 * _fp32_bytes(shared[0])


def assert_successful_bytes(stats, expected: int) -> None:
    """The peers' bytes of successful all-reduce attempts, as senders and as reducers, are
    ``expected`` each; failed attempts' bytes are part of the totals, never more."""
    for sent, failed in (
        ("bytes_sent_as_sender", "failed_bytes_as_sender"),
        ("bytes_sent_as_reducer", "failed_bytes_as_reducer"),
    ):
        assert all(0 <= getattr(s, failed) <= getattr(s, sent) for s in stats)
        assert sum(getattr(s, sent) - getattr(s, failed) for s in stats) == expected, stats
    for s in stats:
        assert s.bytes_sent == s.bytes_sent_as_sender + s.bytes_sent_as_reducer
        if s.failed_allreduce_attempts == 0:
            assert s.failed_bytes_as_sender == s.failed_bytes_as_reducer == 0


def _full(n: int) -> dict:
    return {"target_group_size": n, "min_group_size": n}


def _fp32_bytes(tensors) -> int:
    return sum(t.numel() * 4 for t in tensors)


def hand_computed_round(outer_state: dict, local_params: list[list[torch.Tensor]]):
    """The shared parameters after one outer step with the mean pseudo-gradient of the peers."""
    reference = OuterState([p.clone() for p in outer_state["params"]])
    reference.load_state_dict(outer_state)
    pseudo_gradients = [reference.pseudo_gradient(params) for params in local_params]
    mean = [torch.stack(group).mean(dim=0) for group in zip(*pseudo_gradients, strict=True)]
    return reference.apply_outer_step(mean)


# ------------------------------------------------------------------------------- elasticity


def test_leaver_is_absent_from_the_next_round(data, dhts):
    config = SimulationConfig(
        num_workers=3, inner_steps=3, outer_steps=2, batch_size=4, context=MODEL.context
    )
    group = {"target_group_size": 3, "min_group_size": 2}
    peers = [
        Peer(config, i, dht, data, pseudo_grad_compression=NoCompression(), **group)
        for i, dht in enumerate(dhts(3))
    ]
    try:
        in_threads([lambda p=p: p.train(config.inner_steps) for p in peers])
        assert [p.opt.statistics().last_group_size for p in peers] == [3, 3, 3]
        before = peers[0].opt.state_dict()["outer"]
        peers[2].opt.shutdown()  # leaves between rounds
        started = time.monotonic()
        in_threads([lambda p=p: p.train(config.inner_steps) for p in peers[:2]])
        elapsed = time.monotonic() - started
        want = hand_computed_round(before, [p.after_step[-1] for p in peers[:2]])
        for peer in peers[:2]:
            stats = peer.opt.statistics()
            assert (stats.outer_step, stats.rounds_averaged, stats.last_group_size) == (2, 2, 2)
            assert_params_close(peer.opt.shared_parameters(), want)
    finally:
        for peer in peers:
            peer.opt.shutdown()
    assert elapsed < 12, elapsed  # the two form a group once the matchmaking time (1 s) ends


def test_joiner_loads_the_outer_state_then_takes_part(data, dhts):
    config = SimulationConfig(
        num_workers=3, inner_steps=3, outer_steps=2, batch_size=4, context=MODEL.context
    )
    group = {"target_group_size": 3, "min_group_size": 2}
    first, second, third = dhts(3)
    peers = [
        Peer(config, i, dht, data, pseudo_grad_compression=NoCompression(), **group)
        for i, dht in enumerate((first, second))
    ]
    try:
        in_threads([lambda p=p: p.train(config.inner_steps) for p in peers])
        assert [p.opt.statistics().last_group_size for p in peers] == [2, 2]
        shared = peers[0].opt.shared_parameters()
        joiner = Peer(
            dataclasses.replace(config, seed=99),  # other initial parameters
            2,
            third,
            data,
            pseudo_grad_compression=NoCompression(),
            **group,
        )
        peers.append(joiner)
        assert not torch.equal(next(joiner.model.parameters()).detach(), shared[0])
        assert joiner.opt.load_state_from_peers(timeout=10)
        assert joiner.opt.outer_step == 1 and joiner.opt.inner_step == config.inner_steps
        # (from either donor: their results differ in the last bit, the averager adding deltas)
        assert_params_close(joiner.opt.shared_parameters(), shared, rtol=0, atol=1e-7)
        assert_params_close([p.detach() for p in joiner.model.parameters()], shared)
        # Same momentum too: the next hand-computed round starts from the joiner's state.
        before = joiner.opt.state_dict()["outer"]
        assert before["optimizer"]["state"], "the outer momentum was not transferred"

        in_threads([lambda p=p: p.train(config.inner_steps) for p in peers])
        want = hand_computed_round(before, [p.after_step[-1] for p in peers])
        for peer in peers:
            stats = peer.opt.statistics()
            assert stats.outer_step == 2 and stats.last_group_size == 3
            assert_params_close(peer.opt.shared_parameters(), want)
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_streaming_peer_dies_during_a_round(data, dhts):
    config = SimulationConfig(
        num_workers=3,
        inner_steps=4,
        outer_steps=2,
        batch_size=4,
        context=MODEL.context,
        num_fragments=2,
        delay=1,
    )
    group = {
        "target_group_size": 3,
        "min_group_size": 2,
        "averager_opts": {"next_chunk_timeout": 2.0},
    }
    peers = [Peer(config, i, dht, data, **group) for i, dht in enumerate(dhts(3))]
    try:
        in_threads([lambda p=p: p.train(1) for p in peers])

        def die() -> None:
            peers[2].train(1)  # fragment 0's round starts after step 2, in the background
            assert 0 in peers[2].opt._impl._pending
            time.sleep(0.2)  # matchmaking or all-reduce under way
            peers[2].opt.shutdown()

        started = time.monotonic()
        in_threads([lambda p=p: p.train(config.total_steps - 1) for p in peers[:2]] + [die])
        elapsed = time.monotonic() - started
        for peer in peers[:2]:
            peer.opt.wait_for_pending_rounds()
            stats = peer.opt.statistics()
            # Every round of both fragments was applied (averaged, or alone if it failed) and
            # the survivors averaged as a pair once the dead peer was gone.
            assert stats.outer_step == 4 and stats.rounds_averaged + stats.rounds_alone == 4
            assert stats.rounds_averaged >= 3 and stats.last_group_size == 2
            assert all(torch.isfinite(p).all() for p in peer.opt.shared_parameters())
    finally:
        for peer in peers:
            peer.opt.shutdown()
    assert elapsed < 40, elapsed


def test_streaming_joiner_loads_the_state_mid_run(data, dhts):
    config = SimulationConfig(
        num_workers=3,
        inner_steps=4,
        outer_steps=3,
        batch_size=4,
        context=MODEL.context,
        num_fragments=2,
        delay=1,
    )
    group = {"target_group_size": 3, "min_group_size": 2}
    first, second, third = dhts(3)
    peers = [
        Peer(config, i, dht, data, pseudo_grad_compression=NoCompression(), **group)
        for i, dht in enumerate((first, second))
    ]
    try:
        # Fragment 0 syncs after step 2 (applied at 3), fragment 1 after 4 (applied at 5):
        # after step 5 no round is in flight and a donor can hand out its state.
        in_threads([lambda p=p: p.train(5) for p in peers])
        shared = peers[0].opt.shared_parameters()
        joiner = Peer(
            dataclasses.replace(config, seed=99),
            2,
            third,
            data,
            pseudo_grad_compression=NoCompression(),
            **group,
        )
        peers.append(joiner)
        assert joiner.opt.load_state_from_peers(timeout=10)
        assert (joiner.opt.outer_step, joiner.opt.inner_step) == (2, 5)
        assert_params_close(joiner.opt.shared_parameters(), shared, rtol=0, atol=1e-7)
        assert_params_close([p.detach() for p in joiner.model.parameters()], shared)

        in_threads([lambda p=p: p.train(config.total_steps - 5) for p in peers])
        for peer in peers:
            peer.opt.wait_for_pending_rounds()
        results = [peer.opt.shared_parameters() for peer in peers]
        for peer, result in zip(peers, results, strict=True):
            stats = peer.opt.statistics()
            assert stats.inner_step == config.total_steps and stats.outer_step == 6
            assert stats.last_group_size == 3
            assert_params_close(result, results[0], rtol=0, atol=1e-6)
        assert joiner.opt.statistics().rounds_averaged == 4
        assert not all(torch.equal(a, b) for a, b in zip(results[0], shared, strict=True))
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_alone_applies_the_local_pseudo_gradient(data, dhts):
    config = SimulationConfig(
        num_workers=1, inner_steps=2, outer_steps=1, batch_size=4, context=MODEL.context
    )
    (dht,) = dhts(1)
    peer = Peer(config, 0, dht, data, min_group_size=2, matchmaking_time=0.5, averaging_timeout=1.0)
    try:
        before = peer.opt.state_dict()["outer"]
        peer.train(2)
        want = hand_computed_round(before, [peer.after_step[-1]])
        stats = peer.opt.statistics()
        assert (stats.rounds_alone, stats.rounds_averaged, stats.last_group_size) == (1, 0, 1)
        assert stats.bytes_sent == 0 and stats.outer_step == 1
        assert_params_close(peer.opt.shared_parameters(), want)
        assert_params_close([p.detach() for p in peer.model.parameters()], want)
    finally:
        peer.opt.shutdown()


# ------------------------------------------------------------------------------- no network


def test_state_packs_and_unpacks():
    params = [torch.randn(3, 2), torch.randn(4)]
    outer = OuterState(params)
    outer.apply_outer_step([torch.ones(3, 2), torch.ones(4)])
    metadata, tensors = pack_state(outer, inner_step=7)
    assert len(tensors) == 4  # two parameters and their momentum buffers
    state, inner_step = unpack_state(metadata, [t.clone() for t in tensors])
    fresh = OuterState([torch.zeros(3, 2), torch.zeros(4)])
    fresh.load_state_dict(state)
    assert inner_step == 7 and fresh.outer_step == 1
    step = [torch.full((3, 2), 0.5), torch.full((4,), 0.5)]
    assert_params_close(fresh.apply_outer_step(step), outer.apply_outer_step(step))
    with pytest.raises(ValueError, match="not a"):
        unpack_state({"format": "other"}, tensors)
    with pytest.raises(ValueError, match="out of range"):
        unpack_state(metadata, tensors[:3])


def test_constructor_validates_before_touching_the_network():
    params = [nn.Parameter(torch.zeros(2))]
    base = {"dht": None, "run_id": "r", "inner_steps": 4}
    with pytest.raises(ValueError, match="divide"):
        DiLoCoOptimizer(params, **{**base, "inner_steps": 5}, num_fragments=2)
    with pytest.raises(ValueError, match="fragments"):  # more fragments than parameters
        DiLoCoOptimizer(params, **base, num_fragments=2)
    with pytest.raises(ValueError, match="delay"):
        DiLoCoOptimizer(params, **base, delay=4)
    with pytest.raises(ValueError, match="alpha"):
        DiLoCoOptimizer(params, **base, alpha=1.0)
    with pytest.raises(ValueError, match="run_id"):
        DiLoCoOptimizer(params, **{**base, "run_id": "a.b"})
    with pytest.raises(TypeError, match="inner_steps"):
        DiLoCoOptimizer(params, **{**base, "inner_steps": 2.5})
    with pytest.raises(ValueError, match="instance"):
        DiLoCoOptimizer(
            [nn.Parameter(torch.zeros(1))],
            **base,
            inner_optimizer=torch.optim.SGD(params, lr=0.1),
        )
    with pytest.raises(TypeError, match="codec"):
        DiLoCoOptimizer(params, **base, pseudo_grad_compression="fp16")
    with pytest.raises(TypeError, match="inner_stepz"):  # a misspelt keyword names itself
        DiLoCoOptimizer(params, **base, inner_stepz=4)


def test_the_blocking_class_shows_the_implementations_keywords():
    shown = inspect.signature(DiLoCoOptimizer)
    implementation = inspect.signature(AsyncDiLoCoOptimizer)
    assert list(shown.parameters) == list(implementation.parameters)
    assert shown.parameters["matchmaking_time"].default == 15.0


# ------------------------------------------------------------------------ defaults, edges


def test_step_after_shutdown_raises(data, dhts):
    config = SimulationConfig(num_workers=1, inner_steps=2, batch_size=4, context=MODEL.context)
    (dht,) = dhts(1)
    peer = Peer(config, 0, dht, data)
    peer.train(1)
    peer.opt.shutdown()
    peer.opt.shutdown()  # a second call does nothing
    with pytest.raises(RuntimeError, match="this DiLoCoOptimizer was shut down"):
        peer.train(1)
    with pytest.raises(RuntimeError, match="this DiLoCoOptimizer was shut down"):
        peer.opt.load_state_from_peers()
    assert peer.opt.inner_step == 1


# The constructor's defaults: matchmaking_time=15, averaging_timeout=60, load_state_timeout=60.
DEFAULTS = {"matchmaking_time": 15.0, "averaging_timeout": 60.0, "load_state_timeout": 60.0}


def test_lone_peer_with_defaults_never_waits(data, dhts):
    config = SimulationConfig(num_workers=1, inner_steps=2, batch_size=4, context=MODEL.context)
    (dht,) = dhts(1)
    peer = Peer(config, 0, dht, data, **DEFAULTS)
    try:
        started = time.monotonic()
        assert not peer.opt.load_state_from_peers()  # nobody to load from: at once
        assert time.monotonic() - started < 3
        before = peer.opt.state_dict()["outer"]
        started = time.monotonic()
        peer.train(2 * config.inner_steps)  # two lone outer rounds
        elapsed = time.monotonic() - started
        stats = peer.opt.statistics()
        assert (stats.rounds_alone, stats.rounds_averaged, stats.outer_step) == (2, 0, 2)
        assert stats.seconds_waiting < 1
        assert before["outer_step"] == 0
    finally:
        peer.opt.shutdown()
    assert elapsed < 5, elapsed  # was 2 x 60 s


def test_two_peers_with_defaults_average_as_soon_as_both_joined(data, dhts, caplog):
    config = SimulationConfig(
        num_workers=2, inner_steps=2, outer_steps=2, batch_size=4, context=MODEL.context
    )
    peers = [Peer(config, i, dht, data, **DEFAULTS) for i, dht in enumerate(dhts(2))]  # fp16
    try:
        started = time.monotonic()
        in_threads([lambda p=p: p.train(2 * config.inner_steps) for p in peers], timeout=60)
        elapsed = time.monotonic() - started
        for peer in peers:
            stats = peer.opt.statistics()
            assert (stats.rounds_averaged, stats.rounds_alone, stats.last_group_size) == (2, 0, 2)
        shared = [p.opt.shared_parameters() for p in peers]
        assert_params_close(shared[0], shared[1], rtol=1e-3, atol=1e-5)  # fp16 rounding
        # ... which the fingerprints tolerate: nobody reloads
        assert not [r for r in caplog.records if "shared parameters differ" in r.getMessage()]
    finally:
        for peer in peers:
            peer.opt.shutdown()
    assert elapsed < 12, elapsed  # was 2 x 15 s of matchmaking_time


def test_peers_from_different_seeds_adopt_one_shared_state(data, dhts, caplog):
    config = SimulationConfig(
        num_workers=3, inner_steps=2, outer_steps=2, batch_size=4, context=MODEL.context
    )
    peers = [
        Peer(
            dataclasses.replace(config, seed=seed),
            i,
            dht,
            data,
            pseudo_grad_compression=NoCompression(),
            **_full(3),
        )
        for i, (seed, dht) in enumerate(zip((1, 2, 3), dhts(3), strict=True))
    ]
    try:
        firsts = [next(p.model.parameters()).detach().clone() for p in peers]
        assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])
        in_threads([lambda p=p: p.train(config.inner_steps) for p in peers], timeout=60)
        shared = [p.opt.shared_parameters() for p in peers]
        for other in shared[1:]:
            assert_params_close(other, shared[0], rtol=0, atol=1e-6)
        for peer in peers:
            assert_params_close([p.detach() for p in peer.model.parameters()], shared[0])
        warned = [r for r in caplog.records if "shared parameters differ" in r.getMessage()]
        assert len(warned) == 2, [r.getMessage() for r in warned]  # the two that loaded
        # From then on they are one swarm: the next round averages and nobody reloads.
        in_threads([lambda p=p: p.train(config.inner_steps) for p in peers], timeout=60)
        shared = [p.opt.shared_parameters() for p in peers]
        for other in shared[1:]:
            assert_params_close(other, shared[0], rtol=0, atol=1e-6)
        assert all(p.opt.statistics().rounds_averaged == 2 for p in peers)
        warned = [r for r in caplog.records if "shared parameters differ" in r.getMessage()]
        assert len(warned) == 2
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_nan_pseudo_gradient_is_never_sent_and_the_peer_restarts_from_shared(data, dhts, caplog):
    config = SimulationConfig(
        num_workers=2, inner_steps=2, outer_steps=1, batch_size=4, context=MODEL.context
    )
    peers = [
        Peer(config, i, dht, data, pseudo_grad_compression=Float16Compression(), **_full(2))
        for i, dht in enumerate(dhts(2))
    ]
    try:
        shared_before = peers[1].opt.shared_parameters()

        def poisoned():
            peers[1].train(1)
            with torch.no_grad():
                next(peers[1].model.parameters()).fill_(float("nan"))
            peers[1].train(1)

        in_threads([lambda: peers[0].train(config.inner_steps), poisoned], timeout=60)
        clean = peers[0].opt.shared_parameters()
        assert all(bool(torch.isfinite(p).all()) for p in clean)
        assert all(bool(torch.isfinite(p).all()) for p in peers[0].model.parameters())
        # the poisoned peer kept the shared parameters and restarted its model from them
        assert_params_close(peers[1].opt.shared_parameters(), shared_before, rtol=0, atol=0)
        assert_params_close([p.detach() for p in peers[1].model.parameters()], shared_before)
        assert any("holds NaN or inf" in r.getMessage() for r in caplog.records)
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_a_peer_a_round_behind_loads_the_state_and_rejoins_the_rounds(data, dhts):
    """Rounds are keyed by their number: a peer that missed one (the others left it without
    waiting for it) used to wait out its matchmaking alone in that round and in every later
    one, one round behind for good (the DiLoCo churn soak, issue 18). It now sees from the
    others' presence records that they finished its round, steps alone at once, loads their
    state (their inner step count) and averages with them from the next round on."""
    config = SimulationConfig(num_workers=3, inner_steps=3, batch_size=4, context=MODEL.context)
    h = config.inner_steps
    peers = [
        Peer(config, i, dht, data, pseudo_grad_compression=NoCompression())
        for i, dht in enumerate(dhts(3))
    ]
    lagger = peers[2]
    try:
        in_threads([lambda p=p: p.train(h) for p in peers[:2]])  # round 0 without the third
        assert [p.opt.statistics().last_group_size for p in peers] == [2, 2, 0]
        # round 1 of the first two; the third reaches its round 0 once they declared round 1
        caught_up_in = []

        def lag() -> None:
            wait_for(
                lambda: sorted(p.step or 0 for p in lagger.opt.presence.others()) == [2 * h] * 2,
                20,
                "the others' round-1 declarations",
            )
            started = time.monotonic()
            lagger.train(h)
            caught_up_in.append(time.monotonic() - started)

        in_threads([lambda p=p: p.train(h) for p in peers[:2]] + [lag])
        stats = lagger.opt.statistics()
        assert (stats.rounds_alone, stats.states_caught_up) == (1, 1), stats
        assert lagger.opt.inner_step == 2 * h and lagger.opt.outer_step == 2
        assert caught_up_in[0] < 8, caught_up_in  # no matchmaking wait (averaging_timeout 10 s)

        in_threads([lambda p=p: p.train(h) for p in peers])  # round 2: all three
        assert [p.opt.statistics().last_group_size for p in peers] == [3, 3, 3]
        shared = [p.opt.shared_parameters() for p in peers]
        for other in shared[1:]:
            assert_params_close(other, shared[0], rtol=0, atol=1e-6)
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_asyncio_awaitables_run_the_trio_implementation(data, dhts):
    """``opt.aio``: the trio methods awaited from asyncio on the background loop (a lone peer:
    two outer rounds alone), then ``aio.shutdown``."""
    config = SimulationConfig(num_workers=1, inner_steps=2, batch_size=4, context=MODEL.context)
    (dht,) = dhts(1)
    peer = Peer(config, 0, dht, data)

    async def main() -> None:
        assert not await peer.opt.aio.load_state_from_peers()  # nobody serves a state
        for _ in range(2 * config.inner_steps):
            peer.opt.zero_grad()
            _loss(peer.model, peer.sampler.next()).backward()
            await peer.opt.aio.step()
        await peer.opt.aio.wait_for_pending_rounds()
        state = await peer.opt.aio.state_dict()
        assert state["inner_step"] == 2 * config.inner_steps
        await peer.opt.aio.shutdown()

    asyncio.run(main())
    stats = peer.opt.statistics()
    assert (stats.rounds_alone, stats.outer_step) == (2, 2)
    with pytest.raises(RuntimeError, match="shut down"):
        peer.opt.step()
