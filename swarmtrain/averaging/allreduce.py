"""Butterfly all-reduce over libp2p RPC streams: the async shell around ``AllReduceCore``.

``AllReduceService`` serves ``{prefix}::Averaging.rpc_aggregate_part`` on one host and hands
each incoming stream to the round (``AllReduceRunner``) whose group id it names. A runner does
one round::

    async with AllReduceService.create(p2p, prefix="demo") as service:
        result = await AllReduceRunner(service, group, tensors, weight=1.0).run()
        for tensor, delta in zip(tensors, result.deltas):
            tensor.add_(delta)

The runner's two sides are in their own modules: the sender
(:mod:`swarmtrain.averaging.allreduce_sender`: our parts out, the deltas of each remote slice
back) and the reducer (:mod:`swarmtrain.averaging.allreduce_reducer`: the senders' parts of our
slice in, its deltas out); what both use on a stream is in
:mod:`swarmtrain.averaging.allreduce_rpc`.

Resource handling: ``AllReduceService.create`` registers the handler and removes it on exit.
``run`` owns a task group with one task per remote reducer (the stream that sends our parts and
reads back the averaged deltas) and a watchdog for senders that never show up; incoming
streams are served by the host's RPC server and end when the round ends. Leaving ``run`` (done,
past ``allreduce_timeout``, or cancelled) closes every stream it opened and ends the incoming
ones with ``AVERAGING_FINISHED``.

Error handling: no failure of another peer raises. A sender that fails (disconnects, is too
slow, sends bad data) is banned and the local slice is averaged without it; a reducer that
fails leaves our local values in its slice. ``AllReduceResult`` says who failed and why.
NaN and inf never enter an average: a runner whose own tensors hold any sends zeros with weight
0 instead (the others neither get them nor wait for us) and raises ``NonFiniteError``, and a
part or delta that decodes to any (a hostile
or broken peer, an overflowing codec) fails its sender or reducer like bad data, with a
warning naming the peer (``Failure.NON_FINITE``).
Wire versions: ``rpc_aggregate_part_v2`` carries each part's and delta's bytes as an RPC
attachment (``swarmtrain.p2p.Attached``: sent from the tensor's memory, received into a numpy
array the reducer adds from, or straight into the round's delta buffer), the original
``rpc_aggregate_part`` inside the protobuf (``AveragingTensorPart.buffer``, five copies each
way). Both are served; a sender calls v2 and falls back to v1 for a peer without it
(``NoSuchMethodError``), remembered per service.
Codec work (how a part is encoded and decoded: :mod:`swarmtrain.averaging.allreduce_parts`):
lossless and float16 parts of at most ``INLINE_MAX_BYTES`` are encoded and decoded on the loop
(a worker-thread hop per part cost more CPU than the memcpy or cast it ran); any other codec,
e.g. a user's or a quantizer, and larger parts go to worker threads, so a codec that blocks
never stalls the loop. Averaging happens on the loop in parts of at most
``part_size_bytes``.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import (
    AsyncIterator,
    Callable,
    Hashable,
    Mapping,
    Sequence,
)
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import torch
from google.protobuf.message import Message

from swarmtrain.averaging.allreduce_core import (
    DEFAULT_MAX_PEER_WEIGHT,
    AllReduceCore,
    AllReduceGroup,
    AllReduceStatistics,
    AveragingMode,
    Failure,
)
from swarmtrain.averaging.allreduce_parts import (
    BufferPool,
    unwrap,
)
from swarmtrain.averaging.allreduce_reducer import AllReduceReducer
from swarmtrain.averaging.allreduce_rpc import Code, _response
from swarmtrain.averaging.allreduce_sender import AllReduceSender
from swarmtrain.averaging.allreduce_trace import AllReduceTrace
from swarmtrain.averaging.errors import NonFiniteError
from swarmtrain.averaging.finite import first_non_finite
from swarmtrain.averaging.partition import DEFAULT_PART_SIZE_BYTES, largest_part_size
from swarmtrain.averaging.robust_aggregation import check_aggregation
from swarmtrain.compression import (
    CompressionBase,
    NoCompression,
)
from swarmtrain.p2p import P2P, PeerID
from swarmtrain.proto import averaging_pb2
from swarmtrain.utils.exception_groups import collapse_exception_groups

__all__ = [
    "AllReduceConfig",
    "AllReduceResult",
    "AllReduceRunner",
    "AllReduceService",
    "rpc_aggregate_part_name",
    "rpc_aggregate_part_v2_name",
]

logger = logging.getLogger(__name__)

# Room for codec metadata on top of a part's raw bytes (codebooks, block scales).
_PART_OVERHEAD_BYTES = 1 << 16
# group ids remembered as finished or expected (a stream for one is answered at once)
_MAX_REMEMBERED_GROUPS = 1024
# peers remembered as serving only the v1 wire (parts inside the protobuf)
_MAX_REMEMBERED_V1_PEERS = 4096
# how often a stream for an unknown group re-checks ``may_join_unknown_groups``
_HOOK_POLL_INTERVAL = 0.05


def rpc_aggregate_part_name(prefix: str) -> str:
    """The v1 method: each part's bytes inside the protobuf (``AveragingTensorPart.buffer``)."""
    return f"{prefix}::Averaging.rpc_aggregate_part"


