"""What DiLoCo peers hand to a joiner, how they tell diverged shared parameters apart, and the
argument checks of ``DiLoCoOptimizer``.

:func:`pack_state` turns an :class:`~swarmtrain.optim.diloco_core.OuterState` and the inner
step count into the ``(metadata, tensors)`` pair that the averager's state sharing sends;
:func:`unpack_state` inverts it. :func:`check_state` is what a joiner checks before it uses a
donor's state (a ``StateCheck``, see ``swarmtrain.averaging.state_checks``): the format and
number of fragments, step counters within ``EPOCH_LIMIT``, shared parameters of our shapes and
dtype (fp32: nothing is cast), the outer optimizer's state shaped like ours or like the state one
step creates (its momentum buffers appear lazily, so a joiner usually has none yet), and its
hyperparameters equal to ours but for ``lr`` (up to ``LR_TOLERANCE`` x ours) and momenta (in
``[0, 1]``); state sharing adds finiteness, bans a donor that fails and tries the next.

:func:`shared_fingerprint` samples a few values of the shared parameters at fixed positions
(each round's gather data carries it); :func:`reference_peers` groups a round's fingerprints
into classes of matching ones and picks the class every member agrees to follow (the largest;
ties: the furthest outer step, then the smallest peer id), so that the others load its state.
Peers that average together hold the same shared parameters up to the last bits (each adds
its own delta), hence a tolerance; peers that started from other random weights differ in
every sampled value.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from swarmtrain.averaging.state_checks import RejectReason, StateRejected, TensorSpec
from swarmtrain.optim._optimizer_state import decode_tensors, encode_tensors
from swarmtrain.optim._state_checks import check_epoch, optimizer_state_specs
from swarmtrain.optim.diloco_core import OuterState

__all__ = [
    "STATE_FORMAT",
    "check_state",
    "fingerprints_match",
    "pack_state",
    "reference_peers",
    "shared_fingerprint",
    "unpack_state",
]

#: values sampled per fingerprint (at fixed positions spread over all the parameters)
FINGERPRINT_SAMPLES = 64
#: two fingerprints match when each sampled value differs by at most this, relative to the
#: mean magnitude of the samples (last-bit differences between synced peers: ~1e-7; fp16
#: deltas add ~1e-5 per round; other random initializations differ by ~1)
FINGERPRINT_TOLERANCE = 1e-3

#: version tag of the state that peers download from each other
STATE_FORMAT = "swarmtrain.diloco/1"


def pack_state(
    outer: OuterState, inner_step: int, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``(metadata, tensors)`` that carry ``outer`` (parameters, optimizer state, step) and the
    inner step count; the metadata holds the optimizer state's structure, with each tensor
    replaced by a reference (``_optimizer_state.encode_tensors``)."""
    state = outer.state_dict()  # already copies: no second copy here
    tensors: list[torch.Tensor] = list(state["params"])
    optimizer = encode_tensors(state["optimizer"], tensors, copy=False)
    metadata = {
        "format": STATE_FORMAT,
        "num_params": len(state["params"]),
        "outer_step": state["outer_step"],
        "inner_step": inner_step,
        "optimizer": optimizer,
        **(extra or {}),
    }
    return metadata, tensors


def unpack_state(metadata: Any, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int]:
    """The inverse of :func:`pack_state`: ``(OuterState state dict, inner step)``.

    :raises ValueError: not a state of this format, or references to missing tensors
    """
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} state: {str(metadata)[:200]}")
    num_params = _non_negative_int(metadata, "num_params")
    inner_step = _non_negative_int(metadata, "inner_step")
    if num_params > len(tensors):
        raise ValueError(f"state announces {num_params} parameters, carries {len(tensors)} tensors")

    state = {
        "params": list(tensors[:num_params]),
        "optimizer": decode_tensors(metadata.get("optimizer"), tensors, first=num_params),
        "outer_step": metadata.get("outer_step"),
    }
    return state, inner_step


