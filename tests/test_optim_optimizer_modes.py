"""swarmtrain.Optimizer's modes with real peers on loopback: delayed / offloaded / local-update
steps, reuse_grad_buffers, auxiliary and client-mode peers, a peer killed mid-training."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from polling import wait_for
from test_optim_optimizer import (
    BATCH,
    FEATURES,
    HOST,
    Peer,
    X,
    agree_after_a_state_round,
    assert_same_params,
    dhts,  # noqa: F401 (fixture)
    full_loss,
    in_threads,
    params_of,
)

from swarmtrain.dht import DHT
from swarmtrain.optim import PowerSGDGradientAverager
from swarmtrain.optim.grad_scaler import GradScaler

MOMENTUM_SGD = {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.5)}
# With the default delay_state_averaging, a state round still running when the next epoch
# ends overlaps that epoch's optimizer step in the trainer's thread (the epoch skips its own
# round): peers then agree only approximately, as in hivemind. Tests that compare models
# exactly use synchronous state rounds (the delayed-step modes run step and round in order).
SYNC_STATE = {"delay_state_averaging": False}
# offload_optimizer alone (the default with a factory) is what test_optim_optimizer.py runs
MODES = {
    "plain": {"offload_optimizer": False, "delay_state_averaging": False},
    "delay_step": {"delay_optimizer_step": True},
    "delay_grads_reuse": {"delay_grad_averaging": True, "reuse_grad_buffers": True},
    "local_delay_step": {"use_local_updates": True, "delay_optimizer_step": True},
}


def land(peers: list[Peer]) -> None:
    """Wait for and apply every peer's background work."""
    for peer in peers:
        peer.opt.state_averager.step(wait_for_delayed_updates=True)


def shutdown(peers: list[Peer]) -> None:
    for peer in peers:
        if peer.opt.tracker is not None:
            peer.opt.shutdown()


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_modes_train_together(dhts, mode):  # noqa: F811
    opts = {**MOMENTUM_SGD, **MODES[mode]}
    peers = [Peer(dht, i, **opts) for i, dht in enumerate(dhts(2))]
    try:
        opt = peers[0].opt
        assert opt.reuse_grad_buffers == opts.get("reuse_grad_buffers", False)
        assert opt.offload_optimizer == (mode != "plain")
        assert opt.delay_optimizer_step == mode.startswith(("delay", "local_delay"))
        initial_loss = full_loss(peers[0].model)
        in_threads(*(lambda p=p: p.train_until(3) for p in peers))
        land(peers)
        assert {p.opt.local_epoch for p in peers} == {3}
        # epoch sizes depend on the load: tests/test_optim_epoch_core.py checks them
        final = [params_of(p.model) for p in peers]
        if opts.get("use_local_updates"):
            for a, b in zip(*final, strict=True):  # local steps since the last state round
                assert (a - b).abs().max() < 0.5
        assert full_loss(peers[0].model) < 0.7 * initial_loss
        agree_after_a_state_round(peers)
        if opt.reuse_grad_buffers:
            with pytest.raises(ValueError, match="zero_grad"):
                opt.zero_grad()
    finally:
        shutdown(peers)


