"""A plain averager's newcomer checks a donor's tensors against its own averaged tensors.

Real peers on loopback: hostile donors serve tensors of another dtype or shape, with NaN, or
one tensor too many; the newcomer rejects and bans each, then loads an honest donor's tensors
and averages on with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import torch
from swarm_util import FAST, swarm

from swarmtrain.averaging import DecentralizedAverager
from swarmtrain.averaging.state_checks import (
    RejectReason,
    StateRejected,
    TensorsLike,
    TensorSpec,
    any_tensors,
)

pytestmark = pytest.mark.timeout(60)

SHAPES = [(4, 3), (5,)]


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def _float64(state):
    state[1] = state[1].double()


def _int64(state):
    state[0] = (state[0] * 1000).long()


def _shape(state):
    state[1] = torch.zeros(6)


def _nan(state):
    state[0][1, 1] = float("nan")


def _extra(state):
    state.append(torch.zeros(2))


POISONS: dict[str, tuple[Callable, RejectReason]] = {
    "float64": (_float64, RejectReason.DTYPE),
    "int64": (_int64, RejectReason.DTYPE),
    "shape": (_shape, RejectReason.SHAPE),
    "nan": (_nan, RejectReason.NON_FINITE),
    "extra_tensor": (_extra, RejectReason.TENSOR_COUNT),
}


class HostileAverager(DecentralizedAverager):
    """Serves its averaged tensors with one poison applied."""

    def __init__(self, *args, poison: Callable, **kwargs):
        self.poison = poison
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        with self.get_tensors() as local:
            state = [t.clone() for t in local]
        self.poison(state)
        return {"group_bits": ""}, state


class CustomState(DecentralizedAverager):
    """Shares something else than its averaged tensors (hivemind's way to share more)."""

    def get_current_state(self):
        return {"step": 3}, [torch.arange(3, dtype=torch.float64)]


def test_tensors_like_is_the_spec_of_each_tensor():
    check = TensorsLike.of(tensors(0))
    assert check({"anything": 1}) == (
        TensorSpec((4, 3), torch.float32),
        TensorSpec((5,), torch.float32),
    )
    with pytest.raises(StateRejected) as info:
        check(None)[1].check(1, (5,), torch.float64)
    assert info.value.reason is RejectReason.DTYPE
    assert any_tensors({}) is None


def test_a_newcomer_rejects_poisoned_tensors_and_loads_an_honest_donors(caplog):
    with swarm(2 + len(POISONS)) as (dhts, averagers):
        honest = DecentralizedAverager(
            tensors(1), dhts[0], prefix="poison", allow_state_sharing=False, **FAST
        )
        averagers.append(honest)
        hostile = {}
        for i, (name, (apply, _)) in enumerate(sorted(POISONS.items())):
            hostile[name] = HostileAverager(
                tensors(10 + i), dhts[1 + i], prefix="poison", poison=apply, **FAST
            )
            averagers.append(hostile[name])
        newcomer = DecentralizedAverager(
            tensors(99), dhts[-1], prefix="poison", allow_state_sharing=False, **FAST
        )
        averagers.append(newcomer)

        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert newcomer.load_state_from_peers(timeout=20) is None
        failure = newcomer.state_download_failure
        assert failure is not None and failure.donors == len(POISONS)
        rejected = {r.donor: r.rejected for r in failure.reasons}
        assert rejected == {hostile[name].peer_id: POISONS[name][1] for name in POISONS}
        messages = [r.getMessage() for r in caplog.records]
        for peer in hostile.values():
            assert any(str(peer.peer_id) in m and "banned for 600 s" in m for m in messages)

        honest.allow_state_sharing = True
        loaded = None
        for _ in range(40):  # until the honest declaration is read (the others stay banned)
            loaded = newcomer.load_state_from_peers(timeout=5)
            if loaded is not None:
                break
            assert newcomer.state_download_failure.banned == len(POISONS)
        assert loaded is not None
        metadata, state = loaded
        assert metadata == {"group_bits": ""}
        for got, want in zip(state, tensors(1), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)

        # training goes on: the newcomer takes the state and averages with the honest donor
        for averager in hostile.values():
            averagers.remove(averager)
            averager.shutdown()
        with newcomer.get_tensors() as local:
            for mine, theirs in zip(local, state, strict=True):
                mine.copy_(theirs * 3)
        results: list = []
        threads = [
            threading.Thread(target=lambda a=a: results.append(a.step(timeout=15)))
            for a in (honest, newcomer)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(results) == 2 and all(len(r) == 2 for r in results)
        for averager in (honest, newcomer):
            with averager.get_tensors() as local:
                for got, want in zip(local, tensors(1), strict=True):
                    torch.testing.assert_close(got, want * 2)


def test_a_custom_state_is_taken_as_is_unless_a_check_is_given():
    with swarm(2) as (dhts, averagers):
        donor = CustomState(tensors(1), dhts[0], prefix="custom", **FAST)
        averagers.append(donor)
        newcomer = CustomState(tensors(2), dhts[1], prefix="custom", **FAST)
        averagers.append(newcomer)
        loaded = None
        for _ in range(40):  # the donor's declaration arrives
            loaded = newcomer.load_state_from_peers(timeout=5)
            if loaded is not None:
                break
        assert loaded is not None and loaded[0] == {"step": 3}
        assert loaded[1][0].dtype == torch.float64  # no default check for a custom state
        assert newcomer.load_state_from_peers(timeout=5, check=TensorsLike.of(tensors(0))) is None
        assert newcomer.state_download_failure.reasons[0].rejected is RejectReason.TENSOR_COUNT
