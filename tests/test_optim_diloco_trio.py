"""The trio ``DiLoCoOptimizer`` (``async with DiLoCoOptimizer.create(...)``,
``AsyncDiLoCoOptimizer``): real peers on loopback, each a trio task of one test run.

No background loop thread is involved (``BackgroundRuntime`` stays unused), the presence
record is refreshed by a task (no thread), and the networked rounds equal ``run_diloco``'s
in-process reference, as the blocking facade's do (``test_optim_diloco.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading

import pytest
import torch
import trio
from polling import wait_until
from swarm_util import open_dhts
from test_optim_diloco import (
    FAST,
    MODEL,
    _full,
    assert_params_close,
    assert_successful_bytes,
    model_factory,
)
from torch import nn

from swarmtrain.compression import NoCompression
from swarmtrain.optim import AsyncDiLoCoOptimizer, DiLoCoOptimizer
from swarmtrain.optim._textdata import stdlib_text
from swarmtrain.optim.diloco_peers import RunPresence
from swarmtrain.optim.diloco_simulation import (
    SimulationConfig,
    _build,
    _loss,
    _samplers,
    run_diloco,
)
from swarmtrain.utils.background import BackgroundRuntime

INNER = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def data():
    return stdlib_text(100_000)


class TrioPeer:
    """One worker of ``run_diloco``'s setup with a trio DiLoCo optimizer."""

    def __init__(self, config: SimulationConfig, index: int, data) -> None:
        self.config = config
        self.model = copy.deepcopy(_build(config, model_factory))
        self.sampler = _samplers(config, data)[index]

    def options(self, dht, **kwargs) -> dict:
        return {
            "dht": dht,
            "run_id": "trio_diloco",
            "inner_optimizer": INNER,
            "inner_steps": self.config.inner_steps,
            "batch_size_per_step": self.config.batch_size,
            "num_fragments": self.config.num_fragments,
            "delay": self.config.delay,
            "alpha": self.config.alpha,
            "pseudo_grad_compression": NoCompression(),
            **FAST,
            **kwargs,
        }

    async def train(self, opt: AsyncDiLoCoOptimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            _loss(self.model, self.sampler.next()).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
            await opt.step()


async def train_together(peers, dhts, steps: int, **kwargs) -> list:
    """Each peer in its own task; the optimizers' statistics and shared parameters after."""
    results: list = [None] * len(peers)
    created = [trio.Event() for _ in peers]
    done = [trio.Event() for _ in peers]

    async def run(i: int) -> None:
        peer = peers[i]
        async with DiLoCoOptimizer.create(
            peer.model.parameters(), **peer.options(dhts[i], **kwargs)
        ) as opt:
            assert isinstance(opt, AsyncDiLoCoOptimizer)
            created[i].set()
            for event in created:  # everyone declared present before the first round
                await event.wait()
            await peer.train(opt, steps)
            await opt.wait_for_pending_rounds()
            results[i] = (opt.statistics(), opt.shared_parameters(), opt.local_epoch)
            done[i].set()
            for event in done:  # stay in the swarm until everyone is done
                await event.wait()

    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            for i in range(len(peers)):
                nursery.start_soon(run, i)
    return results


@pytest.mark.trio
@pytest.mark.parametrize(
    ("workers", "fragments", "delay", "alpha"),
    [(3, 3, 0, 0.0), (2, 1, 1, 0.5)],
    ids=["3-peers-3-fragments", "2-peers-delayed"],
)
async def test_trio_peers_equal_run_diloco(data, workers, fragments, delay, alpha):
    config = SimulationConfig(
        num_workers=workers,
        inner_steps=3,
        outer_steps=2,
        batch_size=4,
        context=MODEL.context,
        num_fragments=fragments,
        delay=delay,
        alpha=alpha,
        eval_windows=2,
    )
    reference = run_diloco(config, model_factory, data, inner_optimizer=INNER)
    peers = [TrioPeer(config, i, data) for i in range(workers)]
    threads_before = threading.active_count()
    async with open_dhts(workers) as dhts:
        results = await train_together(peers, dhts, config.total_steps, **_full(workers))
    assert BackgroundRuntime.active_references() == 0  # no background loop was involved
    assert threading.active_count() <= threads_before + 8  # (trio's idle worker threads)
    rounds = 2 * fragments
    for stats, shared, epoch in results:
        assert (stats.outer_step, stats.rounds_averaged, stats.rounds_alone) == (rounds, rounds, 0)
        assert stats.last_group_size == workers and epoch == 2
        assert stats.allreduce_attempts - stats.failed_allreduce_attempts == rounds, stats
        assert_params_close(shared, reference.params)
    numels = [p.numel() for p in peers[0].model.parameters()]
    assert_successful_bytes([r[0] for r in results], 2 * (workers - 1) * sum(numels) * 4)


@pytest.mark.trio
async def test_a_trio_joiner_loads_the_state_then_averages(data):
    config = SimulationConfig(num_workers=2, inner_steps=2, batch_size=4, context=MODEL.context)
    first, joiner = (
        TrioPeer(config, 0, data),
        TrioPeer(dataclasses.replace(config, seed=7), 1, data),
    )
    async with open_dhts(2) as dhts:
        async with DiLoCoOptimizer.create(
            first.model.parameters(), **first.options(dhts[0])
        ) as opt0:
            with trio.fail_after(30):
                assert not await opt0.load_state_from_peers()  # alone: at once
                await first.train(opt0, 2)  # one lone outer step
            assert opt0.statistics().rounds_alone == 1
            async with DiLoCoOptimizer.create(
                joiner.model.parameters(), **joiner.options(dhts[1])
            ) as opt1:
                with trio.fail_after(30):
                    assert await opt1.load_state_from_peers()
                assert opt1.inner_step == 2 and opt1.outer_step == 1
                assert_params_close(opt1.shared_parameters(), opt0.shared_parameters())
                assert_params_close(
                    [p.detach() for p in joiner.model.parameters()], opt0.shared_parameters()
                )
                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(first.train, opt0, 2)
                        nursery.start_soon(joiner.train, opt1, 2)
                for opt in (opt0, opt1):
                    assert opt.statistics().last_group_size == 2
                assert_params_close(
                    opt0.shared_parameters(), opt1.shared_parameters(), rtol=0, atol=1e-6
                )
                state = await opt1.state_dict()
        assert state["inner_step"] == 4
    assert BackgroundRuntime.active_references() == 0


@pytest.mark.trio
async def test_a_lone_trio_peer_steps_alone_and_raises_after_close(data):
    config = SimulationConfig(num_workers=1, inner_steps=2, batch_size=4, context=MODEL.context)
    peer = TrioPeer(config, 0, data)
    async with open_dhts(1) as (dht,):
        async with DiLoCoOptimizer.create(
            peer.model.parameters(), **peer.options(dht, matchmaking_time=15.0)
        ) as opt:
            with trio.fail_after(10):  # no matchmaking wait: nobody else is present
                await peer.train(opt, 4)
            stats = opt.statistics()
            assert (stats.rounds_alone, stats.rounds_averaged, stats.outer_step) == (2, 0, 2)
            assert stats.allreduce_attempts == 0 and stats.last_round.attempts == 0
            assert await opt.presence.others() == []
        with pytest.raises(RuntimeError, match="shut down"):
            await opt.step()
        with pytest.raises(TypeError, match=r"DiLoCoOptimizer\.create"):  # the blocking class
            DiLoCoOptimizer(peer.model.parameters(), **peer.options(dht))


@pytest.mark.trio
async def test_a_trio_step_with_a_heavy_inner_step_leaves_the_loop_running(data):
    """A closure (the forward and backward pass) runs in a worker thread with the inner step:
    the loop ticks meanwhile."""
    config = SimulationConfig(num_workers=1, inner_steps=100, batch_size=4, context=MODEL.context)
    peer = TrioPeer(config, 0, data)
    release = threading.Event()
    ticks = 0

    def closure():
        release.wait(10)
        loss = _loss(peer.model, peer.sampler.next())
        loss.backward()
        return loss

    async def tick() -> None:
        nonlocal ticks
        while not release.is_set():
            ticks += 1
            if ticks >= 5:
                release.set()
            await trio.sleep(0.01)

    async with open_dhts(1) as (dht,):
        async with DiLoCoOptimizer.create(peer.model.parameters(), **peer.options(dht)) as opt:
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(tick)
                    opt.zero_grad()
                    loss = await opt.step(closure)
    assert ticks >= 5 and torch.isfinite(loss) and opt.inner_step == 1


@pytest.mark.trio
async def test_a_step_cancelled_in_its_round_leaves_the_optimizer_usable(data):
    """The other peer is present but never trains: the round waits in matchmaking, and the
    step is cancelled there. The round steps alone at once (nothing left in flight), and the
    next round starts and is cancelled the same way."""
    config = SimulationConfig(num_workers=2, inner_steps=2, batch_size=4, context=MODEL.context)
    peer, idle = TrioPeer(config, 0, data), TrioPeer(config, 1, data)
    async with open_dhts(2) as dhts:
        async with (
            DiLoCoOptimizer.create(peer.model.parameters(), **peer.options(dhts[0])) as opt,
            DiLoCoOptimizer.create(idle.model.parameters(), **idle.options(dhts[1])),
        ):
            for round_ in (1, 2):
                with trio.fail_after(10):
                    await peer.train(opt, config.inner_steps - 1)
                with trio.move_on_after(0.5) as scope:  # matchmaking_time is 1 s
                    await peer.train(opt, 1)
                assert scope.cancelled_caught
                stats = opt.statistics()
                assert (stats.rounds_alone, stats.outer_step) == (round_, round_), stats
                assert stats.last_round.group_size == 1 and not opt._pending
            assert opt.inner_step == 2 * config.inner_steps


@pytest.mark.trio
async def test_a_peer_waiting_in_a_round_the_others_finished_gives_up_at_once(data):
    """A peer one round behind (the others finished its round while it waited for them, e.g.
    after a slow start behind NATs) stops waiting when their presence records say so, instead
    of waiting out ``averaging_timeout``; then it steps alone."""
    config = SimulationConfig(num_workers=1, inner_steps=2, batch_size=4, context=MODEL.context)
    peer = TrioPeer(config, 0, data)
    async with open_dhts(2) as (dht, other_dht):
        # the other peer: present in the run, never in this round (a non-donor: no state)
        async with RunPresence.create(other_dht, "trio_diloco", donor=False) as other:
            options = peer.options(dht, matchmaking_time=30.0, averaging_timeout=120.0)
            async with DiLoCoOptimizer.create(peer.model.parameters(), **options) as opt:
                seen: list = []

                async def sees_the_other() -> bool:
                    seen[:] = await opt.presence.others()
                    return len(seen) == 1

                with trio.fail_after(30):
                    while not await sees_the_other():  # noqa: ASYNC110 (a DHT read)
                        await trio.sleep(0.1)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(peer.train, opt, 2)  # the 2nd step starts the round
                    with trio.fail_after(30):
                        await wait_until(lambda: 0 in opt._pending)
                    with trio.fail_after(30):  # launched: waiting in matchmaking for the other
                        await wait_until(lambda: opt._pending[0].control is not None)
                    started = trio.current_time()
                    # ... which finished this round
                    other.declare_step(opt._pending[0].start_step)
                    with trio.fail_after(30):  # far below averaging_timeout, matchmaking_time
                        await wait_until(lambda: 0 not in opt._pending)
                waited = trio.current_time() - started
                stats = opt.statistics()
                assert (stats.rounds_alone, stats.rounds_averaged) == (1, 0)
                assert stats.last_round.group_size == 1
                assert waited < 30