def _non_negative_int(metadata: dict, name: str) -> int:
    value = metadata.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_state(
    metadata: Any,
    *,
    params: Sequence[TensorSpec],
    optimizer_metadata: Any,
    optimizer_specs: Sequence[TensorSpec],
    stepped: tuple[Any, Sequence[TensorSpec]] | None,
    num_fragments: int,
    lr_limits: Sequence[float],
) -> list[TensorSpec]:
    """The specs of a donor's state tensors (parameters, then the outer optimizer's), after
    checking its metadata against ours (see the module docstring; a ``StateCheck`` once the
    keywords are bound).

    :param params: our shared parameters' specs
    :param optimizer_metadata: our outer optimizer's encoded state dict (its references point
      into ``optimizer_specs``)
    :param stepped: ``_state_checks.stepped_state`` of our outer optimizer (None: unknown)
    :param lr_limits: the largest outer lr accepted, per param group
    """
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
        raise StateRejected(RejectReason.METADATA, f"not a {STATE_FORMAT} state")
    fragments = metadata.get("num_fragments", 1)
    if fragments != num_fragments:
        detail = f"the donor syncs {fragments!r:.20} fragments, we {num_fragments}"
        raise StateRejected(RejectReason.METADATA, detail)
    if metadata.get("num_params") != len(params):
        raise StateRejected(
            RejectReason.TENSOR_COUNT,
            f"{metadata.get('num_params')!r:.20} shared parameters, expected {len(params)}",
        )
    for name in ("inner_step", "outer_step"):
        check_epoch(metadata.get(name), 0, None, what=name.replace("_", " "))
    optimizer = optimizer_state_specs(
        optimizer_metadata,
        optimizer_specs,
        metadata.get("optimizer"),
        lr_limits,
        first=len(params),
        stepped=stepped,
    )
    return [*params, *optimizer]


def check_positive(name: str, value: object, *, allow_none: bool = False) -> None:
    """A finite number > 0 (or None if allowed), else TypeError / ValueError."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """An int >= 1 (or None if allowed), else TypeError / ValueError."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")


def flatten_params(params: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of ``params`` (tensors, or param-group dicts), in order, each once."""
    result: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if id(p) not in seen:
                seen.add(id(p))
                result.append(p)
    if not result:
        raise ValueError("DiLoCoOptimizer got an empty parameter list")
    return result


def shared_fingerprint(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Up to ``FINGERPRINT_SAMPLES`` values of ``tensors`` (flattened one after another) at
    evenly spread positions: the same positions on every peer with the same parameters."""
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    if total == 0:
        return []
    count = min(FINGERPRINT_SAMPLES, total)
    positions = [round(j * (total - 1) / max(count - 1, 1)) for j in range(count)]
    values, offset, index = [], 0, 0
    with torch.no_grad():
        for tensor, size in zip(tensors, sizes, strict=True):
            flat = tensor.reshape(-1)
            while index < count and positions[index] < offset + size:
                values.append(float(flat[positions[index] - offset]))
                index += 1
            offset += size
    return values


def fingerprints_match(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two :func:`shared_fingerprint` results describe the same shared parameters."""
    if len(a) != len(b):
        return False
    if not all(math.isfinite(x) for x in (*a, *b)):
        return False
    scale = sum(abs(x) + abs(y) for x, y in zip(a, b, strict=True)) / max(2 * len(a), 1)
    allowed = FINGERPRINT_TOLERANCE * scale
    return all(abs(x - y) <= allowed for x, y in zip(a, b, strict=True))


def reference_peers(
    fingerprints: Mapping[Hashable, tuple[Sequence[float], int]],
) -> frozenset[Hashable]:
    """The peers whose shared parameters everybody should hold.

    :param fingerprints: ``{peer: (fingerprint, outer step)}`` of a round's members (the same
      mapping on every member, so every member picks the same class)
    :returns: the members of the reference class: the largest class of matching fingerprints;
      ties go to the class with the furthest outer step, then to the one holding the smallest
      peer id (peers are ordered by ``repr`` when their type has no order)
    """
    order = sorted(fingerprints, key=_peer_order)
    classes: list[list[Hashable]] = []
    for peer in order:
        for members in classes:
            if fingerprints_match(fingerprints[members[0]][0], fingerprints[peer][0]):
                members.append(peer)
                break
        else:
            classes.append([peer])
    if not classes:
        return frozenset()

    def rank(members: list[Hashable]) -> tuple:
        furthest = max(fingerprints[p][1] for p in members)
        return (-len(members), -furthest, order.index(members[0]))

    best = min(classes, key=rank)
    return frozenset(best)


def _peer_order(peer: Hashable) -> tuple:
    if isinstance(peer, bytes):
        return (0, peer)
    to_bytes = getattr(peer, "to_bytes", None)
    if callable(to_bytes):
        return (0, to_bytes())
    return (1, repr(peer).encode())
