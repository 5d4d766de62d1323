"""DiLoCo joiners do not load poison: a donor's state is checked before any of it is used.

The checks alone (``diloco_state.check_state``, lazily created outer-optimizer state), then real
peers on loopback: hostile donors serve poisoned states, the joiner rejects and bans each one,
loads the honest donor's state and trains on with it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import pytest
import torch
from polling import wait_for
from swarm_util import HOST

from swarmtrain.averaging.state_checks import RejectReason, StateRejected, TensorSpec
from swarmtrain.averaging.state_sharing import state_sharing_key
from swarmtrain.compression import NoCompression
from swarmtrain.dht import DHT
from swarmtrain.optim._optimizer_state import TENSOR_KEY, encode_tensors
from swarmtrain.optim._state_checks import EPOCH_LIMIT, stepped_state
from swarmtrain.optim.diloco import AsyncDiLoCoOptimizer, DiLoCoOptimizer
from swarmtrain.optim.diloco_core import OuterState, default_outer_optimizer
from swarmtrain.optim.diloco_state import check_state, pack_state
from swarmtrain.utils.background import BackgroundRuntime

pytestmark = pytest.mark.timeout(90)

SHAPES = [(3, 4), (3,)]


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def _check_for(outer: OuterState, factory=default_outer_optimizer, num_fragments: int = 1):
    tensors: list[torch.Tensor] = []
    mine = encode_tensors(outer.optimizer.state_dict(), tensors, copy=False)
    return functools.partial(
        check_state,
        params=[TensorSpec.of(p) for p in outer.params],
        optimizer_metadata=mine,
        optimizer_specs=[TensorSpec.of(t) for t in tensors],
        stepped=stepped_state(factory, outer.params),
        num_fragments=num_fragments,
        lr_limits=[7.0],
    )


def _stepped_donor(factory=default_outer_optimizer) -> OuterState:
    donor = OuterState(_tensors(1), factory)
    donor.apply_outer_step([torch.ones(s) for s in SHAPES])
    return donor


# ------------------------------------------------------------------ poisons (metadata, tensors)


def _nan(metadata, tensors):
    tensors[0][0, 0] = float("nan")


def _float64(metadata, tensors):
    tensors[0] = tensors[0].double()


def _shape(metadata, tensors):
    tensors[1] = torch.zeros(4)


def _lr(metadata, tensors):
    metadata["optimizer"]["param_groups"][0]["lr"] = 1e9


def _momentum(metadata, tensors):
    metadata["optimizer"]["param_groups"][0]["momentum"] = 5.0


def _buffer_shape(metadata, tensors):
    """A momentum buffer the joiner does not have yet, of another shape than its parameter."""
    metadata["optimizer"]["state"][0] = {"momentum_buffer": {TENSOR_KEY: len(tensors)}}
    tensors.append(torch.zeros(7))


def _step(metadata, tensors):
    metadata["inner_step"] = 10**12


POISONS: dict[str, tuple[Callable, RejectReason]] = {
    "nan": (_nan, RejectReason.NON_FINITE),
    "float64": (_float64, RejectReason.DTYPE),
    "shape": (_shape, RejectReason.SHAPE),
    "lr": (_lr, RejectReason.HYPERPARAMETERS),
    "momentum": (_momentum, RejectReason.HYPERPARAMETERS),
    "buffer_shape": (_buffer_shape, RejectReason.SHAPE),
    "inner_step": (_step, RejectReason.EPOCH),
}


# ------------------------------------------------------------------ the checks alone


def test_a_fresh_joiner_takes_momentum_buffers_shaped_like_its_parameters():
    joiner = OuterState(_tensors(2))  # never stepped: no momentum buffers yet
    assert not joiner.optimizer.state_dict()["state"]
    metadata, tensors = pack_state(_stepped_donor(), 3, {"num_fragments": 1})
    specs = _check_for(joiner)(metadata)
    assert specs == [TensorSpec.of(t) for t in tensors]  # 2 parameters, 2 momentum buffers
    # ... and the donor may also have none (it never stepped), or ours may exist already
    fresh_metadata, _ = pack_state(OuterState(_tensors(3)), 0, {"num_fragments": 1})
    assert len(_check_for(joiner)(fresh_metadata)) == 2
    assert len(_check_for(_stepped_donor())(metadata)) == 4


def test_adam_outer_state_is_checked_against_what_a_step_creates():
    adam = functools.partial(torch.optim.Adam, lr=0.1)
    metadata, tensors = pack_state(_stepped_donor(adam), 1, {"num_fragments": 1})
    joiner = OuterState(_tensors(2), adam)
    assert _check_for(joiner, adam)(metadata) == [TensorSpec.of(t) for t in tensors]
    metadata["optimizer"]["state"][0]["exp_avg_sq"] = 1.0  # a number where a tensor goes
    with pytest.raises(StateRejected):
        _check_for(joiner, adam)(metadata)


@pytest.mark.parametrize("poison", ["lr", "momentum", "buffer_shape", "inner_step"])
def test_poisoned_metadata_is_rejected_before_any_tensor(poison):
    apply, reason = POISONS[poison]
    metadata, tensors = pack_state(OuterState(_tensors(1)), 3, {"num_fragments": 1})
    apply(metadata, tensors)
    check = _check_for(OuterState(_tensors(2)))
    try:
        specs = check(metadata)
    except StateRejected as e:
        assert e.reason is reason and e.ban
    else:  # the shape is only known from the tensor's header
        assert reason is RejectReason.SHAPE
        assert specs[-1] == TensorSpec((3, 4), torch.float32)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"format": "other/1"}, RejectReason.METADATA),
        ({"num_fragments": 2}, RejectReason.METADATA),
        ({"num_params": 3}, RejectReason.TENSOR_COUNT),
        ({"outer_step": -1}, RejectReason.BEHIND),
        ({"outer_step": EPOCH_LIMIT + 1}, RejectReason.EPOCH),
        ({"inner_step": "7"}, RejectReason.METADATA),
    ],
)
def test_malformed_diloco_metadata_is_rejected(change, reason):
    metadata, _ = pack_state(_stepped_donor(), 3, {"num_fragments": 1})
    with pytest.raises(StateRejected) as info:
        _check_for(OuterState(_tensors(2)))({**metadata, **change})
    assert info.value.reason is reason


def test_a_momentum_buffer_for_a_parameter_we_do_not_have_is_rejected():
    metadata, tensors = pack_state(_stepped_donor(), 3, {"num_fragments": 1})
    metadata["optimizer"]["state"][2] = {"momentum_buffer": {TENSOR_KEY: len(tensors)}}
    with pytest.raises(StateRejected, match="keeps no state"):
        _check_for(OuterState(_tensors(2)))(metadata)


# ------------------------------------------------------------------ real peers

FAST = {"matchmaking_time": 1.0, "averaging_timeout": 10.0, "load_state_timeout": 10.0}
INNER_STEPS = 2


class HostileDiLoCo(DiLoCoOptimizer):
    """Serves its real state with one poison applied."""

    def __init__(self, *args, poison: Callable, **kwargs):
        self._implementation = functools.partial(_HostileImplementation, poison=poison)
        super().__init__(*args, **kwargs)


class _HostileImplementation(AsyncDiLoCoOptimizer):
    def __init__(self, *args, poison: Callable, **kwargs):
        self.poison = poison
        super().__init__(*args, **kwargs)

    def _current_state(self):
        metadata, tensors = super()._current_state()
        tensors = [t.clone() for t in tensors]
        self.poison(metadata, tensors)
        return metadata, tensors


class Peer:
    def __init__(self, dht: DHT, seed: int, cls=DiLoCoOptimizer, **kwargs):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.opt = cls(
            self.model.parameters(),
            dht=dht,
            run_id="poison",
            inner_optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
            inner_steps=INNER_STEPS,
            pseudo_grad_compression=NoCompression(),
            **FAST,
            **kwargs,
        )
        self.x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            self.model(self.x).square().mean().backward()
            self.opt.step()


def _in_threads(*functions: Callable[[], None]) -> None:
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
        thread.join(40)
    assert not any(t.is_alive() for t in threads), "a peer hung"
    if errors:
        raise errors[0]


def test_a_joiner_rejects_poisoned_diloco_states_and_loads_an_honest_one(caplog):
    dhts = [DHT(**HOST)]
    peers: list[Peer] = []
    try:
        for _ in range(len(POISONS) + 1):
            dhts.append(DHT(dhts[0].get_visible_maddrs(), **HOST))
        honest = Peer(dhts[0], seed=1)
        peers.append(honest)
        honest.train(INNER_STEPS)  # alone: one outer step, so it has momentum buffers
        assert honest.opt.outer_step == 1 and honest.opt.state_dict()["outer"]["optimizer"]["state"]
        honest.opt.averager.allow_state_sharing = False  # the hostile donors are asked first
        hostile: dict[str, Peer] = {}
        for i, (name, (apply, _)) in enumerate(sorted(POISONS.items())):
            hostile[name] = Peer(dhts[1 + i], seed=10 + i, cls=HostileDiLoCo, poison=apply)
            peers.append(hostile[name])
        joiner = Peer(dhts[-1], seed=99)
        peers.append(joiner)
        before = joiner.opt.state_dict()

        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert not joiner.opt.load_state_from_peers(timeout=20)
        failure = joiner.opt.averager.state_download_failure
        assert failure is not None and failure.donors == 0 and failure.banned == len(POISONS)
        messages = [r.getMessage() for r in caplog.records]
        for name, peer in hostile.items():
            reason = POISONS[name][1]
            assert any(
                str(peer.opt.averager.peer_id) in m
                and reason.value in m
                and "banned for 600 s" in m
                for m in messages
            ), (name, messages)
        after = joiner.opt.state_dict()  # nothing of the rejected states was applied
        assert after["inner_step"] == before["inner_step"] == 0
        assert not after["outer"]["optimizer"]["state"]
        for mine, theirs in zip(after["outer"]["params"], before["outer"]["params"], strict=True):
            assert torch.equal(mine, theirs)

        honest.opt.averager.allow_state_sharing = True
        # the honest peer re-declares in the background: a load before its record is stored
        # sees only banned donors and returns False at once (its documented behaviour)
        key = state_sharing_key(honest.opt.averager.prefix)
        honest_subkey = honest.opt.averager.peer_id.to_bytes()

        def honest_declared() -> bool:
            found = dhts[-1].get(key, latest=True)
            item = (
                found.value.get(honest_subkey) if found and isinstance(found.value, dict) else None
            )
            return item is not None and isinstance(item.value, (int, float))

        wait_for(honest_declared, timeout=20, what="the honest donor's declaration")
        assert joiner.opt.load_state_from_peers(timeout=20)
        assert joiner.opt.averager.state_download_failure is None
        assert joiner.opt.inner_step == INNER_STEPS and joiner.opt.outer_step == 1
        for mine, theirs in zip(
            joiner.opt.shared_parameters(), honest.opt.shared_parameters(), strict=True
        ):
            assert torch.equal(mine, theirs)
        outer = joiner.opt._impl._outer.optimizer
        assert outer.param_groups[0]["lr"] == 0.7 and outer.param_groups[0]["momentum"] == 0.9
        assert len(outer.state) == 2  # the honest donor's momentum buffers

        for peer in hostile.values():  # training goes on: the joiner averages with the honest
            peers.remove(peer)
        _in_threads(*(peer.opt.shutdown for peer in hostile.values()))
        _in_threads(lambda: honest.train(INNER_STEPS), lambda: joiner.train(INNER_STEPS))
        for peer in (honest, joiner):
            stats = peer.opt.statistics()
            assert stats.outer_step == 2 and stats.last_group_size == 2, stats
        for mine, theirs in zip(
            joiner.opt.shared_parameters(), honest.opt.shared_parameters(), strict=True
        ):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    finally:  # (in parallel: each close waits for its last DHT store)
        _in_threads(*(peer.opt.shutdown for peer in peers))
        _in_threads(*(dht.shutdown for dht in dhts[1:]))
        dhts[0].shutdown()
    assert BackgroundRuntime.active_references() == 0
