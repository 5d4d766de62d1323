"""State of one butterfly all-reduce round, without I/O (sans-IO core).

The async shell (``swarmtrain.averaging.allreduce``) feeds events in and does what the return
values say; every method takes ``now`` where time matters and none of them waits.

Roles. Every peer of the group has a mode:

======  ============================  =================================
mode    sends its tensors (a sender)  reduces a slice (fraction > 0)
======  ============================  =================================
NODE    yes                           if its fraction is positive
CLIENT  yes                           never (fraction 0)
AUX     never (weight-less helper)    yes
======  ============================  =================================

Reducer side (the local slice, if any): each sender opens one stream and sends its parts in
order; a part is averaged once every sender that is not banned contributed it. A sender is
banned when it never opens a stream within ``sender_timeout`` of the start, when its next part
does not arrive within ``sender_timeout`` of the previous result (both moved out while the
bytes of that request keep arriving, see ``stall_core.ProgressDeadline``: a slow path is not
a stalled sender), when it sends bad data
(NaN or inf values included: ``Failure.NON_FINITE``; a weight above ``max_peer_weight``:
``Failure.IMPLAUSIBLE``), or when its stream fails. The reducer then finishes with the others;
the parts it had contributed before stay in. ``aggregation="centered_clip"`` replaces the
weighted mean of each part by CenteredClip (``robust_aggregation``), which bounds how far one
sender's values can move the result.

Sender side (the local tensors, unless AUX): for each reducer we receive one delta
(average - local) per part. A reducer that sends nothing for ``reducer_timeout``, sends bad
data (NaN or inf included), rejects us or disconnects is *failed*: its slice keeps our local
values where no delta arrived yet. So is one whose delta is absurd: a norm more than
``max_delta_ratio`` (1e3) times our own part's (``Failure.IMPLAUSIBLE``; a cheap check, skipped
where our part is zero).

``reducer_timeout`` must exceed ``sender_timeout``: a reducer legitimately waits up to
``sender_timeout`` for a slow sender before it can answer.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import torch

from swarmtrain.averaging.finite import all_finite
from swarmtrain.averaging.part_reducer import TensorPartReducer
from swarmtrain.averaging.partition import (
    DEFAULT_PART_SIZE_BYTES,
    PART_LAYOUTS,
    TensorPartContainer,
    as_numpy,
    difference,
    largest_part_size,
)
from swarmtrain.p2p.stall_core import ProgressDeadline

DEFAULT_MAX_PEER_WEIGHT = 1e9
"""A sender's weight above this is refused (``Failure.IMPLAUSIBLE``): weights are sample
counts, and a larger claim would let one peer's values replace everyone's (or overflow the
float32 sums)."""
DEFAULT_MAX_DELTA_RATIO = 1e3
"""A reducer whose delta's norm exceeds this many times our part's norm has failed."""

__all__ = [
    "AllReduceCore",
    "AllReduceGroup",
    "AllReduceStatistics",
    "DEFAULT_MAX_DELTA_RATIO",
    "DEFAULT_MAX_PEER_WEIGHT",
    "AveragingMode",
    "Failure",
    "PartOutcome",
    "Reject",
]


#: how the caller names peers (the shell: libp2p peer ids; tests: anything hashable)
PeerT = TypeVar("PeerT", bound=Hashable)


class AveragingMode(enum.Enum):
    """A peer's role in a group (hivemind's names)."""

    NODE = 0
    CLIENT = 1
    AUX = 2


class Reject(enum.Enum):
    """Why a reducer refuses a sender's stream (mirrors AveragingCode in averaging.proto)."""

    BAD_GROUP_ID = "bad_group_id"
    NOT_A_SENDER = "not_a_sender"
    NOT_A_REDUCER = "not_a_reducer"
    DUPLICATE_SENDER = "duplicate_sender"
    BANNED = "banned"
    BAD_PART = "bad_part"
    FINISHED = "finished"


