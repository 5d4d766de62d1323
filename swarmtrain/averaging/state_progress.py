"""How far a state download got, in bytes of the state (``swarmtrain.utils.progress`` shows it).

A download counts the decoded size of each tensor received in full plus the received share of
the tensor in flight (its wire bytes so far over the wire bytes its first chunk announced, times
its decoded size), so a compressed transfer moves the bar smoothly and ends at the state's size.
The total is the sum of the checked tensor specs (known once the first donor's metadata passed
the caller's check); without a check it is the size the donor's header announces
(``StateHeader.state_bytes``: for display only, nothing is allocated by it); a donor of an older
version announces none, and the bar shows bytes and rate without a total (no ETA). When
a donor fails, the tensor in flight is dropped (and with a rejected donor, its tensors): the
count goes back to what is kept, and the next donor's bytes count from there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from swarmtrain.averaging.state_checks import TensorSpec
from swarmtrain.compression.wire import numpy_dtype
from swarmtrain.proto import tensor_pb2
from swarmtrain.utils.progress import Progress

__all__ = ["StateDownloadProgress"]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class StateDownloadProgress:
    """Byte accounting of one ``load_state_from_peers``; opens its :class:`Progress` at the first
    header (a download that finds no donor shows nothing) and closes it in :meth:`close`.

    :param open_progress: makes the progress display, given the total (None: unknown)
    """

    def __init__(self, open_progress: Callable[[int | None], Progress]):
        self._open = open_progress
        self.progress: Progress | None = None
        self._kept = [0]  #: _kept[i]: decoded bytes of tensors 0..i-1 (received in full)
        self._in_flight: tuple[int, int, int] | None = None  # (decoded bytes, wire size, received)

    @property
    def done(self) -> int:
        """Bytes of the state received so far."""
        done = self._kept[-1]
        if self._in_flight is not None:
            size, wire_size, received = self._in_flight
            done += size * min(received, wire_size) // wire_size if wire_size else 0
        return done

    def on_header(self, specs: Sequence[TensorSpec] | None, announced: int | None = None) -> None:
        """The download's metadata is in use (``specs``: the checked shape and dtype of each
        tensor, None without a check; ``announced``: the state's size in bytes as the donor's
        header gives it, None or 0 when it gives none)."""
        if self.progress is None:
            if specs is not None:
                total: int | None = sum(_nbytes(s.shape, s.dtype) for s in specs)
            else:
                total = announced or None
            self.progress = self._open(total)

    def on_chunk(self, chunk: tensor_pb2.Tensor) -> None:
        """A chunk of the tensor in flight arrived (after the assembler accepted it)."""
        if chunk.chunk_index == 0:  # a tensor's first chunk (or its only message)
            size = math.prod(chunk.size) * numpy_dtype(chunk.dtype).itemsize
            wire_size = chunk.buffer_size if chunk.chunks else len(chunk.buffer)
            self._in_flight = (size, wire_size, len(chunk.buffer))
        elif self._in_flight is not None:
            size, wire_size, received = self._in_flight
            self._in_flight = (size, wire_size, received + len(chunk.buffer))
        self._report()

    def on_tensor(self, index: int, tensor: torch.Tensor) -> None:
        """Tensor ``index`` was received in full and kept."""
        del self._kept[index + 1 :]
        self._kept.append(self._kept[index] + _nbytes(tensor.shape, tensor.dtype))
        self._in_flight = None
        self._report()

    def rewind(self, kept: int) -> None:
        """Only the first ``kept`` tensors are kept (a donor failed or was rejected)."""
        del self._kept[kept + 1 :]
        self._in_flight = None
        self._report()

    def close(self, ok: bool, note: str = "") -> None:
        if self.progress is not None:
            self.progress.close(ok, note)

    def _report(self) -> None:
        if self.progress is not None:
            self.progress.update_to(self.done)
