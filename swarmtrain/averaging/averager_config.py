"""``AveragerConfig``: ``DecentralizedAverager``'s keywords (hivemind's names), validated once."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarmtrain.averaging.allreduce import AllReduceConfig
from swarmtrain.averaging.allreduce_core import DEFAULT_MAX_PEER_WEIGHT, AveragingMode
from swarmtrain.averaging.ban_list import DEFAULT_BAN_DURATION
from swarmtrain.averaging.matchmaking_types import DEFAULT_DECLARATION_LINGER, MatchmakingConfig
from swarmtrain.averaging.partition import DEFAULT_PART_SIZE_BYTES
from swarmtrain.compression import CompressionBase, NoCompression, WireFormatError, dtype_name

__all__ = [
    "AveragerConfig",
    "check_averaged_tensors",
    "check_declaration_linger",
    "compute_schema_hash",
]

DEFAULT_SENDER_TIMEOUT = 10.0


def _positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number{' or None' if allow_none else ''}, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")


def check_declaration_linger(value: object) -> None:
    """``declaration_linger`` is a finite number >= 0: ``TypeError`` / ``ValueError`` if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"declaration_linger must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"declaration_linger must be finite and non-negative, got {value}")


@dataclass(frozen=True)
class AveragerConfig:
    """Settings of a ``DecentralizedAverager`` (hivemind's keywords and meanings).

    :param prefix: namespace of this averager's DHT keys and RPCs (no ``.`` or ``::``)
    :param target_group_size: assemble a group as soon as it has this many peers (None: any size,
      at the leader's expiration)
    :param min_group_size: fail (or wait) rather than average in a smaller group
    :param initial_group_bits: Moshpit bucket to start in, a string of 0 and 1
    :param min_matchmaking_time: a declaration stays open at least this long
    :param request_timeout: wait at least this long for a potential leader's answer
      (< min_matchmaking_time; longer, up to min_matchmaking_time, for a leader that answered
      slowly before or that we reach through a relay)
    :param declaration_linger: seconds our matchmaking declaration stays readable in the DHT
      past its expiration (default 5), so that a DHT read slower than the matchmaking window
      (relays, a loaded machine) still finds it; 0: the record expires with the declaration
      (``MatchmakingConfig.declaration_linger``)
    :param allreduce_timeout: give up on an all-reduce round after this long (None: no limit
      beyond the per-chunk timeouts)
    :param next_chunk_timeout: a peer that sends nothing for this long during all-reduce or a state
      download is dropped (default for ``sender_timeout``; None: 10 s in all-reduce,
      ``request_timeout`` in downloads)
    :param sender_timeout: a reducer drops a sender silent for this long (default
      ``next_chunk_timeout``)
    :param reducer_timeout: a sender gives up on a reducer silent for this long (default
      2 x ``sender_timeout``)
    :param compression: codec for all-reduce parts; ``state_compression``: for state downloads
    :param bandwidth: ours, for load balancing (0: reduce nothing; None: the group's mean)
    :param part_size_bytes: all-reduce part size (part of the schema: only equal values average)
    :param client_mode: we cannot be dialled: never lead, never reduce, never share state
    :param auxiliary: reduce for others without averaging tensors of our own
    :param allow_state_sharing: serve our state to newcomers (default: unless client or aux)
    :param declare_state_period: re-declare ourselves as a state donor this often
    :param matchmaking_time_keyword: the keyword the user set ``min_matchmaking_time`` with, as
      messages name it (``Optimizer`` and ``DiLoCoOptimizer`` call it ``matchmaking_time``)
    :param aggregation: how a reducer combines its slice: ``"mean"`` (weighted mean, the
      default) or ``"centered_clip"`` (CenteredClip, Gorbunov et al. 2022: robust to a minority
      of members sending arbitrary values; costs a copy of every member's part while reducing)
    :param clip_tau: CenteredClip's clipping radius, an L2 norm per part (None: adaptive, the
      weighted median distance of the members' parts to their coordinate-wise median)
    :param clip_iterations: CenteredClip's number of iterations
    :param max_peer_weight: a member claiming a larger weight is left out of the round and
      banned (default 1e9; weights are sample counts)
    :param ban_duration: a member that sent poison (NaN/inf, bad data, an implausible weight or
      delta) is avoided in matchmaking for this many seconds, doubling per repeated offence
      (``BanList``; 0: no bans across rounds)
    """

    prefix: str
    target_group_size: int | None = None
    min_group_size: int = 2
    initial_group_bits: str = ""
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    declaration_linger: float = DEFAULT_DECLARATION_LINGER
    allreduce_timeout: float | None = None
    next_chunk_timeout: float | None = None
    sender_timeout: float | None = None
    reducer_timeout: float | None = None
    compression: CompressionBase = field(default_factory=NoCompression)
    state_compression: CompressionBase = field(default_factory=NoCompression)
    bandwidth: float | None = None
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
    client_mode: bool = False
    auxiliary: bool = False
    allow_state_sharing: bool | None = None
    declare_state_period: float = 30.0
    matchmaking_time_keyword: str = "min_matchmaking_time"
    aggregation: str = "mean"
    clip_tau: float | None = None
    clip_iterations: int = 5
    max_peer_weight: float = DEFAULT_MAX_PEER_WEIGHT
    ban_duration: float = DEFAULT_BAN_DURATION

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError(f"prefix must be a non-empty string, got {self.prefix!r}")
        if "." in self.prefix or "::" in self.prefix:
            raise ValueError(f"prefix must not contain '.' or '::', got {self.prefix!r}")
        bits = self.initial_group_bits
        if not isinstance(bits, str) or any(bit not in "01" for bit in bits):
            raise ValueError(f"initial_group_bits must be a string of 0 and 1, got {bits!r}")
        _positive("min_matchmaking_time", self.min_matchmaking_time)
        _positive("request_timeout", self.request_timeout)
        check_declaration_linger(self.declaration_linger)
        if not isinstance(self.matchmaking_time_keyword, str):
            raise TypeError("matchmaking_time_keyword must be a string")
        if self.request_timeout >= self.min_matchmaking_time:
            raise ValueError(
                f"request_timeout ({self.request_timeout}) must be below "
                f"{self.matchmaking_time_keyword} ({self.min_matchmaking_time}): a follower must "
                "hear from its leader before the leader's declaration expires"
            )
        for name in ("allreduce_timeout", "next_chunk_timeout", "sender_timeout"):
            _positive(name, getattr(self, name), allow_none=True)
        _positive("reducer_timeout", self.reducer_timeout, allow_none=True)
        _positive("declare_state_period", self.declare_state_period)
        _positive("max_peer_weight", self.max_peer_weight)
        if isinstance(self.ban_duration, bool) or not isinstance(self.ban_duration, (int, float)):
            raise TypeError(f"ban_duration must be a number, got {self.ban_duration!r}")
        if not math.isfinite(self.ban_duration) or self.ban_duration < 0:
            raise ValueError(f"ban_duration must be finite and non-negative: {self.ban_duration}")
        if isinstance(self.part_size_bytes, bool) or not isinstance(self.part_size_bytes, int):
            raise TypeError(f"part_size_bytes must be an int, got {self.part_size_bytes!r}")
        if self.part_size_bytes <= 0:
            raise ValueError(f"part_size_bytes must be positive, got {self.part_size_bytes}")
        for name in ("compression", "state_compression"):
            if not isinstance(getattr(self, name), CompressionBase):
                raise TypeError(f"{name} must be a swarmtrain.compression codec")
        if self.bandwidth is not None:
            if isinstance(self.bandwidth, bool) or not isinstance(self.bandwidth, (int, float)):
                raise TypeError(f"bandwidth must be a number or None, got {self.bandwidth!r}")
            if not math.isfinite(self.bandwidth) or self.bandwidth < 0:
                raise ValueError(f"bandwidth must be finite and non-negative, got {self.bandwidth}")
        if self.client_mode and self.auxiliary:
            raise ValueError("an auxiliary peer must accept connections: it cannot be a client")
        if self.auxiliary and self.bandwidth == 0:
            raise ValueError("an auxiliary peer with bandwidth=0 would have nothing to do")
        if self.allow_state_sharing is None:
            sharing = not self.client_mode and not self.auxiliary
            object.__setattr__(self, "allow_state_sharing", sharing)
        elif self.allow_state_sharing and self.client_mode:
            raise ValueError("a client-mode averager cannot share its state: nobody can dial it")
        # Both validate the rest (group sizes, timeouts' order) with their own errors.
        self.matchmaking_config()
        self.allreduce_config()

    @property
    def mode(self) -> AveragingMode:
        if self.client_mode:
            return AveragingMode.CLIENT
        return AveragingMode.AUX if self.auxiliary else AveragingMode.NODE

    def matchmaking_config(self) -> MatchmakingConfig:
        return MatchmakingConfig(
            prefix=self.prefix,
            target_group_size=self.target_group_size,
            min_group_size=self.min_group_size,
            min_matchmaking_time=self.min_matchmaking_time,
            request_timeout=self.request_timeout,
            refresh_interval=min(1.0, self.request_timeout),
            declaration_linger=float(self.declaration_linger),
        )

    def allreduce_config(self) -> AllReduceConfig:
        sender = self.sender_timeout or self.next_chunk_timeout or DEFAULT_SENDER_TIMEOUT
        return AllReduceConfig(
            compression=self.compression,
            part_size_bytes=self.part_size_bytes,
            sender_timeout=sender,
            reducer_timeout=self.reducer_timeout or 2 * sender,
            allreduce_timeout=self.allreduce_timeout,
            aggregation=self.aggregation,
            clip_tau=self.clip_tau,
            clip_iterations=self.clip_iterations,
            max_peer_weight=self.max_peer_weight,
        )

    @property
    def download_timeout(self) -> float:
        """How long a state download waits for the donor's next message."""
        return self.next_chunk_timeout or self.request_timeout


def compute_schema_hash(tensors: Sequence[torch.Tensor], part_size_bytes: int) -> bytes:
    """What peers must share to average together: tensor count, shapes, dtypes, part size."""
    h = hashlib.sha256(b"swarmtrain/averager/schema/v1")
    h.update(part_size_bytes.to_bytes(8, "big"))
    for tensor in tensors:
        h.update(repr((tuple(tensor.shape), dtype_name(tensor.dtype))).encode())
    return h.digest()


def check_averaged_tensors(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    tensors = tuple(tensors)
    if not tensors:
        raise ValueError("averaged_tensors must not be empty")
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"averaged_tensors[{i}] is a {type(tensor).__name__}, not a tensor")
        if tensor.grad_fn is not None:
            raise ValueError(f"averaged_tensors[{i}] has a grad_fn: pass leaf tensors")
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"averaged_tensors[{i}] has dtype {tensor.dtype}: cannot be averaged")
        try:
            dtype_name(tensor.dtype)
        except WireFormatError as e:
            raise TypeError(f"averaged_tensors[{i}]: {e}") from None
    if sum(t.numel() for t in tensors) == 0:
        raise ValueError("averaged_tensors hold no values")
    return tensors