def rpc_aggregate_part_v2_name(prefix: str) -> str:
    """The v2 method: the same messages, each part's bytes as the message's attachment."""
    return f"{prefix}::Averaging.rpc_aggregate_part_v2"


@dataclass(frozen=True)
class AllReduceConfig:
    """Settings of one round (every member should use the same ``part_size_bytes``).

    :param compression: codec for the parts we send (reducers answer with the same codec)
    :param part_size_bytes: largest raw size of one part
    :param sender_timeout: a reducer bans a sender that does not open its stream, or send its
      next part, within this many seconds (None: never)
    :param reducer_timeout: a sender gives up on a reducer that sends no result for this many
      seconds; must exceed ``sender_timeout`` (None: never)
    :param allreduce_timeout: the whole round ends after this many seconds; unfinished slices
      keep local values (None: no limit)
    :param aggregation: how our slice is reduced: ``"mean"`` (weighted mean) or
      ``"centered_clip"`` (CenteredClip with ``clip_tau`` and ``clip_iterations``, robust to a
      minority of senders sending anything)
    :param max_peer_weight: a sender claiming a larger weight is banned
    """

    compression: CompressionBase = field(default_factory=NoCompression)
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
    sender_timeout: float | None = 10.0
    reducer_timeout: float | None = 20.0
    allreduce_timeout: float | None = 60.0
    aggregation: str = "mean"
    clip_tau: float | None = None
    clip_iterations: int = 5
    max_peer_weight: float = DEFAULT_MAX_PEER_WEIGHT

    def __post_init__(self):
        if not isinstance(self.compression, CompressionBase):
            raise TypeError("compression must be a swarmtrain.compression codec")
        if not isinstance(self.part_size_bytes, int) or self.part_size_bytes <= 0:
            raise ValueError(f"part_size_bytes must be a positive int, got {self.part_size_bytes}")
        for name in ("sender_timeout", "reducer_timeout", "allreduce_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if self.reducer_timeout is not None and (
            self.sender_timeout is None or self.reducer_timeout <= self.sender_timeout
        ):
            raise ValueError("reducer_timeout must be longer than sender_timeout")
        check_aggregation(self.aggregation, self.clip_tau, self.clip_iterations)
        weight = self.max_peer_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"max_peer_weight must be a positive number, got {weight!r}")