def test_auxiliary_peer_keeps_up_and_serves_state(dhts):  # noqa: F811
    """An auxiliary peer that missed an epoch's gradients catches up by loading the state after
    that epoch's step, then steps on the same averaged gradients: it holds a trainer's state.
    (No state rounds here: only gradient rounds and loads change the models, so whichever
    rounds fail under load, the auxiliary peer's model is one of the trainers'.)"""
    opts = {**MOMENTUM_SGD, "average_state_every": 1000}
    first, second, aux_dht = dhts(3)
    trainers = [Peer(first, 0, **opts), Peer(second, 1, **opts)]
    aux = newcomer = None
    done = threading.Event()
    try:
        in_threads(*(lambda p=p: p.train_until(1) for p in trainers))
        land(trainers)
        at_epoch_1 = [params_of(t.model) for t in trainers]

        # It joins in epoch 0, which the swarm has left: its first epoch end is a catch-up.
        aux = Peer(aux_dht, 2, seed=7, auxiliary=True, batch_size_per_step=None, **opts)
        with pytest.raises(ValueError, match="auxiliary"):
            aux.opt.step(batch_size=4)
        deadline = time.monotonic() + 20
        while aux.opt.local_epoch < 1:
            assert time.monotonic() < deadline, "the auxiliary peer did not catch up"
            aux.opt.step()
            time.sleep(0.05)
        assert aux.opt.local_epoch == 1
        assert any(same_params(params_of(aux.model), state) for state in at_epoch_1)

        def run_aux() -> None:
            while not done.is_set():
                aux.opt.step()
                time.sleep(0.05)

        aux_thread = threading.Thread(target=run_aux)
        aux_thread.start()
        try:
            in_threads(*(lambda p=p: p.train_until(2) for p in trainers))
            # a failed round: it catches up after the swarm
            wait_for(lambda: aux.opt.local_epoch >= 2, 20, "the auxiliary peer reaching epoch 2")
        finally:
            done.set()
            aux_thread.join(30)
        land([*trainers, aux])
        assert aux.opt.local_epoch == 2
        assert aux.opt._epoch_core.statistics().epochs_entered_without_state == 0
        assert aux.opt.grad_averager is not None and aux.opt.grad_averager.mode.name == "NODE"
        # the same averaged gradients as the trainers of its round, or a trainer's loaded state
        assert min(max_gap(params_of(aux.model), params_of(t.model)) for t in trainers) < 1e-3

        for peer in trainers:  # the aux peer is now the only donor
            peer.opt.shutdown()
        newcomer = Peer(dhts(1)[0], 0, seed=123, **opts)
        assert newcomer.opt.load_state_from_peers()
        assert newcomer.opt.local_epoch == 2
        assert_same_params(params_of(newcomer.model), params_of(aux.model))
    finally:
        shutdown([*trainers, *(p for p in (aux, newcomer) if p is not None)])


def same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_client_mode_peer_trains_with_a_normal_one(dhts):  # noqa: F811
    (server_dht,) = dhts(1)
    client_dht = DHT(server_dht.get_visible_maddrs(), client_mode=True, **HOST)
    peers = []
    try:
        peers = [Peer(server_dht, 0, **SYNC_STATE), Peer(client_dht, 1, **SYNC_STATE)]
        assert peers[1].opt.client_mode and not peers[0].opt.client_mode
        initial_loss = full_loss(peers[0].model)
        in_threads(*(lambda p=p: p.train_until(3) for p in peers))
        land(peers)
        assert {p.opt.local_epoch for p in peers} == {3}
        assert peers[1].opt.epochs_averaged >= 1
        assert full_loss(peers[1].model) < 0.7 * initial_loss
        agree_after_a_state_round(peers)
    finally:
        shutdown(peers)
        client_dht.shutdown()


def test_others_go_on_when_a_peer_is_killed(dhts):  # noqa: F811
    peers = [Peer(dht, i, **SYNC_STATE) for i, dht in enumerate(dhts(3))]
    victim, survivors = peers[2], peers[:2]
    try:
        in_threads(*(lambda p=p: p.train_until(1) for p in peers))

        def train_victim() -> None:
            try:  # until its optimizer disappears under it (any error then is fine)
                victim.train_until(10)
            except Exception:
                pass

        with ThreadPoolExecutor(3) as pool:  # the survivors go on while the victim dies
            futures = [pool.submit(p.train_until, 3) for p in survivors]
            victim_future = pool.submit(train_victim)
            time.sleep(1.0)  # mid-epoch: it has samples and maybe a scheduled round
            victim.opt.shutdown()
            victim_future.result(timeout=30)
            for future in futures:
                future.result(timeout=60)
        land(survivors)
        assert {p.opt.local_epoch for p in survivors} == {3}
        assert survivors[0].opt.epochs_averaged >= 2
        assert all(torch.isfinite(p).all() for p in survivors[0].model.parameters())
        agree_after_a_state_round(survivors)
    finally:
        shutdown(peers)


