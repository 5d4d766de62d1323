"""Caller side of swarmtrain's RPC protocol (see ``rpc.py``): stream pool, calls, responses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import trio
from google.protobuf.message import Message

from swarmtrain.p2p.errors import (
    CallNotServedError,
    RPCCancelledError,
    RPCProtocolError,
    RPCTimeoutError,
)
from swarmtrain.p2p.framing import KIND_END, KIND_ERROR, MESSAGE_KINDS, FrameKind
from swarmtrain.p2p.rpc import (
    CALLER_STREAM_REUSE_TIME,
    Attached,
    _remote_failure,
    receive_item,
    send_item,
    serialize_checked,
)
from swarmtrain.p2p.rpc_stream import RPCStream, deadline_moved_by_bytes
from swarmtrain.utils.exception_groups import collapse_exception_groups

logger = logging.getLogger("swarmtrain.p2p.rpc")
TOut = TypeVar("TOut", bound=Message)
TItem = TypeVar("TItem")

OpenStream = Callable[[Any], Awaitable[Any]]
_ACLOSE_TIMEOUT = 1.0  # bound on closing a caller's request generator


class StreamPool:
    """Idle RPC streams per peer, so back-to-back calls skip opening and negotiating a stream.

    A stream goes back to the pool only after a call that ended with END, with all requests
    sent; it is reused for at most ``reuse_time`` seconds (the callee keeps idle streams for
    ``SERVER_STREAM_IDLE_TIMEOUT``) and only while it shows no EOF, reset or stray data.
    """

    def __init__(
        self,
        open_stream: OpenStream,
        *,
        reuse_time: float = CALLER_STREAM_REUSE_TIME,
        max_idle_per_peer: int = 8,
        preferred: Callable[[RPCStream], bool] | None = None,
        still_fitting: Callable[[Any, RPCStream], bool] | None = None,
    ):
        """``still_fitting(peer_id, stream)``: False for an idle stream that should no longer
        carry calls although it is open (a relayed path once a direct one exists)."""
        self._open_stream = open_stream
        self._preferred = preferred  # idle streams to hand out first (e.g. data lanes)
        self._still_fitting = still_fitting
        self.reuse_time = reuse_time
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[Any, list[tuple[RPCStream, float]]] = {}
        self.streams_opened = 0
        self.streams_reused = 0

    async def acquire(self, peer_id, max_message_size: int) -> tuple[RPCStream, bool]:
        """An idle stream to ``peer_id`` (reused=True) or a freshly opened one."""
        idle = self._idle.get(peer_id)
        now = trio.current_time()
        if idle and self._preferred is not None:
            for i in range(len(idle) - 1, -1, -1):
                if self._preferred(idle[i][0]):
                    idle.append(idle.pop(i))
                    break
        while idle:
            stream, since = idle.pop()
            if (
                now - since <= self.reuse_time
                and stream.is_reusable()
                and (self._still_fitting is None or self._still_fitting(peer_id, stream))
            ):
                stream.set_max_message_size(max_message_size)
                self.streams_reused += 1
                return stream, True
            await stream.aclose()
        stream = RPCStream(await self._open_stream(peer_id), max_message_size)
        self.streams_opened += 1
        return stream, False

    def release(self, peer_id, stream: RPCStream) -> bool:
        """Keep ``stream`` for reuse; False if the pool is full (the caller closes it)."""
        idle = self._idle.setdefault(peer_id, [])
        if len(idle) >= self.max_idle_per_peer or not stream.is_reusable():
            return False
        idle.append((stream, trio.current_time()))
        return True

    async def aclose(self) -> None:
        """Half-close every idle stream (lanes are sockets of their own: close them this way)."""
        idle, self._idle = self._idle, {}
        for streams in idle.values():
            for stream, _ in streams:
                await stream.aclose()

    def forget(self) -> None:
        """Drop the idle streams without a word: for a host about to close its connections,
        which ends their streams anyway (a FIN per stream cost a frame write each)."""
        self._idle = {}


class _ResponseReader(Generic[TOut]):
    def __init__(
        self,
        stream: RPCStream,
        method: str,
        output_type: type[TOut],
        reused: bool,
        attachments: bool = False,
        attachment_buffer: Callable[[Message, int], Any] | None = None,
    ):
        self.stream, self.method, self.output_type = stream, method, output_type
        self.reused = reused
        self.attachments, self.attachment_buffer = attachments, attachment_buffer
        self.frames_before = stream.frames_received
        self.finished = False
        self.ended_with_end = False

    async def next_message(self) -> TOut | Attached | None:
        """The next response (``Attached`` when it came with an attachment), or None after
        END. Raises the remote error, if any."""
        if self.finished:
            return None
        frame = await self.stream.receive_frame()
        if frame is None:
            raise RPCCancelledError(f"{self.method}: the peer closed the stream before END")
        if frame.kind == KIND_END:
            self.finished = self.ended_with_end = True
            return None
        if frame.kind == KIND_ERROR:
            self.finished = True
            raise _remote_failure(self.method, frame.header)
        if frame.kind not in MESSAGE_KINDS:
            raise RPCProtocolError(f"{self.method}: unexpected {FrameKind.Name(frame.kind)} frame")
        return await receive_item(
            self.stream,
            frame,
            self.output_type,
            f"a response of {self.method}",
            self.attachments,
            self.attachment_buffer,
        )


class ResponseStream(Generic[TItem]):
    """Async iterator over the responses of a stream-output call: output messages, and
    ``Attached`` ones too in a call opened with ``attachments=True`` (``TItem`` says which).

    ``next_message_timeout`` bounds the wait for each message (RPCTimeoutError), moved out
    while the bytes of a large one keep arriving.
    """

    def __init__(self, reader: _ResponseReader[Any], next_message_timeout: float | None):
        self._reader = reader
        self._timeout = next_message_timeout
        self._on_bytes: Callable[[int], None] | None = None

    def __aiter__(self) -> ResponseStream[TItem]:
        return self

    def set_on_bytes(self, callback: Callable[[int], None] | None) -> None:
        """Call ``callback(count)`` for every read that brings bytes of this call's responses
        (a deadline that moves while a large message keeps arriving); None: stop."""
        self._on_bytes = callback
        if not self._timeout:
            self._reader.stream.on_bytes = callback

    def _relay_bytes(self, count: int) -> None:
        if self._on_bytes is not None:
            self._on_bytes(count)

    async def __anext__(self) -> TItem:
        """The next response; with ``next_message_timeout``, ``RPCTimeoutError`` if none began
        within it or its bytes stopped coming for that long (``stall_core.ProgressDeadline``)."""
        message: Any  # a TItem: the reader yields Attached only if the call was opened so
        if not self._timeout:  # no cancel scope to set up per message
            message = await self._reader.next_message()
            if message is None:
                raise StopAsyncIteration
            return message
        stream = self._reader.stream
        try:
            moving = deadline_moved_by_bytes(stream, self._timeout, self._relay_bytes)
            with moving as (scope, guard):
                message = await self._reader.next_message()
        finally:
            stream.on_bytes = self._on_bytes
        if scope.cancelled_caught:
            what = f"{guard.received} bytes of a response" if guard.received else "no response"
            raise RPCTimeoutError(
                f"{self._reader.method}: {what}, then nothing for {self._timeout} s"
            )
        if message is None:
            raise StopAsyncIteration
        return message


async def _send_requests(
    stream: RPCStream,
    method: str,
    requests,
    max_message_size: int,
    stream_input: bool,
    attachments: bool = False,
) -> None:
    """Send OPEN, the request(s) and END. A unary request arrives already serialized."""
    if not stream_input:
        await stream.send_open(method, requests, end=True)
        return
    await stream.send_open(method)

    async def send(request) -> None:
        await send_item(stream, request, max_message_size, f"a request of {method}", attachments)

    if isinstance(requests, AsyncIterable):
        iterator = aiter(requests)
        try:
            async for request in iterator:
                await send(request)
        finally:
            # An async generator left suspended (the call ended or was cancelled first) would
            # be finalized by the garbage collector, maybe after the loop is gone: close it.
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(_ACLOSE_TIMEOUT):
                    await aclose()
    else:
        for request in requests:
            await send(request)
    await stream.send_end()


@asynccontextmanager
async def open_call(
    pool: StreamPool,
    peer_id,
    method: str,
    requests,
    output_type: type[TOut],
    *,
    stream_input: bool,
    max_message_size: int,
    attachments: bool = False,
    attachment_buffer: Callable[[Message, int], Any] | None = None,
) -> AsyncIterator[_ResponseReader[TOut]]:
    """Start a call, send the request(s) in a background task, yield the response reader.

    On any exit before the responses ended (error, cancellation) the stream is closed, which
    cancels the handler on the callee; after a clean END it goes back to ``pool``.
    ``attachments``: requests and responses may be ``Attached`` (see rpc.py); a response's
    attachment is received into ``attachment_buffer(message, size)`` when that returns a
    buffer, else into a new numpy array.
    """
    if not stream_input and not isinstance(requests, Message):
        raise TypeError(f"the request must be a protobuf message, got {type(requests).__name__}")
    if not (isinstance(output_type, type) and issubclass(output_type, Message)):
        raise TypeError(f"output_type must be a protobuf message class, got {output_type!r}")
    if stream_input and isinstance(requests, Message):
        raise TypeError("stream_input=True needs an (async) iterable of messages")
    if not stream_input:
        # Serialized once, before dialling: a request over our own limit fails here.
        requests = serialize_checked(requests, max_message_size, f"the request of {method}")
    stream, reused = await pool.acquire(peer_id, max_message_size)
    reader = _ResponseReader(
        stream, method, output_type, reused, attachments, attachment_buffer if attachments else None
    )
    sent_all = reusable = False
    try:
        with collapse_exception_groups():
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    nonlocal sent_all
                    try:
                        await _send_requests(
                            stream, method, requests, max_message_size, stream_input, attachments
                        )
                        sent_all = True
                    except RPCCancelledError:
                        # The callee answered early (e.g. with an error) and closed its side: the
                        # reader reports what it said.
                        pass

                nursery.start_soon(send)
                yield reader
                reusable = reader.ended_with_end and sent_all
                nursery.cancel_scope.cancel()
    finally:
        # Closing (not resetting: a reset can stall py-libp2p's connection) before the responses
        # ended tells the callee to cancel the handler.
        if not (reusable and pool.release(peer_id, stream)):
            await stream.aclose()


async def call_unary_output(
    pool: StreamPool,
    peer_id,
    method: str,
    requests,
    output_type: type[TOut],
    *,
    stream_input: bool,
    max_message_size: int,
) -> TOut:
    """A call with one response. A reused stream that turns out dead before any answer (the
    callee closed it meanwhile) is retried once on a fresh stream; stream inputs are not,
    unless the callee said it read none of the call (``CallNotServedError``) and the requests
    are a list or tuple (sent again as they are)."""
    replayable = not stream_input or isinstance(requests, (list, tuple))
    for attempt in range(2):
        reader = None
        try:
            async with open_call(
                pool,
                peer_id,
                method,
                requests,
                output_type,
                stream_input=stream_input,
                max_message_size=max_message_size,
            ) as reader:
                response = await reader.next_message()
                if response is None:
                    raise RPCProtocolError(f"{method}: the peer ended the call without a response")
                if await reader.next_message() is not None:
                    raise RPCProtocolError(f"{method}: the peer sent more than one response")
                assert not isinstance(response, Attached)  # the call takes no attachments
                return response
        except RPCCancelledError as e:
            stale = (
                reader is not None
                and reader.reused
                and reader.stream.frames_received == reader.frames_before
            )
            if attempt == 0 and stale and not stream_input:
                logger.debug("%s: a reused stream to %s was dead; retrying", method, peer_id)
                continue
            if attempt == 0 and isinstance(e, CallNotServedError) and replayable:
                logger.debug("%s: %s did not serve the call; retrying", method, peer_id)
                continue
            raise
    raise AssertionError("unreachable")