@dataclass(frozen=True)
class AllReduceResult:
    """What a round produced.

    :param deltas: ``average - local`` per tensor (zero where a slice failed); None for AUX
    :param banned_senders: senders our slice was averaged without, and why
    :param failed_reducers: reducers whose slices kept our local values, and why
    :param timed_out: the round hit ``allreduce_timeout``
    :param part_bytes_sent: encoded bytes of the parts we sent other reducers (as a sender)
    :param delta_bytes_sent: encoded bytes of the averaged deltas we returned (as a reducer);
      both count payload handed to the transport, not framing or protobuf overhead
    """

    deltas: tuple[torch.Tensor, ...] | None
    banned_senders: Mapping[PeerID, Failure]
    failed_reducers: Mapping[PeerID, Failure]
    timed_out: bool = False
    part_bytes_sent: int = 0
    delta_bytes_sent: int = 0

    @property
    def payload_bytes_sent(self) -> int:
        """Encoded tensor bytes we sent in the round (parts and deltas)."""
        return self.part_bytes_sent + self.delta_bytes_sent

    @property
    def complete(self) -> bool:
        """Every peer took part in every slice."""
        return not (self.banned_senders or self.failed_reducers or self.timed_out)


class AllReduceService:
    """Serves ``rpc_aggregate_part`` for every round on one host; see the module docstring.

    :param group_wait_timeout: how long a stream for an unknown group waits for its round to
      start locally (members start a round at slightly different times)
    :param max_message_size: largest part message accepted (it bounds ``part_size_bytes``)
    :param may_join_unknown_groups: called with the leader's peer id from the stream's
      first request (b"" when the sender did not say): whether a group this host has not
      heard of yet may still include it (e.g. a join request to that leader is in flight:
      it may have assembled a group whose start message has not arrived). A stream for an
      unknown group waits for its round only while this holds or the group was announced
      with :meth:`expect`; otherwise it is answered at once, so the sender bans us instead
      of waiting ``sender_timeout``. None: always wait (up to ``group_wait_timeout``).
    """

    def __init__(
        self,
        p2p: P2P,
        prefix: str,
        *,
        group_wait_timeout: float = 5.0,
        max_message_size: int = 4 * DEFAULT_PART_SIZE_BYTES + _PART_OVERHEAD_BYTES,
        may_join_unknown_groups: Callable[[bytes], bool] | None = None,
    ):
        self.p2p = p2p
        self.may_join_unknown_groups = may_join_unknown_groups
        self.prefix = prefix
        self.handler_name = rpc_aggregate_part_name(prefix)
        self.handler_v2_name = rpc_aggregate_part_v2_name(prefix)
        # peers without the v2 method (older versions): parts go to them inside the protobuf
        self._v1_peers: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.group_wait_timeout = group_wait_timeout
        self.max_message_size = max_message_size
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._finished: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._expected: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._registered = anyio.Event()
        self._part_buffers = BufferPool(max_cached_bytes=max(64 << 20, 8 * max_message_size))
        #: set to an ``AllReduceTrace`` to record every round's part timeline (benchmarks)
        self.trace: AllReduceTrace | None = None

    @classmethod
    @asynccontextmanager
    async def create(cls, p2p: P2P, prefix: str, **kwargs) -> AsyncIterator[AllReduceService]:
        """Register the handler on ``p2p``; remove it on exit."""
        self = cls(p2p, prefix, **kwargs)
        for name, handler, attachments in (
            (self.handler_name, self._rpc_aggregate_part, False),
            (self.handler_v2_name, self._rpc_aggregate_part_v2, True),
        ):
            p2p.add_protobuf_handler(
                name,
                handler,
                averaging_pb2.AveragingRequest,
                stream_input=True,
                stream_output=True,
                max_message_size=self.max_message_size,
                attachments=attachments,
                attachment_buffer=self._part_buffer if attachments else None,
            )
        try:
            yield self
        finally:
            p2p.remove_protobuf_handler(self.handler_name)
            p2p.remove_protobuf_handler(self.handler_v2_name)

    def _part_buffer(self, request: Message, size: int) -> np.ndarray:
        return self._part_buffers.take(size)

    def speaks_v2(self, peer_id: Hashable) -> bool:
        """Whether parts go to ``peer_id`` as attachments (it did not lack the v2 method)."""
        return peer_id not in self._v1_peers

    def _remember_v1_peer(self, peer_id: Hashable) -> None:
        self._v1_peers[peer_id] = None
        while len(self._v1_peers) > _MAX_REMEMBERED_V1_PEERS:
            self._v1_peers.popitem(last=False)

    def expect(self, group_id: bytes) -> None:
        """A group with this id was assembled here: its rounds will start (or it is released).
        Until :meth:`release`, streams for this id and for ids extending it (a group may run
        several rounds, e.g. PowerSGD's ``group_id + b".p"``) wait for their round."""
        if group_id not in self._runners and group_id not in self._finished:
            self._expected[group_id] = None
            while len(self._expected) > _MAX_REMEMBERED_GROUPS:
                self._expected.popitem(last=False)

    def release(self, group_id: bytes) -> None:
        """This host is done with the group: streams for it get ``AVERAGING_FINISHED`` unless
        its round is running (call after the round, or instead of it when a step is
        cancelled between assembly and the all-reduce)."""
        self._expected.pop(group_id, None)
        if group_id not in self._runners and group_id not in self._finished:
            self._remember_finished(group_id)
            self._wake_waiters()

    def _remember_finished(self, group_id: bytes) -> None:
        self._finished[group_id] = None
        while len(self._finished) > _MAX_REMEMBERED_GROUPS:
            self._finished.popitem(last=False)

    def _wake_waiters(self) -> None:
        self._registered.set()
        self._registered = anyio.Event()

    def _register(self, runner: AllReduceRunner) -> None:
        group_id = runner.group.group_id
        if group_id in self._runners or group_id in self._finished:
            raise ValueError(f"a round with group_id {group_id.hex()} already ran here")
        self._expected.pop(group_id, None)
        self._runners[group_id] = runner
        self._wake_waiters()

    def _unregister(self, runner: AllReduceRunner) -> None:
        group_id = runner.group.group_id
        if self._runners.get(group_id) is runner:
            del self._runners[group_id]
            self._remember_finished(group_id)

    def _may_start(self, group_id: bytes, leader: bytes = b"") -> bool:
        """Whether a round for this unknown group (led by ``leader``) may still start here."""
        if any(group_id.startswith(expected) for expected in self._expected):
            return True
        return self.may_join_unknown_groups is None or self.may_join_unknown_groups(leader)

    async def _find_runner(self, group_id: bytes, leader: bytes = b"") -> AllReduceRunner | None:
        # the hook has no event to wait on: re-check it every _HOOK_POLL_INTERVAL
        poll = math.inf if self.may_join_unknown_groups is None else _HOOK_POLL_INTERVAL
        with anyio.move_on_after(self.group_wait_timeout):
            while group_id not in self._runners and group_id not in self._finished:
                if not self._may_start(group_id, leader):
                    break
                with anyio.move_on_after(poll):
                    await self._registered.wait()
        return self._runners.get(group_id)

    def _first_request_bytes(self, remote_id: PeerID, count: int) -> None:
        for runner in self._runners.values():
            runner._sender_arriving(remote_id, count)

    def _rpc_aggregate_part(self, requests, context):
        return self._serve_call(requests, context, attached=False)

    def _rpc_aggregate_part_v2(self, requests, context):
        return self._serve_call(requests, context, attached=True)

    async def _serve_call(self, requests, context, attached: bool):
        # The stream joins its round once the first request (group id, first part) is in:
        # meanwhile its bytes tell the rounds waiting for this sender that it is on its way.
        watch = getattr(requests, "set_on_bytes", None)
        if watch is not None:
            watch(lambda count: self._first_request_bytes(context.remote_id, count))
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        finally:
            if watch is not None:
                watch(None)
        request, _ = unwrap(first)
        runner = await self._find_runner(request.group_id, request.leader)
        if runner is None:
            if request.group_id in self._finished:
                yield _response(Code.AVERAGING_FINISHED, "this round is over")
            else:
                yield _response(Code.AVERAGING_BAD_GROUP_ID, "no round with this group_id")
            return
        replies = runner._serve_sender(first, requests, context.remote_id, attached)
        async with aclosing(replies):
            async for reply in replies:
                yield reply


