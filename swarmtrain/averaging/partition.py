"""Splitting tensors into per-peer parts and reassembling the results (pure).

Every peer of a group computes the same layout from the same inputs (tensor shapes and dtypes,
peer fractions, part size), so parts are identified by ``(peer index, part index)`` alone:

- the flat concatenation of all tensors is cut into one contiguous *slice* per peer, with sizes
  apportioned to the peer fractions (:func:`apportion`);
- each slice is cut into *parts* of ``part_size_bytes`` raw bytes (up to 2 MiB for large
  slices); a part never crosses a tensor boundary, so it is a flat range of one tensor. How
  far parts grow is the group's *part layout* (:data:`PART_LAYOUTS`), which every member must
  use alike: the averager takes the lowest layout its group's members speak (matchmaking).

:class:`TensorPartContainer` holds one peer's view of a round: the parts it sends and the
deltas (average minus local values) it receives back. ``part_reducer.TensorPartReducer``
averages the local slice over all senders with weights, and knows which senders are banned.

Nothing here does I/O or waits; the async shell is ``swarmtrain.averaging.allreduce``.

Per-part arithmetic (a part is at most ``part_size_bytes``, 512 KiB by default) runs through
numpy views where the dtype allows: torch splits such ops over its intra-op threads, and on a
busy machine their hand-offs cost far more CPU than the op (measured on 2 loaded cores: 7.7 ms
of CPU for a 512 KiB ``Tensor.copy_`` with 2 threads, 0.03 ms with one, 0.01 ms in numpy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DEFAULT_PART_SIZE_BYTES",
    "PART_LAYOUT",
    "PART_LAYOUTS",
    "PartSpec",
    "TensorPartContainer",
    "apportion",
    "held_back_by_links",
    "partition_tensors",
]

# A slice of a large round is cut into about this many parts, each at most
# LARGE_PART_SIZE_BYTES (see partition_tensors).
PARTS_PER_SLICE = 8
LARGE_PART_SIZE_BYTES = 2 * 1024 * 1024
DEFAULT_PART_SIZE_BYTES = 1 << 19
# Part layouts: the number of parts a slice is cut into, about (fewer where parts would pass
# LARGE_PART_SIZE_BYTES). 0, the original: ~PARTS_PER_SLICE (8 x 4M fp32: 4 parts of 512 KiB
# per 2 MiB slice). 1: one part per slice of up to 2 MiB: per-part costs (messages, wakeups,
# bookkeeping) were the most of an all-reduce's CPU at 8 x 4M (benchmarks/RESULTS.md).
PART_LAYOUTS = {0: PARTS_PER_SLICE, 1: 1}
PART_LAYOUT = max(PART_LAYOUTS)  # the newest layout this version speaks
# The layout a peer offers after a round its links held back: finer parts pipeline (a
# reducer answers part 0 while later parts still arrive) and leave a short tail (the last
# part's deltas); on a slow link their per-part CPU is negligible. With layout 1, a 4 MiB slice
# is 2 parts: 20 Mbit/s WAN rounds took 1.28x a raw-TCP butterfly on the same links, with
# layout 0 1.13-1.16x (benchmarks/RESULTS.md, "WAN").
LINK_BOUND_LAYOUT = 0
# A round whose payload (parts and deltas this peer sent) moved slower than this was held
# back by its links, not by CPU (8 x 4M on loopback, 2 cores at load ~10: 16-28 MiB/s, 5 MiB/s
# in a load spike; a 20 Mbit/s uplink moves at most ~2.2 MiB/s of payload).
LINK_BOUND_BYTES_PER_SECOND = 3 << 20
# Smaller rounds say little about the link (latency and fixed costs dominate).
MIN_MEASURED_PAYLOAD_BYTES = 8 << 20


def apportion(total: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """Split ``total`` items into integer sizes proportional to ``fractions`` (largest remainder).

    Deterministic (ties go to the lower index); a zero fraction always gets zero items.

    :raises ValueError: a fraction is negative or not finite, or all of them are zero
    """
    if total < 0:
        raise ValueError(f"total must be non-negative, got {total}")
    fractions = tuple(float(f) for f in fractions)
    if not fractions:
        raise ValueError("need at least one fraction")
    if any(not math.isfinite(f) or f < 0 for f in fractions):
        raise ValueError(f"fractions must be finite and non-negative, got {fractions}")
    top = max(fractions)
    if top * max(total, len(fractions)) > 1e300:  # the sums below would overflow: rescale
        fractions = tuple(f / top for f in fractions)  # (only then: layouts stay as they were)
    norm = math.fsum(fractions)
    if norm <= 0:
        raise ValueError("at least one fraction must be positive")
    quotas = [total * f / norm for f in fractions]
    sizes = [min(total, math.floor(q)) for q in quotas]
    remainders = sorted(
        (i for i, f in enumerate(fractions) if f > 0), key=lambda i: (-(quotas[i] - sizes[i]), i)
    )
    missing = total - sum(sizes)
    while missing > 0:  # at most len(fractions) rounds; more only through float error
        for i in remainders[:missing]:
            sizes[i] += 1
        missing = total - sum(sizes)
    while missing < 0:  # float error the other way: take from the largest
        largest = max(range(len(sizes)), key=lambda i: (sizes[i], -i))
        sizes[largest] -= 1
        missing += 1
    return tuple(sizes)


@dataclass(frozen=True)
class PartSpec:
    """One part: the flat range ``[start, stop)`` of tensor ``tensor_index``."""

    tensor_index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def partition_tensors(
    numels: Sequence[int],
    element_sizes: Sequence[int],
    fractions: Sequence[float],
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
    max_part_size_bytes: int | None = None,
    parts_per_slice: int = PARTS_PER_SLICE,
) -> tuple[tuple[PartSpec, ...], ...]:
    """The parts of every peer, in order: ``result[peer][part]``.

    :param numels: number of values in each tensor
    :param element_sizes: bytes per value of each tensor (a part holds at most
      ``max(1, part_bytes // element_size)`` values)
    :param fractions: each peer's share of the values (zero: the peer reduces nothing)
    :param part_size_bytes: the size of a part, unless the slice is large
    :param max_part_size_bytes: parts of a large slice grow up to this size, keeping about
      ``parts_per_slice`` parts per slice (fewer per-part costs; enough parts to pipeline);
      None: no growth
    :param parts_per_slice: see ``max_part_size_bytes`` (:data:`PART_LAYOUTS`)
    """
    if len(numels) != len(element_sizes):
        raise ValueError("numels and element_sizes have different lengths")
    if part_size_bytes <= 0:
        raise ValueError(f"part_size_bytes must be positive, got {part_size_bytes}")
    if parts_per_slice <= 0:
        raise ValueError(f"parts_per_slice must be positive, got {parts_per_slice}")
    if any(n < 0 for n in numels) or any(s <= 0 for s in element_sizes):
        raise ValueError("numels must be non-negative and element sizes positive")
    slice_sizes = apportion(sum(numels), fractions)
    tensor_starts = [0]
    for n in numels:
        tensor_starts.append(tensor_starts[-1] + n)

    layout: list[tuple[PartSpec, ...]] = []
    slice_start = 0
    tensor_index = 0
    widest = max(element_sizes, default=1)
    for size in slice_sizes:
        part_bytes = part_size_bytes
        if max_part_size_bytes is not None and max_part_size_bytes > part_size_bytes:
            wanted = -(-size * widest // parts_per_slice)
            part_bytes = min(max(wanted, part_size_bytes), max_part_size_bytes)
        slice_stop = slice_start + size
        parts: list[PartSpec] = []
        position = slice_start
        while position < slice_stop:
            while tensor_starts[tensor_index + 1] <= position:
                tensor_index += 1
            values_per_part = max(1, part_bytes // element_sizes[tensor_index])
            offset = position - tensor_starts[tensor_index]
            stop = min(slice_stop, tensor_starts[tensor_index + 1], position + values_per_part)
            parts.append(PartSpec(tensor_index, offset, offset + stop - position))
            position = stop
        layout.append(tuple(parts))
        slice_start = slice_stop
    return tuple(layout)


def held_back_by_links(payload_bytes: int, seconds: float) -> bool | None:
    """Whether a round that sent ``payload_bytes`` in ``seconds`` was held back by its links
    (then offer ``LINK_BOUND_LAYOUT`` next), or None when it was too small to tell."""
    if payload_bytes < MIN_MEASURED_PAYLOAD_BYTES or not seconds > 0:
        return None
    return payload_bytes / seconds < LINK_BOUND_BYTES_PER_SECOND


def largest_part_size(part_size_bytes: int) -> int:
    """The largest part a round with this ``part_size_bytes`` may send (large slices grow
    their parts up to ``LARGE_PART_SIZE_BYTES``, see ``partition_tensors``)."""
    return max(part_size_bytes, LARGE_PART_SIZE_BYTES)


def _check_tensors(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError("need at least one tensor to average")
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {i} is a {type(tensor).__name__}, not a torch.Tensor")
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"tensor {i} has dtype {tensor.dtype}; only floating point averages")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are kept in: float64 for float64 tensors, float32 for the rest."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def as_numpy(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a contiguous CPU tensor of a dtype numpy has (None otherwise)."""
    if (
        tensor.dtype not in _NUMPY_DTYPES
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return None
    return tensor.detach().numpy()


def new_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat CPU tensor in numpy memory (numpy's allocator touches pages faster)."""
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None or numel == 0:
        return torch.empty(numel, dtype=dtype)
    return torch.from_numpy(np.empty(numel, dtype=numpy_dtype))


def _zeros_like(flat: torch.Tensor) -> torch.Tensor:
    """Zeros like a flat tensor; on the CPU from calloc (pages are mapped on first write, not
    filled up front by torch's threads)."""
    numpy_dtype = _NUMPY_DTYPES.get(flat.dtype)
    if numpy_dtype is None or flat.device.type != "cpu" or flat.numel() == 0:
        return torch.zeros_like(flat)
    return torch.from_numpy(np.zeros(flat.numel(), dtype=numpy_dtype))


def _checked_buffers(
    buffers: Sequence[torch.Tensor], flats: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    if len(buffers) != len(flats):
        raise ValueError(f"{len(buffers)} delta buffers for {len(flats)} tensors")
    out = []
    for buffer, flat in zip(buffers, flats, strict=True):
        if (
            buffer.numel() != flat.numel()
            or buffer.dtype != flat.dtype
            or buffer.device != flat.device
            or not buffer.is_contiguous()
        ):
            raise ValueError(
                f"a delta buffer of {buffer.numel()} {buffer.dtype} on {buffer.device} does not "
                f"fit a tensor of {flat.numel()} {flat.dtype} on {flat.device}"
            )
        out.append(buffer.detach().reshape(-1))
    return out


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for flat tensors of one size, single-threaded where possible."""
    target_np, source_np = as_numpy(target), as_numpy(source)
    if target_np is not None and source_np is not None:
        np.copyto(target_np, source_np.reshape(target_np.shape), casting="unsafe")
    else:
        target.copy_(source.reshape(target.shape))


def scaled_sum(
    current: torch.Tensor | None, values: torch.Tensor, weight: float, dtype: torch.dtype
) -> torch.Tensor:
    """``current + weight * values`` computed in ``dtype``, in place into ``current`` (a new
    flat tensor when it is None). A zero weight adds nothing, not even NaN."""
    values = values.detach().reshape(-1)
    if current is None:
        current = new_tensor(values.numel(), dtype)
        current_np, values_np = as_numpy(current), as_numpy(values)
        if current_np is None or values_np is None:
            torch.mul(values.to(dtype), weight, out=current) if weight else current.zero_()
        elif weight:
            np.multiply(values_np, weight, out=current_np, dtype=current_np.dtype)
        else:
            current_np.fill(0)
        return current
    current_np, values_np = as_numpy(current), as_numpy(values)
    if not weight:
        pass
    elif current_np is None or values_np is None:
        current.add_(values.to(current.dtype), alpha=weight)
    elif weight == 1.0:
        np.add(current_np, values_np, out=current_np, dtype=current_np.dtype)
    else:
        np.add(current_np, np.multiply(values_np, weight, dtype=current_np.dtype), out=current_np)
    return current


def difference(
    average: torch.Tensor, local: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``average - local`` (flat) in ``local``'s dtype, computed in ``average``'s.

    :param out: a flat tensor of ``local``'s size and dtype to write the result into (it may
      be ``local`` itself); a new tensor when None
    """
    local = local.detach().reshape(-1)
    average_np, local_np = as_numpy(average), as_numpy(local)
    if out is not None:
        out_np = as_numpy(out)
        if average_np is None or local_np is None or out_np is None:
            out.copy_((average - local.to(average.dtype)).to(local.dtype))
        else:
            np.subtract(average_np, local_np, out=out_np, dtype=average_np.dtype)
        return out
    if average_np is None or local_np is None:
        return (average - local.to(average.dtype)).to(local.dtype)
    result = np.subtract(average_np, local_np, dtype=average_np.dtype)
    if result.dtype != local_np.dtype:
        result = result.astype(local_np.dtype)
    return torch.from_numpy(result)


class TensorPartContainer:
    """One peer's tensors cut into parts (to send), plus the deltas received for them.

    :param tensors: the local tensors (floating point, any shape; read, never written)
    :param peer_fractions: each peer's share of the values, in group order
    :param part_size_bytes: largest raw size of one part
    :param max_part_size_bytes: parts of large slices grow up to this size (see
      :func:`partition_tensors`, also for ``parts_per_slice``)
    :param delta_buffers: flat tensors to write the deltas into (one per tensor, same numel and
      dtype, any content: the container never reads them before writing), e.g. the previous
      round's; fresh zeroed buffers when None. Reusing buffers saves mapping fresh pages.

    A delta is ``average - local`` for one part. Parts whose reducer failed keep a zero delta:
    the local values are kept for them.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        peer_fractions: Sequence[float],
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        delta_buffers: Sequence[torch.Tensor] | None = None,
        max_part_size_bytes: int | None = None,
        parts_per_slice: int = PARTS_PER_SLICE,
    ):
        _check_tensors(tensors)
        self.tensors = tuple(tensors)
        self._flat = [t.detach().reshape(-1) for t in self.tensors]
        self.layout = partition_tensors(
            [t.numel() for t in self.tensors],
            [t.element_size() for t in self.tensors],
            peer_fractions,
            part_size_bytes,
            max_part_size_bytes,
            parts_per_slice,
        )
        self.group_size = len(self.layout)
        self.num_parts_by_peer = tuple(len(parts) for parts in self.layout)
        if delta_buffers is None:
            self._deltas = [_zeros_like(flat) for flat in self._flat]
            self._zeroed = True
        else:
            self._deltas = _checked_buffers(delta_buffers, self._flat)
            self._zeroed = False  # a reused buffer: parts without a delta are zeroed at the end
        self._received = [[False] * n for n in self.num_parts_by_peer]
        self._num_received = [0] * self.group_size
        self._failed = [False] * self.group_size
        # parts whose delta region was handed out to be written in place (delta_target)
        self._written: set[tuple[int, int]] = set()

    def part_spec(self, peer_index: int, part_index: int) -> PartSpec:
        return self.layout[peer_index][part_index]

    def input_part(self, peer_index: int, part_index: int) -> torch.Tensor:
        """The local values of one part, as a flat tensor (a view where possible)."""
        spec = self.layout[peer_index][part_index]
        return self._flat[spec.tensor_index][spec.start : spec.stop]

    def input_parts(self, peer_index: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.input_part(peer_index, k) for k in range(len(self.layout[peer_index])))

    def part_dtype(self, peer_index: int, part_index: int) -> torch.dtype:
        return self.tensors[self.layout[peer_index][part_index].tensor_index].dtype

    def delta_target(self, peer_index: int, part_index: int) -> torch.Tensor | None:
        """Where the delta of one part lives, to decode it straight there (a flat contiguous
        CPU tensor; None when the buffers are elsewhere or the part was registered already).

        The region counts as written from now on: unless the part is then registered with
        that delta, :meth:`deltas` zeroes it (a failed decode never leaves bytes behind).
        """
        if not 0 <= part_index < self.num_parts_by_peer[peer_index]:
            return None
        if self._failed[peer_index] or self._received[peer_index][part_index]:
            return None
        spec = self.layout[peer_index][part_index]
        region = self._deltas[spec.tensor_index][spec.start : spec.stop]
        if region.device.type != "cpu" or not region.is_contiguous():
            return None
        self._written.add((peer_index, part_index))
        return region

    def register_delta(self, peer_index: int, part_index: int, delta: torch.Tensor | None) -> None:
        """Record ``average - local`` for one part (None: keep the local values).

        :raises ValueError: unknown or already registered part, or a delta of the wrong size
        """
        if self._failed[peer_index]:
            raise ValueError(f"reducer {peer_index} already failed")
        if not 0 <= part_index < self.num_parts_by_peer[peer_index]:
            raise ValueError(f"reducer {peer_index} has no part {part_index}")
        if self._received[peer_index][part_index]:
            raise ValueError(f"part {part_index} of reducer {peer_index} was already registered")
        spec = self.layout[peer_index][part_index]
        if delta is not None:
            if delta.numel() != spec.numel:
                raise ValueError(
                    f"part {part_index} of reducer {peer_index} has {spec.numel} values, "
                    f"got a delta of {delta.numel()}"
                )
            target = self._deltas[spec.tensor_index][spec.start : spec.stop]
            if target.data_ptr() != delta.data_ptr():  # not decoded in place already
                copy_into(target, delta)
        elif not self._zeroed or (peer_index, part_index) in self._written:
            self._deltas[spec.tensor_index][spec.start : spec.stop].zero_()
        self._received[peer_index][part_index] = True
        self._num_received[peer_index] += 1

    def register_failed_reducer(self, peer_index: int) -> int:
        """The reducer failed: its parts not received yet keep local values. Returns how many."""
        if self._failed[peer_index]:
            return 0
        self._failed[peer_index] = True
        return self.num_parts_by_peer[peer_index] - self._num_received[peer_index]

    def reducer_done(self, peer_index: int) -> bool:
        """Whether every part of this reducer arrived, or it failed."""
        return (
            self._failed[peer_index]
            or self._num_received[peer_index] == self.num_parts_by_peer[peer_index]
        )

    def num_received(self, peer_index: int) -> int:
        return self._num_received[peer_index]

    @property
    def finished(self) -> bool:
        return all(self.reducer_done(i) for i in range(self.group_size))

    @property
    def delta_buffers(self) -> tuple[torch.Tensor, ...]:
        """The flat buffers the deltas live in (to reuse in a later round)."""
        return tuple(self._deltas)

    def deltas(self) -> tuple[torch.Tensor, ...]:
        """``average - local`` for every tensor, in its shape and dtype."""
        # parts never received keep the local values: zero them in reused buffers, and
        # wherever a delta was being written in place (delta_target) but never registered
        for peer_index, parts in enumerate(self.layout):
            for part_index, spec in enumerate(parts):
                if self._received[peer_index][part_index]:
                    continue
                if not self._zeroed or (peer_index, part_index) in self._written:
                    self._deltas[spec.tensor_index][spec.start : spec.stop].zero_()
        return tuple(d.reshape(t.shape) for d, t in zip(self._deltas, self.tensors, strict=True))