class Failure(enum.Enum):
    """Why a sender was banned or a reducer failed."""

    TIMEOUT = "timeout"
    DISCONNECTED = "disconnected"
    BAD_DATA = "bad_data"
    NON_FINITE = "non_finite"  # NaN or inf values: left out, so that no average gets them
    REJECTED = "rejected"
    DEADLINE = "deadline"
    IMPLAUSIBLE = "implausible"  # a weight above max_peer_weight, or an absurd delta


BAD_BEHAVIOUR = frozenset({Failure.BAD_DATA, Failure.NON_FINITE, Failure.IMPLAUSIBLE})
"""Failures that a peer's own data caused (not the network): worth a ban across rounds."""


@dataclass(frozen=True)
class AllReduceGroup(Generic[PeerT]):
    """Who takes part in a round, agreed on by every member before it starts.

    :param group_id: unique id of this round
    :param peer_ids: members in order; the i-th reduces the i-th slice
    :param fractions: each member's share of the values to reduce (0 for clients)
    :param modes: each member's mode; default CLIENT for a zero fraction, else NODE
    :param leader: the member that assembled the group, if known (told to the others with
      the first request, see ``AllReduceService.may_join_unknown_groups``)
    :param part_layout: how slices are cut into parts (``partition.PART_LAYOUTS``); every
      member must use the same (the averager takes it from matchmaking)
    """

    group_id: bytes
    peer_ids: tuple[PeerT, ...]
    fractions: tuple[float, ...]
    modes: tuple[AveragingMode, ...] = ()
    leader: PeerT | None = None
    part_layout: int = 0

    def __post_init__(self):
        if not isinstance(self.group_id, bytes) or not self.group_id:
            raise ValueError("group_id must be non-empty bytes")
        object.__setattr__(self, "peer_ids", tuple(self.peer_ids))
        object.__setattr__(self, "fractions", tuple(float(f) for f in self.fractions))
        modes = tuple(self.modes) or tuple(
            AveragingMode.CLIENT if f == 0 else AveragingMode.NODE for f in self.fractions
        )
        object.__setattr__(self, "modes", modes)
        n = len(self.peer_ids)
        if n == 0:
            raise ValueError("a group needs at least one peer")
        if len(set(self.peer_ids)) != n:
            raise ValueError("peer_ids must be unique")
        if len(self.fractions) != n or len(self.modes) != n:
            raise ValueError("peer_ids, fractions and modes must have the same length")
        if self.leader is not None and self.leader not in self.peer_ids:
            raise ValueError("the leader must be a member of the group")
        if self.part_layout not in PART_LAYOUTS:
            raise ValueError(f"unknown part layout {self.part_layout!r}")
        for peer, f, mode in zip(self.peer_ids, self.fractions, self.modes, strict=True):
            if not isinstance(mode, AveragingMode):
                raise TypeError(f"mode of {peer} is {mode!r}, not an AveragingMode")
            if not math.isfinite(f) or f < 0:
                raise ValueError(f"fraction of {peer} must be finite and non-negative, got {f}")
            if mode == AveragingMode.CLIENT and f != 0:
                raise ValueError(f"{peer} is a CLIENT, so its fraction must be 0, got {f}")
        if not any(f > 0 for f in self.fractions):
            raise ValueError("at least one peer must have a positive fraction (a reducer)")

    @property
    def size(self) -> int:
        return len(self.peer_ids)

    def index_of(self, peer_id: Hashable) -> int | None:
        try:
            return self.peer_ids.index(peer_id)
        except ValueError:
            return None

    @property
    def sender_indices(self) -> tuple[int, ...]:
        """Group indices of the senders (every peer but AUX), in group order."""
        return tuple(i for i, m in enumerate(self.modes) if m != AveragingMode.AUX)


@dataclass(frozen=True)
class PartOutcome:
    """What a received part led to: the local parts now averaged, or a rejection."""

    completed: tuple[int, ...] = ()
    reject: Reject | None = None