@pytest.mark.parametrize("reuse", [False, True])
def test_grad_scaler_drops_non_finite_gradients(dhts, reuse):  # noqa: F811
    opts = {"reuse_grad_buffers": reuse, **SYNC_STATE}
    peers = [Peer(dht, i, **opts) for i, dht in enumerate(dhts(2))]
    scalers = [GradScaler("cpu", init_scale=64.0), GradScaler("cpu", init_scale=64.0)]
    try:
        with pytest.raises(TypeError, match=r"swarmtrain\.optim\.GradScaler"):
            peers[0].opt.step(grad_scaler=torch.amp.GradScaler("cpu", enabled=False))
        broken = peers[1]
        scalers[1].scale(broken.model(X[:BATCH]).sum() * float("inf")).backward()
        scalers[1].step(broken.opt)  # non-finite: dropped, or weight 0 for this epoch
        scalers[1].update()
        if not reuse:
            assert broken.opt.skipped_batches == 1 and broken.opt.local_samples_accumulated == 0
            assert scalers[1].get_scale() == 32.0  # torch backs off at once
            broken.opt.zero_grad()
        initial_loss = full_loss(peers[0].model)
        in_threads(
            *(
                lambda p=p, s=s: p.train_until(2, grad_scaler=s)
                for p, s in zip(peers, scalers, strict=True)
            )
        )
        land(peers)
        assert scalers[1].get_scale() < 64.0  # the bad batch backed the scale off
        final = [params_of(p.model) for p in peers]
        assert all(torch.isfinite(t).all() for t in final[1])
        assert full_loss(peers[0].model) < 0.8 * initial_loss
        agree_after_a_state_round(peers)
    finally:
        shutdown(peers)


def test_power_sgd_averager_plugs_in_with_delays(dhts):  # noqa: F811
    def two_layers() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Linear(16, 1))

    factory = functools.partial(PowerSGDGradientAverager, averager_rank=2)
    opts = {"grad_averager_factory": factory, "delay_grad_averaging": True}
    peers = [Peer(dht, i, model=two_layers(), **opts) for i, dht in enumerate(dhts(2))]
    try:
        assert isinstance(peers[0].opt.grad_averager, PowerSGDGradientAverager)
        initial_loss = full_loss(peers[0].model)
        in_threads(*(lambda p=p: p.train_until(3) for p in peers))
        land(peers)
        assert {p.opt.local_epoch for p in peers} == {3}
        assert all(p.opt.epochs_averaged >= 1 for p in peers)
        assert full_loss(peers[0].model) < 0.7 * initial_loss
    finally:
        shutdown(peers)


def test_a_peer_behind_whose_catch_ups_fail_backs_off(dhts, caplog):  # noqa: F811
    """An auxiliary peer two epochs behind a swarm whose states it cannot take (the trainers'
    lr is beyond what it accepts: every donor is rejected) tries to catch up after 1, 2, 4 ...
    s, not at every step (nor warns at each)."""
    first, second, aux_dht = dhts(3)
    trainers = [Peer(dht, i, **MOMENTUM_SGD) for i, dht in enumerate((first, second))]
    aux = None
    try:
        in_threads(*(lambda p=p: p.train_until(2) for p in trainers))
        small_lr = {"optimizer": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.5)}
        aux = Peer(aux_dht, 2, auxiliary=True, batch_size_per_step=None, **small_lr)
        wait_for(lambda: aux.opt.tracker.global_epoch >= 2, 20, "the trainers' progress")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="swarmtrain.optim.optimizer"):
            aux.opt.step()  # the first try: both donors rejected (and banned)
            first_try = time.monotonic()
            steps = 1
            while time.monotonic() < first_try + 3.5:
                aux.opt.step()
                steps += 1
                time.sleep(0.01)
        behind = [r for r in caplog.records if "is behind the swarm" in r.getMessage()]
        stats = aux.opt._epoch_core.statistics()
        # tries at 0, >= 1 and >= 3 s: at most 3 in 3.5 s, however slow each step is
        assert 1 <= len(behind) == stats.catch_ups_failed <= 3, [r.getMessage() for r in behind]
        assert stats.catch_ups_backed_off == steps - len(behind) >= 10
        assert aux.opt.local_epoch == 0  # (it waits for a donor; it never takes an epoch)
    finally:
        shutdown([*trainers, *([aux] if aux is not None else [])])