class AllReduceRunner(AllReduceSender, AllReduceReducer):
    """One butterfly all-reduce round of ``tensors`` in ``group``; see the module docstring.

    :param service: the host's all-reduce service (its peer must be a member of ``group``)
    :param tensors: local tensors (read, never written; an AUX peer passes tensors of the
      right shapes and dtypes, e.g. zeros)
    :param weight: our weight in the average (default 1; ignored for AUX peers)
    :param delta_buffers: flat tensors the deltas are written into (see
      ``TensorPartContainer``), e.g. the previous round's; fresh ones when None
    """

    def __init__(
        self,
        service: AllReduceService,
        group: AllReduceGroup[PeerID],
        tensors: Sequence[torch.Tensor],
        *,
        weight: float | None = None,
        config: AllReduceConfig | None = None,
        delta_buffers: Sequence[torch.Tensor] | None = None,
    ):
        self.service = service
        self._delta_buffers = delta_buffers
        self.group = group
        self.config = config or AllReduceConfig()
        index = group.index_of(service.p2p.peer_id)
        if index is None:
            raise ValueError(f"this peer ({service.p2p.peer_id}) is not a member of the group")
        self.local_index = index
        self.mode = group.modes[index]
        if weight is None:
            weight = 0.0 if self.mode == AveragingMode.AUX else 1.0
        self.weight = float(weight)
        largest_part = largest_part_size(self.config.part_size_bytes)
        if largest_part + _PART_OVERHEAD_BYTES > service.max_message_size:
            raise ValueError(
                f"parts of up to {largest_part} bytes (part_size_bytes="
                f"{self.config.part_size_bytes}, grown for large slices) do not fit the "
                f"service's max_message_size={service.max_message_size}"
            )
        self.tensors = tuple(tensors)
        self._core: AllReduceCore[PeerID] | None = None
        self._part_ready: list[anyio.Event] = []
        self._changed = anyio.Event()
        self._read_scopes: dict[int, anyio.CancelScope] = {}
        self._closed = False
        self._started = False
        self._deadline = math.inf
        self.part_bytes_sent = self.delta_bytes_sent = 0  #: see ``AllReduceResult``
        self._call_bytes: dict[int, int] = {}  # part bytes sent per reducer in its last call

    def _trace(self, kind: str, peer: int, part: int, nbytes: int = 0) -> None:
        trace = self.service.trace
        if trace is not None:
            trace.record(self.group.group_id, kind, peer, part, nbytes)

    @property
    def core(self) -> AllReduceCore:
        if self._core is None:
            raise RuntimeError("the round has not started")
        return self._core

    def statistics(self) -> AllReduceStatistics:
        return self.core.statistics()

    @property
    def delta_buffers(self) -> tuple[torch.Tensor, ...]:
        """The flat delta buffers of the round (pass them to a later round once the deltas
        were applied)."""
        return self.core.container.delta_buffers

    # ------------------------------------------------------------------ the round

    async def run(self) -> AllReduceResult:
        """Run the round; return the deltas (never raises for another peer's failure).

        :raises NonFiniteError: our tensors hold NaN or inf: we took part with zeros of weight
          0 (the others average without us and wait for nobody), and our values stay as they
          are (no deltas)
        """
        if self._started:
            raise RuntimeError("an AllReduceRunner runs once")
        self._started = True
        non_finite = self._non_finite_message()
        tensors = self.tensors
        if non_finite is not None:
            logger.warning("%s", non_finite)
            tensors, self.weight = tuple(torch.zeros_like(t) for t in tensors), 0.0
        config = self.config
        now = anyio.current_time()
        self._core = core = AllReduceCore(
            self.group,
            self.local_index,
            tensors,
            weight=self.weight,
            part_size_bytes=config.part_size_bytes,
            sender_timeout=config.sender_timeout,
            reducer_timeout=config.reducer_timeout,
            now=now,
            delta_buffers=self._delta_buffers,
            max_peer_weight=config.max_peer_weight,
            aggregation=config.aggregation,
            clip_tau=config.clip_tau,
            clip_iterations=config.clip_iterations,
        )
        self._part_ready = [anyio.Event() for _ in range(core.num_local_parts)]
        self._notify(tuple(k for k in range(core.num_local_parts) if core.is_part_ready(k)))
        deadline = now + config.allreduce_timeout if config.allreduce_timeout else math.inf
        self._deadline = deadline
        self.service._register(self)
        self._trace("round_began", self.local_index, -1)
        timed_out = False
        try:
            with anyio.CancelScope(deadline=deadline) as scope, collapse_exception_groups():
                async with anyio.create_task_group() as tasks:
                    if core.is_reducer:
                        tasks.start_soon(self._ban_missing_senders)
                    async with anyio.create_task_group() as streams:
                        for reducer in core.remote_reducers():
                            streams.start_soon(self._communicate_with_reducer, reducer)
                    while not core.reducing_finished:
                        await self._changed.wait()
                    tasks.cancel_scope.cancel()
            if scope.cancelled_caught:
                timed_out = True
                logger.debug("all-reduce %s hit its deadline", self.group.group_id.hex())
                self._notify(core.expire(anyio.current_time()))
        finally:
            self._close()
            self._trace("round_ended", self.local_index, -1)
        if non_finite is not None:
            raise NonFiniteError(non_finite)
        return AllReduceResult(
            deltas=core.deltas(),
            banned_senders=core.banned_senders,
            failed_reducers=core.failed_reducers,
            timed_out=timed_out,
            part_bytes_sent=self.part_bytes_sent,
            delta_bytes_sent=self.delta_bytes_sent,
        )

    def _non_finite_message(self) -> str | None:
        """Why we must not send our tensors (some hold NaN or inf), or None."""
        if self.mode == AveragingMode.AUX:
            return None  # sends nothing
        bad = first_non_finite(self.tensors)
        if bad is None:
            return None
        return (
            f"tensor {bad} of the {len(self.tensors)} to average holds NaN or inf values: this "
            f"peer skips all-reduce {self.group.group_id.hex()} (it sends zeros with weight 0, "
            f"so the others' averages stay finite, and keeps its own values)"
        )

    def _close(self) -> None:
        self._closed = True
        self.service._unregister(self)
        for scope in list(self._read_scopes.values()):
            scope.cancel()
        self._notify(tuple(range(len(self._part_ready))))

    def _notify(self, completed: tuple[int, ...] = ()) -> None:
        """Wake whatever waits on a change; ``completed``: parts to mark ready besides those
        the core completed since the last call (``take_completed``)."""
        for k in (*completed, *self.core.take_completed()):
            if not self._part_ready[k].is_set():
                self._trace("part_reduced", self.local_index, k)
            self._part_ready[k].set()
        self._changed.set()
        self._changed = anyio.Event()

    async def _ban_missing_senders(self) -> None:
        core = self.core
        while (deadline := core.missing_senders_deadline) < math.inf:
            await anyio.sleep_until(deadline)
            self._notify(core.ban_missing_senders(anyio.current_time()))

    def _sender_arriving(self, remote_id: PeerID, count: int) -> None:
        """Bytes of ``remote_id``'s first request came (``AllReduceCore.sender_arriving``)."""
        peer = self.group.index_of(remote_id)
        if peer is not None and not self._closed:
            self.core.sender_arriving(peer, count, anyio.current_time())