@dataclass(frozen=True)
class AllReduceStatistics:
    parts_to_reduce: int
    parts_reduced: int
    parts_expected: int
    parts_received: int
    banned_senders: frozenset[Hashable] = field(default_factory=frozenset)
    failed_reducers: frozenset[Hashable] = field(default_factory=frozenset)
    finished: bool = False


class _Sender(enum.Enum):
    WAITING = 0  # has not opened a stream yet
    ACTIVE = 1
    DONE = 2  # received the results of all its parts
    BANNED = 3


class AllReduceCore(Generic[PeerT]):
    """One peer's state for one round.

    :param group: the members, fractions and modes
    :param local_index: our index in ``group``
    :param tensors: our tensors (an AUX peer passes tensors of the right shapes and dtypes)
    :param weight: our weight in the average (ignored for AUX)
    :param sender_timeout: seconds a sender may take to open its stream, and to send each part
      after the previous result (None: no limit)
    :param reducer_timeout: seconds a reducer may take for each result (None: no limit)
    :param now: the start time of the round
    :param max_peer_weight: senders claiming a larger weight are banned (``IMPLAUSIBLE``)
    :param max_delta_ratio: a reducer's delta with a norm above this many times our part's
      fails it (``IMPLAUSIBLE``; None: no check)
    :param aggregation: ``"mean"`` or ``"centered_clip"`` (see ``TensorPartReducer``), with
      ``clip_tau`` and ``clip_iterations``
    """

    def __init__(
        self,
        group: AllReduceGroup[PeerT],
        local_index: int,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        now: float = 0.0,
        delta_buffers: Sequence[torch.Tensor] | None = None,
        max_peer_weight: float = DEFAULT_MAX_PEER_WEIGHT,
        max_delta_ratio: float | None = DEFAULT_MAX_DELTA_RATIO,
        aggregation: str = "mean",
        clip_tau: float | None = None,
        clip_iterations: int = 5,
    ):
        if not 0 <= local_index < group.size:
            raise ValueError(f"local_index {local_index} is outside the group")
        max_peer_weight = float(max_peer_weight)
        if not max_peer_weight > 0:
            raise ValueError(f"max_peer_weight must be positive, got {max_peer_weight}")
        if max_delta_ratio is not None and not max_delta_ratio > 0:
            raise ValueError(f"max_delta_ratio must be positive or None, got {max_delta_ratio}")
        weight = float(weight)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and non-negative, got {weight}")
        if weight > max_peer_weight:
            raise ValueError(
                f"weight {weight} is above max_peer_weight ({max_peer_weight}): the other "
                "members would refuse it"
            )
        for name, value in (
            ("sender_timeout", sender_timeout),
            ("reducer_timeout", reducer_timeout),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if reducer_timeout is not None and (
            sender_timeout is None or reducer_timeout <= sender_timeout
        ):
            raise ValueError(
                "reducer_timeout needs a shorter sender_timeout: a reducer waits up to "
                "sender_timeout for slow senders before it can answer"
            )
        self.group = group
        self.local_index = local_index
        self.mode = group.modes[local_index]
        self.weight = weight
        self.max_peer_weight = max_peer_weight
        self.max_delta_ratio = max_delta_ratio
        self.sender_timeout = math.inf if sender_timeout is None else float(sender_timeout)
        self.reducer_timeout = math.inf if reducer_timeout is None else float(reducer_timeout)
        self.start_time = now
        self.container = TensorPartContainer(
            tensors,
            group.fractions,
            part_size_bytes,
            delta_buffers=delta_buffers,
            max_part_size_bytes=largest_part_size(part_size_bytes),
            parts_per_slice=PART_LAYOUTS[group.part_layout],
        )
        self._sender_slot = {peer: slot for slot, peer in enumerate(group.sender_indices)}

        # reducer side
        n_local = self.container.num_parts_by_peer[local_index]
        self._local_parts = self.container.input_parts(local_index)
        self.reducer = TensorPartReducer(
            [p.numel() for p in self._local_parts],
            [self.container.part_dtype(local_index, k) for k in range(n_local)],
            len(group.sender_indices),
            aggregation=aggregation,
            clip_tau=clip_tau,
            clip_iterations=clip_iterations,
        )
        self._senders: dict[int, _Sender] = {}
        self._sender_weight: dict[int, float] = {}
        self._next_part: dict[int, int] = {}
        self._last_activity: dict[int, float] = {}
        # senders whose first request is arriving (bytes came, the stream is not open yet)
        self._arriving: dict[int, ProgressDeadline] = {}
        if n_local:
            for peer in group.sender_indices:
                self._senders[peer] = _Sender.WAITING

        # sender side
        self._reducer_failures: dict[int, Failure] = {}
        self._reducer_activity: dict[int, float] = {}
        if self.is_sender:
            for peer, n in enumerate(self.container.num_parts_by_peer):
                if n and peer != local_index:
                    self._reducer_activity[peer] = now
        self._ban_reasons: dict[int, Failure] = {}
        self._unreported_parts: list[int] = []  # completed, not yet taken by the shell

        if n_local and self.is_sender:  # our own contribution needs no network
            self._senders[local_index] = _Sender.ACTIVE
            completed: list[int] = []
            for k, part in enumerate(self._local_parts):
                completed += self.reducer.accumulate(self._slot(local_index), k, part, weight)
            self._on_completed(tuple(completed))

    # ------------------------------------------------------------------ properties

    @property
    def is_sender(self) -> bool:
        return self.mode != AveragingMode.AUX

    @property
    def is_reducer(self) -> bool:
        return self.container.num_parts_by_peer[self.local_index] > 0

    @property
    def num_local_parts(self) -> int:
        return self.reducer.num_parts

    def local_part_shape(self, part_index: int) -> tuple[tuple[int], torch.dtype]:
        """Shape and dtype a sender's part ``part_index`` of our slice must have."""
        spec = self.container.part_spec(self.local_index, part_index)
        return (spec.numel,), self.container.part_dtype(self.local_index, part_index)

    def remote_reducers(self) -> tuple[int, ...]:
        """Group indices of the reducers we send to over the network."""
        return tuple(self._reducer_activity)

    def num_parts_for(self, reducer: int) -> int:
        return self.container.num_parts_by_peer[reducer]

    @property
    def sending_finished(self) -> bool:
        return not self.is_sender or self.container.finished

    @property
    def reducing_finished(self) -> bool:
        return all(state in (_Sender.DONE, _Sender.BANNED) for state in self._senders.values())

    @property
    def finished(self) -> bool:
        return self.sending_finished and self.reducing_finished

    # ------------------------------------------------------------------ reducer side

    def open_sender(
        self, peer: int | None, group_id: bytes, weight: float, now: float
    ) -> Reject | None:
        """A stream arrived from group member ``peer`` (None: not a member). Accept or reject."""
        if group_id != self.group.group_id:
            return Reject.BAD_GROUP_ID
        if peer is None or peer not in self._sender_slot or peer == self.local_index:
            return Reject.NOT_A_SENDER
        if not self.is_reducer:
            return Reject.NOT_A_REDUCER
        state = self._senders[peer]
        if state == _Sender.BANNED:
            return Reject.BANNED
        if self.reducing_finished:
            return Reject.FINISHED
        if state != _Sender.WAITING:
            return Reject.DUPLICATE_SENDER
        if not math.isfinite(weight) or weight < 0:
            self.ban_sender(peer, Failure.BAD_DATA)
            return Reject.BAD_PART
        if weight > self.max_peer_weight:
            self.ban_sender(peer, Failure.IMPLAUSIBLE)
            return Reject.BAD_PART
        self._senders[peer] = _Sender.ACTIVE
        self._sender_weight[peer] = float(weight)
        self._next_part[peer] = 0
        self._last_activity[peer] = now
        return None

    def receive_part(
        self, peer: int, part_index: int, tensor: torch.Tensor | None, now: float
    ) -> PartOutcome:
        """Part ``part_index`` from an active sender; None means it could not be decoded. A
        part with NaN or inf values bans the sender (``Failure.NON_FINITE``)."""
        state = self._senders.get(peer)
        if state == _Sender.BANNED:
            return PartOutcome(reject=Reject.BANNED)
        if state != _Sender.ACTIVE or self.reducer.is_complete(part_index):
            return PartOutcome(self.ban_sender(peer, Failure.BAD_DATA), Reject.BAD_PART)
        shape, _ = (
            self.local_part_shape(part_index)
            if part_index < self.num_local_parts
            else ((-1,), None)
        )
        if (
            tensor is None
            or part_index != self._next_part[peer]
            or tuple(tensor.shape) != shape
            or not tensor.dtype.is_floating_point
        ):
            return PartOutcome(self.ban_sender(peer, Failure.BAD_DATA), Reject.BAD_PART)
        if not all_finite(tensor):
            return PartOutcome(self.ban_sender(peer, Failure.NON_FINITE), Reject.BAD_PART)
        self._next_part[peer] = part_index + 1
        self._last_activity[peer] = now
        completed = self.reducer.accumulate(
            self._slot(peer), part_index, tensor, self._sender_weight[peer]
        )
        self._on_completed(completed)
        return PartOutcome(completed)

    def sender_banned(self, peer: int) -> bool:
        return self._senders.get(peer) == _Sender.BANNED

    def is_part_ready(self, part_index: int) -> bool:
        return self.reducer.is_complete(part_index)

    def delta_for(
        self, peer: int, part_index: int, sent: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``average - sent`` for a complete part (None: keep local values), in ``sent``'s dtype.

        Call once the sender's result is about to go out; :meth:`result_sent` afterwards.
        ``out``: write it there (e.g. into ``sent``, a received part nothing else reads any
        more) instead of a new tensor.
        """
        average = self.reducer.result(part_index)
        if average is None:
            return None
        return difference(average, sent, out=out)

    def result_sent(self, peer: int, part_index: int, now: float) -> None:
        """The result of ``part_index`` went out to ``peer``: its next part is now due."""
        if self._senders.get(peer) != _Sender.ACTIVE:
            return
        self._last_activity[peer] = now
        if part_index + 1 >= self.num_local_parts:
            self._senders[peer] = _Sender.DONE

    def sender_deadline(self, peer: int) -> float:
        """When ``peer``'s next part is overdue."""
        return self._last_activity.get(peer, self.start_time) + self.sender_timeout

    def sender_arriving(self, peer: int, count: int, now: float) -> None:
        """``count`` bytes of ``peer``'s first request arrived (its stream opens once the
        whole first part is in: over a slow path that may take longer than
        ``sender_timeout``): its deadline to open moves out while they keep coming
        (``ProgressDeadline``, patience ``sender_timeout``)."""
        if self._senders.get(peer) != _Sender.WAITING:
            return
        guard = self._arriving.get(peer)
        if guard is None:
            first = self.start_time + self.sender_timeout
            guard = self._arriving[peer] = ProgressDeadline(first, self.sender_timeout)
        guard.on_bytes(count, now)

    def _open_deadline(self, peer: int) -> float:
        guard = self._arriving.get(peer)
        return guard.deadline if guard is not None else self.start_time + self.sender_timeout

    @property
    def missing_senders_deadline(self) -> float:
        """When the next sender that has not opened its stream gets banned (inf: none left)."""
        waiting = [p for p, state in self._senders.items() if state == _Sender.WAITING]
        return min((self._open_deadline(p) for p in waiting), default=math.inf)

    def ban_missing_senders(self, now: float) -> tuple[int, ...]:
        """Ban senders still without a stream whose deadline passed; return completed parts.
        A sender whose first request is still arriving is waited for (``sender_arriving``)."""
        completed: list[int] = []
        for peer, state in list(self._senders.items()):
            if state == _Sender.WAITING and now >= self._open_deadline(peer):
                completed += self.ban_sender(peer, Failure.TIMEOUT)
        return tuple(completed)

    def ban_absent_sender(self, peer: int, reason: Failure) -> tuple[int, ...]:
        """``peer`` said it runs no such round (it answered our stream so): stop waiting for
        its parts if none came yet, instead of until ``sender_timeout``."""
        if self._senders.get(peer) != _Sender.WAITING:
            return ()
        return self.ban_sender(peer, reason)

    def ban_sender(self, peer: int, reason: Failure) -> tuple[int, ...]:
        """Stop waiting for ``peer`` (see Failure); return the parts that became complete."""
        if self._senders.get(peer) in (None, _Sender.BANNED, _Sender.DONE):
            return ()
        self._senders[peer] = _Sender.BANNED
        self._ban_reasons[peer] = reason
        completed = self.reducer.ban(self._slot(peer))
        self._on_completed(completed)
        return completed

    def take_completed(self) -> tuple[int, ...]:
        """The local parts completed since the last call, whichever call completed them (a
        sender's part, a ban in ``open_sender``, a deadline). A shell wakes the streams
        waiting on these parts from here, so no completion can go unannounced."""
        completed, self._unreported_parts = tuple(self._unreported_parts), []
        return completed

    def _on_completed(self, completed: tuple[int, ...]) -> None:
        self._unreported_parts.extend(completed)
        local = self.local_index
        if not completed or self._senders.get(local) != _Sender.ACTIVE:
            return
        for k in completed:
            # written straight into the round's delta buffer (registering it copies nothing)
            out = None if self.reducer.result(k) is None else self.container.delta_target(local, k)
            delta = self.delta_for(local, k, self._local_parts[k], out=out)
            self.container.register_delta(local, k, delta)
        if self.reducer.finished:
            self._senders[local] = _Sender.DONE

    def _slot(self, peer: int) -> int:
        return self._sender_slot[peer]

    # ------------------------------------------------------------------ sender side

    def reducer_deadline(self, reducer: int) -> float:
        """When the next result of ``reducer`` is overdue."""
        return self._reducer_activity[reducer] + self.reducer_timeout

    def receive_delta(
        self,
        reducer: int,
        part_index: int,
        delta: torch.Tensor | None,
        *,
        unchanged: bool,
        now: float,
    ) -> bool:
        """A result from ``reducer``: a delta, or ``unchanged`` (keep local values).

        ``delta`` None without ``unchanged`` means it could not be decoded. Returns False (and
        fails the reducer) for bad data; ``Failure.NON_FINITE`` for NaN or inf values,
        ``Failure.IMPLAUSIBLE`` for a delta far larger than our part (``max_delta_ratio``).
        """
        if reducer not in self._reducer_activity or self.container.reducer_done(reducer):
            return False
        expected = self.container.num_received(reducer)
        spec_numel = (
            self.container.part_spec(reducer, part_index).numel
            if part_index < self.num_parts_for(reducer)
            else -1
        )
        bad = part_index != expected or (
            not unchanged
            and (
                delta is None
                or tuple(delta.shape) != (spec_numel,)
                or not delta.dtype.is_floating_point
            )
        )
        if bad:
            self.fail_reducer(reducer, Failure.BAD_DATA)
            return False
        if not unchanged:
            assert delta is not None  # else bad
            norm = _finite_norm(delta)
            if norm is None:
                self.fail_reducer(reducer, Failure.NON_FINITE)
                return False
            if self.max_delta_ratio is not None and not _plausible(
                norm, self.container.input_part(reducer, part_index), self.max_delta_ratio
            ):
                self.fail_reducer(reducer, Failure.IMPLAUSIBLE)
                return False
        self.container.register_delta(reducer, part_index, None if unchanged else delta)
        self._reducer_activity[reducer] = now
        return True

    def fail_reducer(self, reducer: int, reason: Failure) -> None:
        """Keep local values for whatever ``reducer`` has not answered yet."""
        if reducer not in self._reducer_activity or self.container.reducer_done(reducer):
            return
        self.container.register_failed_reducer(reducer)
        self._reducer_failures[reducer] = reason

    # ------------------------------------------------------------------ round

    def expire(self, now: float) -> tuple[int, ...]:
        """The overall deadline passed: fail every pending reducer and sender."""
        for reducer in self._reducer_activity:
            self.fail_reducer(reducer, Failure.DEADLINE)
        completed: list[int] = []
        for peer, state in list(self._senders.items()):
            if state in (_Sender.WAITING, _Sender.ACTIVE) and peer != self.local_index:
                completed += self.ban_sender(peer, Failure.DEADLINE)
        if self._senders.get(self.local_index) == _Sender.ACTIVE:  # nothing left to wait for
            self._senders[self.local_index] = _Sender.DONE
        return tuple(completed)

    def deltas(self) -> tuple[torch.Tensor, ...] | None:
        """``average - local`` per tensor (zero where a reducer failed); None for AUX peers."""
        return self.container.deltas() if self.is_sender else None

    @property
    def banned_senders(self) -> dict[PeerT, Failure]:
        return {self.group.peer_ids[p]: r for p, r in self._ban_reasons.items()}

    @property
    def failed_reducers(self) -> dict[PeerT, Failure]:
        return {self.group.peer_ids[p]: r for p, r in self._reducer_failures.items()}

    def statistics(self) -> AllReduceStatistics:
        expected = sum(self.num_parts_for(r) for r in self._reducer_activity)
        received = sum(self.container.num_received(r) for r in self._reducer_activity)
        return AllReduceStatistics(
            parts_to_reduce=self.num_local_parts,
            parts_reduced=self.reducer.num_complete,
            parts_expected=expected,
            parts_received=received,
            banned_senders=frozenset(self.banned_senders),
            failed_reducers=frozenset(self.failed_reducers),
            finished=self.finished,
        )


_SAMPLES = 64


def _finite_norm(tensor: torch.Tensor) -> float | None:
    """The L2 norm of ``tensor``, or None if it holds NaN or inf (one pass, like ``all_finite``:
    a finite sum of squares proves every value finite)."""
    array = as_numpy(tensor)
    if array is not None and array.dtype != np.float16:
        flat = array.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            squares = float(np.einsum("i,i", flat, flat))  # one thread, no temporary
        if math.isfinite(squares):
            return math.sqrt(squares)
        if not np.isfinite(flat).all():
            return None
        return float(np.linalg.norm(flat.astype(np.float64)))  # finite, but squares overflow
    if not all_finite(tensor):
        return None
    return float(torch.linalg.vector_norm(tensor.detach().reshape(-1).double()))


def _plausible(delta_norm: float, own: torch.Tensor, ratio: float) -> bool:
    """Whether ``delta_norm <= ratio * |own|`` (or ``own`` is zero). A strided sample of
    ``own`` bounds its norm from below, so the full pass runs only when that is not enough."""
    flat = own.detach().reshape(-1)
    array = as_numpy(flat)
    if array is not None:
        sample = array[:: max(1, array.size // _SAMPLES)].astype(np.float64)
        if delta_norm <= ratio * math.sqrt(float(np.dot(sample, sample))):
            return True
    else:
        strided = flat[:: max(1, flat.numel() // _SAMPLES)]
        if delta_norm <= ratio * float(torch.linalg.vector_norm(strided.double())):
            return True
    own_norm = float(torch.linalg.vector_norm(flat.double()))
    return own_norm == 0 or delta_norm <= ratio * own_norm
