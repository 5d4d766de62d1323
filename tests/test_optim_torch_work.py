"""``TorchWork`` (``swarmtrain.optim._torch_work``): an epoch end's small CPU torch work runs in
place on the loop, anything else (a lock held, a lock that cannot tell, GPU or large tensors) in
a worker thread; and a real lone trio optimizer's epoch ends take no thread hop."""

from __future__ import annotations

import threading

import pytest
import torch
import trio
from swarm_util import open_dhts
from test_optim_trio import BATCH, Trainer, options

from swarmtrain.optim import Optimizer
from swarmtrain.optim._torch_work import INLINE_TORCH_MAX_BYTES, TorchWork, small_cpu_tensors


class _CannotTell:
    """A lock without ``locked()`` (as a helper process's ``multiprocessing`` lock)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass


def test_small_cpu_tensors_only():
    limit = INLINE_TORCH_MAX_BYTES // 4  # fp32 values
    assert small_cpu_tensors([torch.zeros(limit // 2), torch.zeros(limit // 2)])
    assert not small_cpu_tensors([torch.zeros(limit + 1)])
    assert not small_cpu_tensors([torch.zeros(3), torch.zeros(3, device="meta")])
    assert small_cpu_tensors([])


@pytest.mark.trio
async def test_work_runs_in_place_only_when_allowed_and_every_lock_is_free():
    loop_thread = threading.get_ident()
    free, held = threading.Lock(), threading.Lock()

    def where() -> str:
        return "loop" if threading.get_ident() == loop_thread else "thread"

    assert await TorchWork(True, [free]).run(where) == "loop"
    assert await TorchWork(False, [free]).run(where) == "thread"
    assert await TorchWork().run(where) == "thread"
    assert await TorchWork(True, [free, _CannotTell()]).run(where) == "thread"
    with held:
        work = TorchWork(True, [free, held])
        assert await work.run(where) == "thread"
    assert await work.run(where) == "loop"
    assert (work.ran_in_place, work.ran_in_thread) == (1, 1)


@pytest.mark.trio
async def test_cancelled_work_does_not_start():
    ran: list[int] = []
    work = TorchWork(True)
    with trio.CancelScope() as scope:
        scope.cancel()
        await work.run(ran.append, 1)
    assert scope.cancelled_caught and ran == [] and work.ran_in_place == 0


@pytest.mark.trio
async def test_a_small_cpu_models_epoch_ends_take_no_thread_hop():
    """A lone peer (every step ends an epoch, with delay_state_averaging's rounds): the
    optimizer steps, copies and state-round loads all ran in place on the loop."""
    async with open_dhts(1) as dhts:
        trainer = Trainer(0, 1)
        async with Optimizer.create(
            dht=dhts[0], **options(trainer.model, target_batch_size=BATCH)
        ) as opt:
            with trio.fail_after(60):
                await trainer.train_until(opt, 3)
            assert opt.local_epoch == 3
            assert opt._torch.ran_in_place >= 3 and opt._torch.ran_in_thread == 0
