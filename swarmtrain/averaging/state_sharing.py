"""State sharing: donors serve their state, newcomers download it (``load_state_from_peers``).

A donor (``allow_state_sharing``) declares its priority under ``{prefix}.all_averagers`` (subkey:
its peer id; signed with its identity key, so nobody else can blank or replace it:
``swarmtrain.dht.peer_records``) every ``declare_state_period`` and at once when the priority
or the permission changes; it serves ``{prefix}::Averager.rpc_download_state`` (see
proto/state_sharing.proto): a header (msgpack metadata, number of tensors), then each tensor
compressed with ``state_compression`` and streamed in chunks.

A newcomer reads the declarations, orders donors by priority (highest first, ties at random)
and downloads from one donor at a time. Donors are dialled in turn ``DONOR_DIAL_DELAY`` apart
without waiting for each dial to end (``swarmtrain.averaging.staggered``): a donor that died
without withdrawing its offer costs that delay, not a dial timeout. If a donor fails
mid-transfer (it leaves, stalls for ``message_timeout``, or sends bad data), the newcomer keeps
the tensors it already received in full and asks the next donor for the rest
(``first_tensor``): peers that average together hold nearly the same state, so the result is
one consistent-enough state without starting over. The metadata comes from the first donor
that answered. A donor whose state has another number of
tensors cannot continue a transfer and is skipped.

Nothing a donor sends is used unchecked (``swarmtrain.averaging.state_checks``): the metadata is
decoded when the header arrives and given to the caller's ``check``, which returns the shape and
dtype of every tensor; each tensor's wire header is compared with its spec before anything is
allocated, the decoded tensor again, and a tensor with NaN or inf values fails its donor (a
diverged peer never hands its state on). A donor whose state fails is named in a warning,
banned for ``ban_duration`` (default 10 minutes: its later downloads skip it) and none of its
tensors are kept (if it sent the metadata, the download starts over with the next donor). When
no state came, ``last_failure`` says why (no donor declared one, or what went wrong with each
donor, typed: :class:`DonorFailure`); the warning is logged once per distinct reason (a caller
retrying for a minute would repeat it dozens of times).

Progress (``swarmtrain.averaging.state_progress``): bytes of the state received of the total (from
the tensor specs of the caller's check, else the size the donor's header announces), on
a bar when stderr is a terminal or bars are asked for (``swarmtrain.utils.progress``), else
one log line when the first header arrives and one at the end (size, duration, rate).

Resource handling: ``create`` registers the handler (not in client mode: nobody can dial a
client) and owns the declaring task; leaving it stops the task, stores a last "not sharing"
record (bounded) and removes the handler. Downloads run in the caller's task.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import torch
import trio
from google.protobuf.message import DecodeError

from swarmtrain.averaging.finite import all_finite
from swarmtrain.averaging.staggered import staggered_connect
from swarmtrain.averaging.state_checks import (
    BAN_DURATION,
    DonorBans,
    RejectReason,
    StateCheck,
    StateRejected,
    TensorSpec,
)
from swarmtrain.averaging.state_progress import StateDownloadProgress
from swarmtrain.compression import (
    DEFAULT_CHUNK_SIZE,
    CompressionBase,
    CompressionInfo,
    TensorAssembler,
    WireFormatError,
    extract_async,
    split_for_streaming,
)
from swarmtrain.dht import (
    DHTValueError,
    PeerRecordValidator,
    deserialize,
    get_dht_time,
    serialize,
)
from swarmtrain.dht.owned_keys import STATE_SHARING_KEY_PATTERN
from swarmtrain.p2p import P2PError, PeerID
from swarmtrain.proto import state_sharing_pb2 as pb
from swarmtrain.proto import tensor_pb2
from swarmtrain.utils.progress import Progress

__all__ = [
    "STATE_SHARING_KEY_PATTERN",
    "DonorFailure",
    "StateDownloadFailure",
    "StateSharing",
    "rpc_download_state_name",
    "state_sharing_key",
]

logger = logging.getLogger(__name__)

MAX_METADATA_SIZE = 16 * 1024 * 1024
#: seconds between the dials to successive donors (a dead donor costs this much, see ``staggered``)
DONOR_DIAL_DELAY = 0.5
MAX_METADATA_ELEMENTS = 1 << 20  # msgpack objects (swarmtrain.dht.serialization); decoded off-loop
# What get_current_state returns: (metadata, tensors) or (metadata, tensors, compression infos).
State = tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo] | None]


@dataclass(frozen=True)
class DonorFailure:
    """What went wrong with one donor; ``rejected``: its state failed a check (see
    ``state_checks.RejectReason``), None for a transfer that failed or did not happen."""

    donor: PeerID
    problem: str
    rejected: RejectReason | None = None

    def __str__(self) -> str:
        return f"{self.donor}: {self.problem}"


@dataclass(frozen=True)
class StateDownloadFailure:
    """Why a ``load_state_from_peers`` got no state."""

    donors: int  #: peers that declared a state to share, banned ones not counted (0: nobody)
    reasons: tuple[DonorFailure, ...] = ()  #: one per donor tried
    banned: int = 0  #: donors skipped because an earlier state of theirs was rejected

    def __str__(self) -> str:
        skipped = f" ({self.banned} banned donor(s) skipped)" if self.banned else ""
        if not self.donors:
            return "no peer declared a state to share" + skipped
        reasons = "; ".join(str(r) for r in self.reasons)
        return f"no state from any of {self.donors} donor(s){skipped}: {reasons}"


@dataclass
class _Download:
    """A download in progress over one or more donors."""

    header: pb.StateHeader | None = None
    source: PeerID | None = None  #: the donor whose header (and metadata) is in use
    metadata: Any = None
    specs: Sequence[TensorSpec] | None = None  #: None: no check given (any shape and dtype)
    tensors: list[torch.Tensor] = field(default_factory=list)

    def reset(self) -> None:
        self.header = self.source = self.metadata = self.specs = None
        self.tensors = []


def _decode_metadata(data: bytes) -> Any:
    return deserialize(data, max_size=MAX_METADATA_SIZE, max_elements=MAX_METADATA_ELEMENTS)


def state_sharing_key(prefix: str) -> str:
    return f"{prefix}.all_averagers"


def rpc_download_state_name(prefix: str) -> str:
    return f"{prefix}::Averager.rpc_download_state"


class StateSharing:
    """Both sides of state sharing for one averager; see the module docstring.

    :param dht: a running ``AsyncDHT``
    :param get_state: returns the current state (called for each download we serve)
    :param serve: register the download handler (False in client mode)
    :param message_timeout: a download gives up on a donor that sends nothing for this long
    :param dht_timeout: bound on each DHT read or store
    :param ban_duration: seconds a donor whose state failed a check is skipped
    """

    def __init__(
        self,
        dht,
        prefix: str,
        *,
        get_state: Callable[[], Awaitable[State]],
        state_compression: CompressionBase,
        allow_state_sharing: bool,
        declare_state_period: float,
        serve: bool = True,
        message_timeout: float = 30.0,
        dht_timeout: float = 5.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        ban_duration: float = BAN_DURATION,
    ):
        self.dht = dht
        self.p2p = dht.p2p
        self.prefix = prefix
        self.key = state_sharing_key(prefix)
        self.handler_name = rpc_download_state_name(prefix)
        self._get_state = get_state
        self.state_compression = state_compression
        self.declare_state_period = declare_state_period
        self.serve = serve
        self.message_timeout = message_timeout
        self.dht_timeout = dht_timeout
        self.chunk_size = chunk_size
        self.max_message_size = MAX_METADATA_SIZE + 2 * chunk_size
        self._allowed = False
        self._priority = 0.0
        self._changed = trio.Event()
        self.downloads_served = 0
        #: why the last download got no state (None: it got one, or it is still running)
        self.last_failure: StateDownloadFailure | None = None
        self._failures_logged: set[StateDownloadFailure] = set()
        #: donors whose state was rejected, skipped until their ban expires
        self.bans = DonorBans(ban_duration)
        self.allow_state_sharing = allow_state_sharing

    @classmethod
    @asynccontextmanager
    async def create(cls, dht, prefix: str, **kwargs: Any) -> AsyncIterator[StateSharing]:
        self = cls(dht, prefix, **kwargs)
        # declarations are owned: only a donor can write (or blank) its own subkey
        dht.add_validators([PeerRecordValidator([STATE_SHARING_KEY_PATTERN])])
        if self.serve:
            self.p2p.add_protobuf_handler(
                self.handler_name,
                self._rpc_download_state,
                pb.StateDownloadRequest,
                stream_output=True,
                max_message_size=self.max_message_size,
            )
        try:
            async with trio.open_nursery() as nursery:
                if self.serve:
                    self._changed = trio.Event()
                    declared = await self._declare(was_allowed=False)
                    nursery.start_soon(self._declare_periodically, declared)
                try:
                    yield self
                finally:
                    nursery.cancel_scope.cancel()
            if self.serve and self._allowed:
                with trio.CancelScope(shield=True):
                    self._allowed = False
                    await self._declare(was_allowed=True)  # tell newcomers we are gone
        finally:
            if self.serve:
                self.p2p.remove_protobuf_handler(self.handler_name)

    # ------------------------------------------------------------------ settings

    @property
    def allow_state_sharing(self) -> bool:
        return self._allowed

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and not self.serve:
            raise ValueError("a client-mode averager cannot share its state: nobody can dial it")
        if bool(value) != self._allowed:
            self._allowed = bool(value)
            self._changed.set()

    @property
    def state_sharing_priority(self) -> float:
        """Newcomers download from the donor with the highest priority first."""
        return self._priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"state_sharing_priority must be finite, got {value}")
        if value != self._priority:
            self._priority = value
            if self._allowed:
                self._changed.set()

    # ------------------------------------------------------------------ as a donor

    async def _declare(self, was_allowed: bool) -> bool:
        """Store our priority (or None when we stopped sharing); returns whether we share."""
        allowed = self._allowed
        if allowed or was_allowed:
            value = self._priority if allowed else None
            with trio.move_on_after(self.dht_timeout):
                try:
                    await self.dht.store(
                        self.key,
                        value,
                        get_dht_time() + self.declare_state_period,
                        subkey=self.p2p.peer_id.to_bytes(),
                    )
                except Exception as e:
                    logger.debug("could not declare state sharing: %r", e)
        return allowed

    async def _declare_periodically(self, was_allowed: bool) -> None:
        # Re-declare well before the record expires, and at once after a change.
        interval = max(self.declare_state_period - self.dht_timeout, self.declare_state_period / 2)
        while True:
            with trio.move_on_after(interval):
                await self._changed.wait()
            self._changed = trio.Event()  # a change during the store below wakes us again
            was_allowed = await self._declare(was_allowed)

    async def _rpc_download_state(
        self, request: pb.StateDownloadRequest, context
    ) -> AsyncIterator[pb.StateDownloadResponse]:
        if not self._allowed:
            return  # no header: the newcomer asks the next donor
        metadata, tensors, infos = await self._get_state()
        metadata_bytes = serialize(
            metadata, max_size=MAX_METADATA_SIZE, max_elements=MAX_METADATA_ELEMENTS
        )
        self.downloads_served += 1
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        yield pb.StateDownloadResponse(
            header=pb.StateHeader(
                metadata=metadata_bytes, num_tensors=len(tensors), state_bytes=state_bytes
            )
        )
        for index in range(request.first_tensor, len(tensors)):
            tensor = tensors[index]
            info = infos[index] if infos is not None else CompressionInfo.from_tensor(tensor, index)
            message = await anyio.to_thread.run_sync(self.state_compression.compress, tensor, info)
            for chunk in split_for_streaming(message, self.chunk_size):
                yield pb.StateDownloadResponse(tensor_index=index, chunk=chunk.SerializeToString())

    # ------------------------------------------------------------------ as a newcomer

    async def find_donors(self) -> list[PeerID]:
        """Peers that declared they share their state, best first (never us)."""
        found = None
        with trio.move_on_after(self.dht_timeout):
            try:
                found = await self.dht.get(self.key, latest=True)
            except Exception as e:
                logger.debug("could not read %s: %r", self.key, e)
        if found is None or not isinstance(found.value, dict):
            return []
        ours = self.p2p.peer_id.to_bytes()
        priorities: dict[bytes, tuple[float, float]] = {}
        for subkey, item in found.value.items():
            value = item.value
            if not isinstance(subkey, bytes) or subkey == ours or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                priorities[subkey] = (float(value), random.random())
        return [PeerID(p) for p in sorted(priorities, key=priorities.__getitem__, reverse=True)]

    async def load_state_from_peers(
        self, donors: Sequence[PeerID | bytes] | None = None, check: StateCheck | None = None
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """Download (metadata, tensors) from the best donors (see the module docstring); None if
        no donor could provide it. Bound it with the caller's ``move_on_after``.

        :param donors: only these peers (of those that declared they share their state)
        :param check: validates the metadata and returns every tensor's spec (raising
          ``StateRejected``); without it, or if it returns None, any shapes and dtypes are
          taken (NaN / inf never)
        """
        self.last_failure = None
        found = await self.find_donors()
        if donors is not None:
            wanted = {PeerID(p) if isinstance(p, bytes) else p for p in donors}
            found = [d for d in found if d in wanted]
        now = trio.current_time()
        trusted = [d for d in found if self.bans.banned(d, now) is None]
        state = _Download()
        reasons: list[DonorFailure] = []
        progress = StateDownloadProgress(self._open_progress)
        try:
            return await self._load_from(found, trusted, state, reasons, check, progress)
        finally:
            progress.close(ok=False)  # no-op after a success

    def _open_progress(self, total: int | None) -> Progress:
        return Progress(f"loading the state of {self.prefix}", total=total, log=logger)

    async def _load_from(
        self,
        found: list[PeerID],
        trusted: list[PeerID],
        state: _Download,
        reasons: list[DonorFailure],
        check: StateCheck | None,
        progress: StateDownloadProgress,
    ) -> tuple[Any, list[torch.Tensor]] | None:
        # donors are dialled in turn, DONOR_DIAL_DELAY apart: a dead one (its offer outlives it)
        # costs that delay, not a dial timeout; downloads go to donors in the order they answer
        async with staggered_connect(
            trusted, self.p2p.ensure_connected, DONOR_DIAL_DELAY, errors=(P2PError, OSError)
        ) as attempts:
            while (attempt := await attempts.next()) is not None:
                donor, dial_error = attempt
                if dial_error is not None:
                    reasons.append(DonorFailure(donor, repr(dial_error)))
                    continue
                had = len(state.tensors)
                try:
                    await self._download(donor, state, check, progress)
                except StateRejected as e:
                    reasons.append(DonorFailure(donor, f"state rejected ({e})", e.reason))
                    self._reject(donor, state, e)
                    continue
                except (P2PError, WireFormatError, DHTValueError, DecodeError, ValueError) as e:
                    logger.debug(  # the warning below gives the reason, once
                        "state download from %s failed after %d tensor(s): %r",
                        donor,
                        len(state.tensors),
                        e,
                    )
                    reasons.append(DonorFailure(donor, repr(e)))
                    continue
                if state.header is not None and len(state.tensors) == state.header.num_tensors:
                    progress.close(ok=True, note=f", {len(state.tensors)} tensors, last {donor}")
                    return state.metadata, state.tensors
                if len(state.tensors) == had:
                    reasons.append(DonorFailure(donor, "it does not share its state (any more)"))
        failure = StateDownloadFailure(len(trusted), tuple(reasons), len(found) - len(trusted))
        self.last_failure = failure
        if found:
            repeated = failure in self._failures_logged
            self._failures_logged.add(failure)
            level = logging.DEBUG if repeated else logging.WARNING
            logger.log(level, "could not load the state of %s: %s", self.prefix, failure)
        return None

    def _reject(self, donor: PeerID, state: _Download, error: StateRejected) -> None:
        """Forget what ``donor`` sent (everything, if its metadata is in use); maybe ban it."""
        if error.ban:
            self.bans.ban(donor, str(error), trio.current_time())
        logger.warning(
            "not loading the state of donor %s: %s%s",
            donor,
            error,
            f" (banned for {self.bans.duration:.0f} s)" if error.ban else "",
        )
        if state.source == donor:
            state.reset()

    async def _download(
        self,
        donor: PeerID,
        state: _Download,
        check: StateCheck | None,
        progress: StateDownloadProgress,
    ) -> None:
        """Receive tensors ``len(state.tensors)...`` from ``donor`` into ``state`` (the first
        donor's header and checked metadata). Raises on failure, keeping the tensors received in
        full (none of this donor's if it sent bad data: ``StateRejected``)."""
        tensors = state.tensors
        start = len(tensors)
        progress.rewind(start)  # what the last donor had in flight is gone
        request = pb.StateDownloadRequest(first_tensor=start)
        async with self.p2p.iterate_protobuf_handler(
            donor,
            self.handler_name,
            request,
            pb.StateDownloadResponse,
            next_message_timeout=self.message_timeout,
            max_message_size=self.max_message_size,
            bulk=True,
        ) as responses:
            first = await _next_or_none(responses)
            if first is None or not first.HasField("header"):
                logger.debug("%s does not share its state", donor)
                return
            if state.header is None:
                header = first.header
                try:
                    metadata, specs = await anyio.to_thread.run_sync(
                        _decode_and_check, header.metadata, check
                    )
                except DHTValueError as e:
                    raise StateRejected(RejectReason.METADATA, repr(e)) from None
                if specs is not None and len(specs) != header.num_tensors:
                    raise StateRejected(
                        RejectReason.TENSOR_COUNT,
                        f"{header.num_tensors} tensors, expected {len(specs)}",
                    )
                state.header, state.source, state.metadata, state.specs = (
                    header,
                    donor,
                    metadata,
                    specs,
                )
            elif first.header.num_tensors != state.header.num_tensors:
                raise ValueError(
                    f"{donor} has {first.header.num_tensors} state tensors, "
                    f"the first donor had {state.header.num_tensors}"
                )
            header, specs = state.header, state.specs
            progress.on_header(specs, header.state_bytes)
            try:
                await self._receive_tensors(responses, header, specs, tensors, progress)
            except StateRejected:
                del tensors[start:]  # none of a donor's tensors are kept if one is bad
                progress.rewind(start)
                raise

    async def _receive_tensors(
        self,
        responses: AsyncIterator[pb.StateDownloadResponse],
        header: pb.StateHeader,
        specs: Sequence[TensorSpec] | None,
        tensors: list[torch.Tensor],
        progress: StateDownloadProgress,
    ) -> None:
        assembler: TensorAssembler | None = None
        async for response in responses:
            index = len(tensors)
            if response.HasField("header") or response.tensor_index != index:
                raise ValueError(f"unexpected message for tensor {response.tensor_index}")
            if index >= header.num_tensors:
                raise ValueError("more tensors than the header announced")
            chunk = tensor_pb2.Tensor.FromString(response.chunk)
            spec = specs[index] if specs is not None else None
            if assembler is None:
                if spec is not None:  # before the assembler allocates the declared size
                    spec.check(index, chunk.size, chunk.dtype)
                assembler = TensorAssembler()
            message = assembler.feed(chunk)
            progress.on_chunk(chunk)
            if message is None:
                continue
            tensor = await extract_async(message)
            if spec is not None:
                spec.check(index, tensor.shape, tensor.dtype)  # what the codec made of it
            if not all_finite(tensor):
                raise StateRejected(RejectReason.NON_FINITE, f"state tensor {index}")
            tensors.append(tensor)
            progress.on_tensor(index, tensor)
            assembler = None
        if assembler is not None:
            assembler.finish()  # raises: the stream ended inside a tensor
        if len(tensors) != header.num_tensors:
            raise ValueError(f"the donor ended the stream after {len(tensors)} tensor(s)")


def _decode_and_check(data: bytes, check: StateCheck | None) -> tuple[Any, Any]:
    """(metadata, tensor specs or None); runs in a worker thread (both are bounded work)."""
    metadata = _decode_metadata(data)
    specs = None if check is None else check(metadata)
    return metadata, (None if specs is None else list(specs))


async def _next_or_none(iterator):
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
