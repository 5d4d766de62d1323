"""``AsyncDecentralizedAverager``: the trio implementation behind ``DecentralizedAverager``.

See ``swarmtrain.averaging.averager`` for the whole story (steps, Moshpit buckets, the lock
around the tensors, resource handling); this module holds the trio class, and ``averager.py``
the blocking facade that runs it on the background loop.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol

import numpy as np
import torch
import trio

from swarmtrain.averaging.allreduce import AllReduceResult, AllReduceRunner, AllReduceService
from swarmtrain.averaging.allreduce_core import BAD_BEHAVIOUR, AllReduceGroup, AveragingMode
from swarmtrain.averaging.averager_config import (
    AveragerConfig,
    check_averaged_tensors,
    compute_schema_hash,
)
from swarmtrain.averaging.ban_list import BanList
from swarmtrain.averaging.control import AveragingStage, StepControl
from swarmtrain.averaging.errors import AllReduceError, AveragingError, MatchmakingError
from swarmtrain.averaging.load_balancing import bounded_load_balance
from swarmtrain.averaging.matchmaking import Matchmaking
from swarmtrain.averaging.matchmaking_rules import next_group_bits
from swarmtrain.averaging.matchmaking_types import (
    FailureReason,
    GroupAssembled,
    MatchmakingGroup,
)
from swarmtrain.averaging.partition import (
    DEFAULT_PART_SIZE_BYTES,
    LINK_BOUND_LAYOUT,
    PART_LAYOUT,
    as_numpy,
    held_back_by_links,
)
from swarmtrain.averaging.state_checks import StateCheck, TensorsLike
from swarmtrain.averaging.state_sharing import State, StateDownloadFailure, StateSharing
from swarmtrain.dht import DHTValueError, deserialize, get_dht_time, serialize
from swarmtrain.p2p import PeerID

__all__ = ["AsyncDecentralizedAverager", "GatheredData"]

logger = logging.getLogger(__name__)


class GatheredData(dict):
    """``{PeerID: what that peer passed as gather}`` for every member of a round's group;
    ``failed``: the members whose part or averaged delta this peer did without (the banned
    senders and failed reducers of a partial round; empty where not known)."""

    failed: frozenset[PeerID] = frozenset()

    def __init__(self, *args: Any, failed: Iterable[PeerID] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        if failed:
            self.failed = frozenset(failed)


# CPU tensors of up to this many bytes in all are snapshotted before a round, and get their
# deltas added after it, on the loop (a single-threaded memcpy / add of a few ms); larger ones
# in a worker thread. Under load each thread hop cost 2-46 ms of a 8 x 4M round's ~250 ms
# (GIL hand-offs while the loop serves the round's streams), more than the copy itself.
INLINE_COPY_MAX_BYTES = 16 << 20


def _check_group_bits(bits: str) -> str:
    if not isinstance(bits, str) or any(bit not in "01" for bit in bits):
        raise ValueError(f"group bits must be a string of 0 and 1, got {bits!r}")
    return bits


#: the step whose all-reduce attempt runs in the current task (set by ``_average_in_group``)
_ATTEMPT: contextvars.ContextVar[StepControl | None] = contextvars.ContextVar(
    "swarmtrain_allreduce_attempt", default=None
)


def _copies_on_loop(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the snapshot and delta addition of ``tensors`` run on the loop (small, CPU)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes <= INLINE_COPY_MAX_BYTES and all(t.device.type == "cpu" for t in tensors)


def _trio_deadline(dht_deadline: float) -> float:
    if math.isinf(dht_deadline):
        return math.inf
    return trio.current_time() + (dht_deadline - get_dht_time())


def _load_gathered(data: bytes) -> Any:
    try:
        return deserialize(data)
    except DHTValueError:
        return None


def _add_deltas(tensors: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> None:
    """``tensor += delta`` in place (numpy where it can: one thread, no torch intra-op
    hand-offs; the autograd version counter is bumped as ``add_`` would)."""
    with torch.no_grad():
        for tensor, delta in zip(tensors, deltas, strict=True):
            target, source = as_numpy(tensor), as_numpy(delta)
            if target is None or source is None or target.dtype != source.dtype:
                tensor.add_(delta.to(device=tensor.device, dtype=tensor.dtype))
                continue
            np.add(target, source.reshape(target.shape), out=target)
            torch.autograd.graph.increment_version(tensor)


def _snapshot(
    tensors: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], bool]:
    """CPU copies of ``tensors`` (in numpy memory, copied on one thread, where the dtype
    allows: faster than ``clone`` for tens of MiB), written into ``into`` (a previous
    snapshot) when its shapes and dtypes match: reused pages need no mapping. Returns the
    copies and whether ``into`` was reused."""
    if into is not None and len(into) == len(tensors):
        if all(
            c.shape == t.shape and c.dtype == t.dtype and c.device.type == "cpu"
            for c, t in zip(into, tensors, strict=True)
        ):
            for copy, tensor in zip(into, tensors, strict=True):
                target, source = as_numpy(copy), as_numpy(tensor)
                if target is None or source is None:
                    copy.copy_(tensor.detach())
                else:
                    np.copyto(target, source)
            return list(into), True
    copies = []
    for tensor in tensors:
        source = as_numpy(tensor)
        if source is None:
            copies.append(tensor.detach().cpu().clone())
        else:
            copies.append(torch.from_numpy(source.copy()))
    return copies, False


def _serves_averaged_tensors(averager: AsyncDecentralizedAverager) -> bool:
    """Whether ``averager`` shares the default state: its averaged tensors."""
    return type(averager).get_current_state is AsyncDecentralizedAverager.get_current_state


def _normalize_state(state: Any) -> State:
    if not isinstance(state, (tuple, list)) or len(state) not in (2, 3):
        raise TypeError("get_current_state() must return (metadata, tensors[, infos])")
    metadata, tensors, *rest = state
    infos = rest[0] if rest else None
    tensors = list(tensors)
    if infos is not None and len(infos) != len(tensors):
        raise ValueError("get_current_state() returned a different number of infos and tensors")
    return metadata, tensors, infos


class TensorLock(Protocol):
    """What guards the averaged tensors: a ``threading.Lock``, or a ``multiprocessing`` lock
    behind threading's ``acquire`` signature (``_process_child._ThreadingStyleLock``)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any, /) -> Any: ...


