"""GradScaler: torch's behaviour for torch optimizers, the swarm contract for swarm optimizers.

The end-to-end test with the real swarmtrain Optimizer lives with the Optimizer's tests; here a
small stand-in implements the Optimizer's side of the contract (module docstring of
``swarmtrain.optim.grad_scaler``).
"""

from __future__ import annotations

import pytest
import torch

from swarmtrain.optim.grad_scaler import GradScaler, is_swarm_optimizer


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def batch(i: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + i))


def loss_of(model: torch.nn.Module, i: int, poison: bool = False) -> torch.Tensor:
    loss = model(batch(i)).square().mean()
    return loss * float("inf") if poison else loss


def test_plain_torch_path_matches_torch_grad_scaler():
    kwargs = {"init_scale": 2.0**10, "growth_interval": 2}
    models = [make_model(), make_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scalers = [GradScaler("cpu", **kwargs), torch.amp.GradScaler("cpu", **kwargs)]
    for i in range(7):
        for model, opt, scaler in zip(models, opts, scalers, strict=True):
            scaler.scale(loss_of(model, i, poison=i == 3)).backward()
            if i == 5:  # unscale_ for clipping works as in torch
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale(), i
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # steps 0-1 finite: x2; step 2 finite, step 3 inf: /2; steps 4-5 finite: x2; step 6 finite
    assert scalers[0].get_scale() == 2.0**10 * 2 / 2 * 2
    assert scalers[0].state_dict() == scalers[1].state_dict()


def test_device_defaults_to_the_first_scaled_tensor_and_bad_arguments():
    scaler = GradScaler()
    scaled = scaler.scale(torch.ones(2))
    assert scaler._device == "cpu" and scaled.device.type == "cpu"
    assert scaler.get_scale() == 2.0**16
    with pytest.raises(TypeError, match="device"):
        GradScaler(torch.device("cpu"))
    with pytest.raises(ValueError, match="growth_interval"):
        GradScaler(growth_interval=0)
    with pytest.raises(RuntimeError, match="scale"):
        GradScaler("cpu").unscale_swarm_grads_([torch.nn.Parameter(torch.ones(1))])


def test_unscale_swarm_grads_on_finite_and_inf_gradients():
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1)
    scaler.scale(torch.ones(()))  # initializes the scale
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2).half())]
    no_grad = torch.nn.Parameter(torch.zeros(1))  # .grad None: skipped
    params[0].grad = torch.tensor([8.0, -16.0, 4.0])
    params[1].grad = torch.full((2, 2), 24.0, dtype=torch.float16)
    assert scaler.check_swarm_grads_(params) is True
    assert params[0].grad[0] == 8.0  # checking does not unscale
    assert scaler.unscale_swarm_grads_([*params, no_grad]) is True
    torch.testing.assert_close(params[0].grad, torch.tensor([1.0, -2.0, 0.5]))
    torch.testing.assert_close(params[1].grad, torch.full((2, 2), 3.0, dtype=torch.float16))
    scaler.update()  # finite, growth_interval=1: grows
    assert scaler.get_scale() == 16.0

    params[0].grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale_swarm_grads_(params) is False
    params[0].grad = torch.tensor([1.0, 2.0, 3.0])
    assert scaler.check_swarm_grads_(params) is True  # the inf stays recorded until update()
    scaler.update()
    assert scaler.get_scale() == 8.0
    params[0].grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert scaler.check_swarm_grads_(params) is False
    scaler.update()
    assert scaler.get_scale() == 4.0
    with pytest.raises(TypeError, match="params"):
        scaler.check_swarm_grads_([params[0], "x"])


def test_deferred_updates_change_the_scale_only_at_the_end_of_an_epoch():
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=2)
    scaler.defer_updates = True
    scaler.scale(torch.ones(()))
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    for _ in range(3):  # growth is due after 2 finite steps, but held
        assert scaler.check_swarm_grads_([param])
        scaler.update()
        assert scaler.get_scale() == 4.0
    assert scaler.growth_pending
    scaler.on_swarm_epoch_end_()
    assert scaler.get_scale() == 8.0 and not scaler.growth_pending
    scaler.on_swarm_epoch_end_()  # nothing pending: no change
    assert scaler.get_scale() == 8.0

    for _ in range(2):
        assert scaler.check_swarm_grads_([param])
        scaler.update()
    assert scaler.growth_pending
    param.grad = torch.tensor([float("inf"), 0.0])
    assert not scaler.check_swarm_grads_([param])  # the optimizer resets its buffers
    scaler.update()  # so the scale backs off at once, and the pending growth is dropped
    assert scaler.get_scale() == 4.0 and not scaler.growth_pending
    scaler.on_swarm_epoch_end_()
    assert scaler.get_scale() == 4.0

    immediate = GradScaler("cpu", init_scale=4.0, growth_interval=2)  # defer_updates=False
    immediate.scale(torch.ones(()))
    param.grad = torch.ones(2)
    for _ in range(2):
        assert immediate.check_swarm_grads_([param])
        immediate.update()
    assert immediate.get_scale() == 8.0