class AsyncDecentralizedAverager:
    """The trio averager. Build it with ``async with DecentralizedAverager.create(...)`` (or
    this class's ``create``, e.g. from a subclass that overrides ``get_current_state``)."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        config: AveragerConfig,
        *,
        tensor_lock: TensorLock | None = None,
        state_provider: Callable[[], Any] | None = None,
        state_check: StateCheck | None = None,
    ):
        self._averaged_tensors = check_averaged_tensors(averaged_tensors)
        self.dht = dht
        self.config = config
        self.prefix = config.prefix
        self.mode = config.mode
        self.client_mode = config.client_mode
        self.peer_id: PeerID = dht.p2p.peer_id
        self.lock_averaged_tensors: TensorLock = tensor_lock or threading.Lock()
        self.total_size = sum(t.numel() for t in self._averaged_tensors)
        self.schema_hash = compute_schema_hash(self._averaged_tensors, config.part_size_bytes)
        self._group_bits = config.initial_group_bits
        self._state_provider = state_provider
        if state_check is None and state_provider is None and _serves_averaged_tensors(self):
            state_check = TensorsLike.of(self._averaged_tensors)
        #: what ``load_state_from_peers`` checks a donor's state with when given no ``check``
        #: (default: tensors like our averaged tensors when we serve those, else any tensors)
        self.state_check: StateCheck | None = state_check
        self._nursery: trio.Nursery | None = None
        self._allreduce: AllReduceService | None = None
        self._matchmaking: Matchmaking | None = None
        #: after a round our links held back, offer finer parts (``_adapt_part_layout``)
        self.adapt_part_layout = True
        # the layout matchmaking offered before a link-bound round lowered it (None: not lowered)
        self._offered_layout: int | None = None
        self._allreduce_rounds = 0
        self._state_sharing: StateSharing | None = None
        self.steps_started = 0
        #: encoded tensor bytes sent in all-reduce rounds so far: parts (as a sender) and
        #: averaged deltas (as a reducer)
        self.part_bytes_sent = self.delta_bytes_sent = 0
        #: members that sent poison, avoided in matchmaking for a while (DHT time)
        self.bans: BanList[PeerID] = BanList(config.ban_duration)
        # (snapshot, flat delta buffers) of the last round that ended well, reused by the next
        self._spare_round_buffers: tuple[list[torch.Tensor], tuple[torch.Tensor, ...]] | None = None

    @classmethod
    @asynccontextmanager
    async def create(
        cls,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        prefix: str,
        client_mode: bool | None = None,
        tensor_lock: TensorLock | None = None,
        state_provider: Callable[[], Any] | None = None,
        state_check: StateCheck | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AsyncDecentralizedAverager]:
        """Start an averager on a running ``AsyncDHT``; keywords are :class:`AveragerConfig`
        fields (``client_mode`` defaults to the DHT's). ``state_check``: the default ``check``
        of :meth:`load_state_from_peers` (see :attr:`state_check`)."""
        if client_mode is None:
            client_mode = dht.client_mode
        config = AveragerConfig(prefix=prefix, client_mode=client_mode, **kwargs)
        self = cls(
            averaged_tensors,
            dht,
            config,
            tensor_lock=tensor_lock,
            state_provider=state_provider,
            state_check=state_check,
        )
        allreduce = config.allreduce_config()
        max_message_size = max(4 * DEFAULT_PART_SIZE_BYTES, 2 * config.part_size_bytes) + (1 << 17)
        async with (
            AllReduceService.create(
                dht.p2p,
                prefix,
                group_wait_timeout=allreduce.sender_timeout,
                max_message_size=max_message_size,
            ) as self._allreduce,
            Matchmaking.create(
                dht,
                config.matchmaking_config(),
                self.schema_hash,
                mode=self.mode,
                bandwidth=config.bandwidth,
                time_keyword=config.matchmaking_time_keyword,
            ) as self._matchmaking,
            StateSharing.create(
                dht,
                prefix,
                get_state=self._current_state,
                state_compression=config.state_compression,
                allow_state_sharing=bool(config.allow_state_sharing),
                declare_state_period=config.declare_state_period,
                serve=not config.client_mode,
                message_timeout=config.download_timeout,
                dht_timeout=max(config.min_matchmaking_time, 5.0),
            ) as self._state_sharing,
            trio.open_nursery() as nursery,
        ):
            # A stream for a group we have not heard of waits only while we may be in it; a
            # step cancelled after its leader took us answers at once (no sender_timeout).
            self._matchmaking.on_group_assembled = self._allreduce.expect
            self._matchmaking.on_group_dropped = self._allreduce.release
            self._allreduce.may_join_unknown_groups = self._matchmaking.may_be_in_group_of
            self._nursery = nursery
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------ tensors and state

    @contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors, locked: no step modifies them inside this block (on the trio
        loop this may block it briefly, while a step adds its deltas in a worker thread)."""
        with self.lock_averaged_tensors:
            yield self._averaged_tensors

    @asynccontextmanager
    async def _locked_tensors(self) -> AsyncIterator[Sequence[torch.Tensor]]:
        lock = self.lock_averaged_tensors
        if not lock.acquire(blocking=False):
            # A worker thread waits in short slices, so cancellation is seen within 50 ms.
            while not await trio.to_thread.run_sync(lock.acquire, True, 0.05):
                pass
        try:
            yield self._averaged_tensors
        finally:
            lock.release()

    def get_current_state(self) -> Any:
        """What newcomers download: ``(metadata, tensors)`` or ``(metadata, tensors, infos)``.
        Runs in a worker thread; override it to share more (optimizer state, step counters)."""
        with self.get_tensors() as tensors:
            return {"group_bits": self._group_bits}, [t.detach().cpu().clone() for t in tensors]

    async def _current_state(self) -> State:
        provider = self._state_provider or self.get_current_state
        return _normalize_state(await trio.to_thread.run_sync(provider))

    async def load_state_from_peers(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 (hivemind's keyword)
        donors: Sequence[PeerID | bytes] | None = None,
        check: StateCheck | None = None,
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """Download ``(metadata, tensors)`` from the best state donors (None if none could
        provide it within ``timeout``); see ``swarmtrain.averaging.state_sharing``.
        ``donors``: only from these peers; ``check``: what their state must look like
        (default :attr:`state_check`; ``state_checks.any_tensors``: any shapes and dtypes).
        A donor whose state fails is banned for a while and the next one is tried."""
        assert self._state_sharing is not None
        check = self.state_check if check is None else check
        with trio.move_on_after(math.inf if timeout is None else timeout):
            return await self._state_sharing.load_state_from_peers(donors, check)
        logger.warning("load_state_from_peers timed out after %s s", timeout)
        return None

    @property
    def state_download_failure(self) -> StateDownloadFailure | None:
        """Why the last :meth:`load_state_from_peers` got no state (None: it got one, timed
        out, or none ran)."""
        return self._sharing().last_failure

    @property
    def allow_state_sharing(self) -> bool:
        return self._sharing().allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self._sharing().allow_state_sharing = value

    @property
    def state_sharing_priority(self) -> float:
        return self._sharing().state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._sharing().state_sharing_priority = value

    def _sharing(self) -> StateSharing:
        if self._state_sharing is None:
            raise RuntimeError("the averager is not running")
        return self._state_sharing

    def get_group_bits(self) -> str:
        return self._group_bits

    def set_group_bits(self, group_bits: str) -> None:
        """Move to another Moshpit bucket (from the next matchmaking round on)."""
        self._group_bits = _check_group_bits(group_bits)

    # ------------------------------------------------------------------ steps

    def start_step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
    ) -> StepControl:
        """Start a step in the background and return its :class:`StepControl` (call on the
        averager's loop). Arguments as in :meth:`step`."""
        if self._nursery is None:
            raise RuntimeError("the averager is not running")
        if weight is None:
            weight = 0.0 if self.mode == AveragingMode.AUX else 1.0
        elif self.mode == AveragingMode.AUX:
            logger.warning("an auxiliary averager sends no tensors: weight is ignored")
        now = get_dht_time()
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive or None, got {timeout}")
        deadline = math.inf if timeout is None else now + timeout
        if scheduled_time is None:
            scheduled_time = min(now + self.config.min_matchmaking_time, deadline)
        elif scheduled_time >= deadline:
            raise ValueError("scheduled_time is past the step's deadline (now + timeout)")
        control = StepControl(
            scheduled_time=scheduled_time,
            deadline=deadline,
            allow_retries=allow_retries,
            weight=weight,
            gather=serialize(gather),  # raises early for values that cannot travel
            require_trigger=require_trigger,
            expected_group_size=expected_group_size,
            group_bits=None if group_bits is None else _check_group_bits(group_bits),
        )
        self.steps_started += 1
        self._nursery.start_soon(self._run_step, control)
        return control

    async def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (hivemind's: the matchmaking deadline)
        allow_retries: bool = True,
        expected_group_size: int | None = None,
        group_bits: str | None = None,
    ) -> GatheredData:
        """Find a group and average with it; return ``{peer_id: gather}`` of the group.

        :param gather: small data (DHT-serializable) to share with the group
        :param scheduled_time: DHT time at which to begin all-reduce (default: now +
          ``min_matchmaking_time``)
        :param weight: our weight in the average (default 1; 0 for auxiliary peers)
        :param timeout: give up matchmaking after this many seconds (None: keep looking)
        :param allow_retries: look again after a failed attempt, until ``timeout``
        :param expected_group_size: how many peers are known to be present (this one counted):
          a leader assembles as soon as its group has that many, without waiting for
          ``min_matchmaking_time`` (None, or below ``min_group_size``: no early assembly)
        :param group_bits: match under these group bits for this step only (e.g. a round
          number, so that peers in different rounds never meet); None: the averager's, which
          rotate after each group
        :raises MatchmakingError: no group; ``reason`` says why
        """
        control = self.start_step(
            gather,
            scheduled_time,
            weight,
            timeout,
            allow_retries,
            expected_group_size=expected_group_size,
            group_bits=group_bits,
        )
        try:
            return await control.wait_result()
        except BaseException:
            control.cancel()
            raise

    async def _run_step(self, control: StepControl) -> None:
        result: Any = None
        error: BaseException | None = AveragingError("the step was cancelled")
        try:
            with control._cancel_scope:
                result, error = await self._attempt_until_done(control), None
        except AveragingError as e:
            error = e
        except trio.Cancelled:
            error = AveragingError("the averager was shut down")
            raise
        except Exception as e:
            logger.exception("averaging step failed unexpectedly")
            error = e
        finally:
            control._finish(result, error)

    async def _attempt_until_done(self, control: StepControl) -> GatheredData:
        assert self._matchmaking is not None
        while True:
            control._set_stage(AveragingStage.LOOKING_FOR_GROUP)
            requested_bits = control.group_bits
            own_bits = requested_bits is None
            bits = self._group_bits if requested_bits is None else requested_bits
            control._on_scheduled_time = self._matchmaking.set_scheduled_time
            try:
                assembled = await self._matchmaking.look_for_group(
                    bits,
                    deadline=control.deadline,
                    scheduled_time=control.scheduled_time,
                    gather=control.data_for_gather,
                    expected_group_size=control.expected_group_size,
                    banned={p.to_bytes() for p in self.bans.banned(get_dht_time())},
                )
            except MatchmakingError as e:
                retry = control.allow_retries and e.reason.retryable
                if not retry or get_dht_time() >= control.deadline:
                    raise
                logger.info("matchmaking failed (%s), retrying", e)
                continue
            finally:
                control._on_scheduled_time = None
            if own_bits:
                self._rotate_group_bits(bits, assembled)
            try:
                return await self._average_in_group(control, assembled)
            except AllReduceError as e:
                if not control.allow_retries or get_dht_time() >= control.deadline:
                    raise
                logger.info("%s; retrying", e)
                control._set_stage(AveragingStage.LOOKING_FOR_GROUP)

    async def _average_in_group(
        self, control: StepControl, assembled: GroupAssembled
    ) -> GatheredData:
        """Wait for the trigger, then run the all-reduce; however this ends, the group is
        released, so its members' streams to us are answered at once, not after a timeout."""
        assert self._allreduce is not None
        try:
            if not control.triggered:
                control._set_stage(AveragingStage.AWAITING_TRIGGER)
                with trio.move_on_at(_trio_deadline(control.deadline)):
                    await control._wait_for_trigger()
                if not control.triggered:
                    raise MatchmakingError(
                        FailureReason.DEADLINE,
                        "allow_allreduce() was not called before the deadline",
                    )
            weight = control._begin_allreduce()
            attempt = _ATTEMPT.set(control)  # (this task's: _count_bytes finds it)
            try:
                return await self._run_allreduce(assembled.group, weight)
            except BaseException:
                control._attempt_failed()
                raise
            finally:
                _ATTEMPT.reset(attempt)
        finally:
            self._allreduce.release(assembled.group.group_id)

    def _rotate_group_bits(self, bits: str, assembled: GroupAssembled) -> None:
        group = assembled.group
        index = group.index_of(self.peer_id.to_bytes())
        if index is None or self._group_bits != bits:  # set_group_bits() was called meanwhile
            return
        self._group_bits = next_group_bits(
            bits, group.group_id, index, group.size, self.config.target_group_size
        )

    @staticmethod
    def _allreduce_group(
        group: MatchmakingGroup, total_size: int, suffix: bytes = b""
    ) -> AllReduceGroup[PeerID]:
        """The all-reduce round of an assembled group over ``total_size`` values: slices by
        bandwidth (none for clients; aux peers send nothing), parts cut with the part layout
        of the group (its members' lowest), id ``group_id + suffix``. Bandwidths are claims:
        they are bounded (``bounded_load_balance``), so no member becomes the sole reducer."""
        modes = group.modes
        bandwidths = [
            0.0 if m == AveragingMode.CLIENT else b
            for m, b in zip(modes, group.bandwidths, strict=True)
        ]
        counts = bounded_load_balance(
            total_size, bandwidths, senders=[m != AveragingMode.AUX for m in modes]
        )
        return AllReduceGroup(
            group.group_id + suffix,
            tuple(PeerID(p) for p in group.peer_ids),
            counts,
            modes,
            leader=PeerID(group.leader) if group.leader in group.peer_ids else None,
            part_layout=min(group.part_layout, PART_LAYOUT),
        )

    def _count_bytes(self, parts: int, deltas: int) -> None:
        """An all-reduce of the attempt under way (in this task) sent these bytes: they count
        in the averager's totals and in that step's attempt (``StepControl.bytes_sent``)."""
        self.part_bytes_sent += parts
        self.delta_bytes_sent += deltas
        control = _ATTEMPT.get()
        if control is not None:
            control._count_bytes(parts, deltas)

    def _ban_offenders(self, result: AllReduceResult) -> None:
        """Members whose own data failed the round (poison, not the network) are avoided in
        matchmaking for a while (``self.bans``)."""
        now = get_dht_time()
        for peer, reason in (*result.banned_senders.items(), *result.failed_reducers.items()):
            if reason in BAD_BEHAVIOUR and peer != self.peer_id:
                until = self.bans.ban(peer, now)
                logger.warning(
                    "member %s sent %s data: avoided in matchmaking for %.0f s",
                    peer,
                    reason.value,
                    until - now,
                )

    def _adapt_part_layout(self, payload_bytes: int, seconds: float) -> None:
        """After a round our links held back, offer finer parts (``LINK_BOUND_LAYOUT``; the
        group takes its members' lowest); after a fast one, what we offered before. Our first
        round says nothing (it opens connections and data lanes: 9 s for 8 x 4M on loopback
        at load 10)."""
        matchmaking = self._matchmaking
        self._allreduce_rounds += 1
        link_bound = held_back_by_links(payload_bytes, seconds)
        first = self._allreduce_rounds == 1
        if matchmaking is None or link_bound is None or first or not self.adapt_part_layout:
            return
        if link_bound and matchmaking.part_layout > LINK_BOUND_LAYOUT:
            logger.info(
                "all-reduce moved %.1f MiB in %.1f s: offering finer parts (layout %d)",
                payload_bytes / 2**20,
                seconds,
                LINK_BOUND_LAYOUT,
            )
            self._offered_layout = matchmaking.part_layout
            matchmaking.part_layout = LINK_BOUND_LAYOUT
        elif not link_bound and self._offered_layout is not None:
            matchmaking.part_layout, self._offered_layout = self._offered_layout, None

    async def _run_allreduce(self, group: MatchmakingGroup, weight: float) -> GatheredData:
        assert self._allreduce is not None
        allreduce_group = self._allreduce_group(group, self.total_size)
        # The previous round's snapshot and delta buffers, if it ended well (taken, so a
        # concurrent round could never share them).
        spare, self._spare_round_buffers = self._spare_round_buffers, None
        on_loop = _copies_on_loop(self._averaged_tensors)
        async with self._locked_tensors() as tensors:
            if on_loop:
                snapshot, reused = _snapshot(tensors, spare[0] if spare else None)
            else:
                snapshot, reused = await trio.to_thread.run_sync(
                    _snapshot, tensors, spare[0] if spare else None
                )
        # the delta buffers fit whenever the snapshot they were made for did
        delta_buffers = spare[1] if spare and reused else None
        runner = AllReduceRunner(
            self._allreduce,
            allreduce_group,
            snapshot,
            weight=weight,
            config=self.config.allreduce_config(),
            delta_buffers=delta_buffers,
        )
        started = trio.current_time()
        result = await runner.run()
        self._adapt_part_layout(result.payload_bytes_sent, trio.current_time() - started)
        self._count_bytes(result.part_bytes_sent, result.delta_bytes_sent)
        self._ban_offenders(result)
        failed = {*result.banned_senders, *result.failed_reducers}
        others = {p for p in allreduce_group.peer_ids if p != self.peer_id}
        if others and others <= failed:
            raise AllReduceError(
                f"no other member of the group of {group.size} took part in all-reduce "
                f"(failed reducers: {sorted(v.value for v in result.failed_reducers.values())}, "
                f"banned senders: {sorted(v.value for v in result.banned_senders.values())})"
            )
        if not result.complete:
            logger.warning(
                "all-reduce in a group of %d was partial: banned senders %s, failed reducers %s%s",
                group.size,
                {str(k): v.value for k, v in result.banned_senders.items()},
                {str(k): v.value for k, v in result.failed_reducers.items()},
                ", timed out" if result.timed_out else "",
            )
        if result.deltas is not None:
            async with self._locked_tensors() as tensors:
                if on_loop:
                    _add_deltas(tensors, result.deltas)
                else:
                    await trio.to_thread.run_sync(_add_deltas, tensors, result.deltas)
        self._spare_round_buffers = (snapshot, runner.delta_buffers)
        return GatheredData(
            {PeerID(m.peer_id): _load_gathered(m.gather) for m in group.members}, failed=failed
        )