class StandInSwarmOptimizer:
    """The Optimizer's side of the GradScaler contract, without a network: SGD on the mean
    gradient of every ``epoch_size`` accepted batches. ``check_each_step``: with
    ``reuse_grad_buffers``, look for inf/NaN after every batch (else only at the epoch's end,
    where a bad epoch is dropped, as the swarmtrain Optimizer does with weight 0)."""

    def __init__(self, params, *, lr, epoch_size, reuse_grad_buffers, check_each_step=False):
        self.main_parameters = list(params)
        self.param_groups = [{"params": self.main_parameters}]
        self.lr, self.epoch_size = lr, epoch_size
        self.reuse_grad_buffers, self.check_each_step = reuse_grad_buffers, check_each_step
        self.accumulators = [torch.zeros_like(p) for p in self.main_parameters]
        self.batches = self.skipped = self.epochs = 0

    def _reset(self) -> None:
        self.batches = 0
        for accumulator in self.accumulators:
            accumulator.zero_()
        if self.reuse_grad_buffers:
            for p in self.main_parameters:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None, batch_size=None, grad_scaler=None):
        params, reuse = self.main_parameters, self.reuse_grad_buffers
        if grad_scaler is not None and not reuse:
            if not grad_scaler.unscale_swarm_grads_(params):
                self.skipped += 1  # only this batch is lost
                return None
        if grad_scaler is not None and reuse and self.check_each_step:
            if not grad_scaler.check_swarm_grads_(params):
                self.skipped += 1
                self._reset()  # the buffers hold the inf: the epoch starts over
                return None
        if not reuse:
            for accumulator, p in zip(self.accumulators, params, strict=True):
                accumulator.add_(p.grad)
        self.batches += 1
        if self.batches < self.epoch_size:
            return None
        if reuse and grad_scaler is not None and not grad_scaler.unscale_swarm_grads_(params):
            self.skipped += 1  # the whole epoch is dropped
        else:
            sums = [p.grad for p in params] if reuse else self.accumulators
            for p, total in zip(params, sums, strict=True):
                p.sub_(total, alpha=self.lr / self.epoch_size)
            self.epochs += 1
        self._reset()
        if grad_scaler is not None:
            grad_scaler.on_swarm_epoch_end_()
        return "stepped"

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.reuse_grad_buffers:
            for p in self.main_parameters:
                p.grad = None


def reference_params(num_epochs: int, epoch_size: int, lr: float) -> list[torch.Tensor]:
    """Plain fp32 training without a scaler: SGD on each epoch's mean gradient."""
    model = make_model()
    for epoch in range(num_epochs):
        for i in range(epoch * epoch_size, (epoch + 1) * epoch_size):
            loss_of(model, i).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=lr / epoch_size)
        model.zero_grad()
    return [p.detach() for p in model.parameters()]


MODES = [(False, False), (True, False), (True, True)]  # (reuse_grad_buffers, check_each_step)


@pytest.mark.parametrize(("reuse_grad_buffers", "check_each_step"), MODES)
def test_scaler_drives_a_swarm_optimizer(reuse_grad_buffers, check_each_step):
    model = make_model()
    opt = StandInSwarmOptimizer(
        model.parameters(),
        lr=0.1,
        epoch_size=3,
        reuse_grad_buffers=reuse_grad_buffers,
        check_each_step=check_each_step,
    )
    assert is_swarm_optimizer(opt) and not is_swarm_optimizer(torch.optim.SGD([torch.ones(1)]))
    scaler = GradScaler(init_scale=2.0**8, growth_interval=2)
    scales, results = [], []
    for i in range(6):
        scaler.scale(loss_of(model, i)).backward()
        results.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert results == [None, None, "stepped"] * 2  # the optimizer's return value
    assert opt.epochs == 2 and scaler.defer_updates == reuse_grad_buffers
    want = reference_params(2, 3, lr=0.1)
    for p, expected in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    base = 2.0**8
    if reuse_grad_buffers:  # the scale only changes at the end of an epoch
        assert scales == [base, base, 2 * base, 2 * base, 2 * base, 4 * base]
    else:  # torch's rule: x2 after every 2 finite steps
        assert scales == [base, 2 * base, 2 * base, 4 * base, 4 * base, 8 * base]
    with pytest.raises(RuntimeError, match="swarmtrain Optimizer"):
        scaler.unscale_(opt)


@pytest.mark.parametrize(("reuse_grad_buffers", "check_each_step"), MODES)
def test_an_overflow_drops_gradients_and_backs_off(reuse_grad_buffers, check_each_step):
    model = make_model()
    opt = StandInSwarmOptimizer(
        model.parameters(),
        lr=0.1,
        epoch_size=2,
        reuse_grad_buffers=reuse_grad_buffers,
        check_each_step=check_each_step,
    )
    scaler = GradScaler(init_scale=2.0**8, growth_interval=1)  # growth due after every step
    scales = []
    for i in range(5):
        scaler.scale(loss_of(model, i, poison=i == 1)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert opt.skipped == 1
    base = 2.0**8
    if not reuse_grad_buffers:  # only the bad batch is lost: batches 0, 2 | 3, 4 make 2 epochs
        assert opt.epochs == 2
        assert scales == [2 * base, base, 2 * base, 4 * base, 8 * base]
    elif check_each_step:  # the epoch restarts after the bad batch: 2, 3 | 4
        assert opt.epochs == 1
        assert scales == [base, base / 2, base / 2, base, base]
    else:  # epoch 0, 1 is dropped at its end (and its growth cancelled); 2, 3 | 4
        assert opt.epochs == 1
        assert scales == [base, base / 2, base / 2, base, base]
    assert all(torch.isfinite(p).all() for p in model.parameters())
