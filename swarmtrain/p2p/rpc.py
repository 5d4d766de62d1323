"""Typed protobuf RPC over libp2p streams: handler registry, server side and client side.

One stream carries one call. The caller sends OPEN(method), its request message(s) and END,
then reads the response message(s) until END or ERROR. The callee answers with MESSAGE frames
and END, or a single ERROR frame. Either side closing or resetting the stream before the call
finished cancels the call on the other side:

- the caller cancels (timeout, task cancelled): it closes its side; the callee's watcher sees
  the end of stream before the call finished and cancels the handler;
- the callee cancels (shutdown, handler deadline): it sends ERROR(CANCELLED) and closes; the
  caller raises ``RPCCancelledError``.

Attachments: a method registered with ``attachments=True`` (and called with
``attachments=True``) may exchange ``Attached(message, attachment)`` items besides plain
messages, in both directions. The attachment (a numpy array, bytes, any contiguous buffer)
travels after the serialized message as raw bytes (an ATTACHED_MESSAGE frame, see framing.py):
sent from its own memory, received into a numpy array (or a buffer the caller picks), never
copied into or out of a protobuf field. A side that did not opt in rejects such frames as a
protocol error, and a peer of an older version rejects the frame kind: opt in per method, so
callers can tell old peers by ``NoSuchMethodError`` and fall back.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
from google.protobuf.message import DecodeError, Message

from swarmtrain.p2p.errors import (
    CallNotServedError,
    MessageTooLargeError,
    NoSuchMethodError,
    RemoteError,
    ResourceLimitError,
    RPCCancelledError,
    RPCError,
    RPCProtocolError,
    RPCTimeoutError,
)
from swarmtrain.p2p.framing import KIND_END, KIND_MESSAGE, KIND_OPEN, MESSAGE_KINDS, FrameKind
from swarmtrain.p2p.limits import ByteBudget, PeerCounter, ResourceLimits
from swarmtrain.p2p.rpc_stream import RPCStream, deadline_moved_by_bytes
from swarmtrain.proto import p2p_pb2
from swarmtrain.utils.exception_groups import collapse_exception_groups

logger = logging.getLogger(__name__)

RPC_PROTOCOL_ID = "/swarmtrain/rpc/1.0.0"
DEFAULT_MAX_MESSAGE_SIZE = 256 * 1024 * 1024
# How long a callee waits for the next frame of a request before giving up on the caller.
DEFAULT_REQUEST_IDLE_TIMEOUT = 60.0
_DRAIN_TIMEOUT = 5.0  # seconds to wait for the END of a request the handler left unread
# A callee keeps an idle stream open this long for the caller's next call (callers reuse
# streams for at most CALLER_STREAM_REUSE_TIME, well inside this; a data lane has its own).
SERVER_STREAM_IDLE_TIMEOUT = 30.0
CALLER_STREAM_REUSE_TIME = 15.0

ErrorCode = p2p_pb2.RPCErrorCode
TOut = TypeVar("TOut", bound=Message)


@dataclass(frozen=True)
class RPCContext:
    """What a handler knows about the call: who is calling and which method."""

    remote_id: Any  # libp2p.peer.id.ID
    method: str


@dataclass(frozen=True, slots=True)
class Attached:
    """A protobuf message plus raw bytes that travel with it (see the module docstring).

    :param message: the message
    :param attachment: a contiguous buffer (numpy array, bytes, memoryview); received
      attachments are uint8 numpy arrays unless the receiver supplied the buffer
    """

    message: Message
    attachment: Any

    @property
    def nbytes(self) -> int:
        return memoryview(self.attachment).nbytes


@dataclass(frozen=True)
class HandlerSpec:
    name: str
    handler: Callable[..., Any]
    input_type: type[Message]
    stream_input: bool
    stream_output: bool
    max_message_size: int
    timeout: float | None
    attachments: bool = False
    attachment_buffer: Callable[[Message, int], Any] | None = None


def serialize_checked(message: Message, max_message_size: int, what: str) -> bytes:
    payload = message.SerializeToString()
    if len(payload) > max_message_size:
        raise MessageTooLargeError(
            f"{what} is {len(payload)} bytes, over the max_message_size of {max_message_size}"
        )
    return payload


def parse_message(message_type: type[Message], payload, what: str) -> Message:
    try:
        return message_type.FromString(payload)
    except DecodeError as e:
        raise RPCProtocolError(f"{what} is not a valid {message_type.__name__}: {e}") from None


async def send_item(stream: RPCStream, item, max_message_size: int, what: str, attachments: bool):
    """Send a message, or an ``Attached`` one where ``attachments`` are allowed."""
    if not isinstance(item, Attached):
        await stream.send_message(serialize_checked(item, max_message_size, what))
        return
    if not attachments:
        raise TypeError(f"{what} is Attached, but the method was not set up for attachments")
    payload = serialize_checked(item.message, max_message_size, what)
    size = len(payload) + item.nbytes
    if size > max_message_size:
        raise MessageTooLargeError(
            f"{what} is {size} bytes with its attachment, over the max_message_size of "
            f"{max_message_size}"
        )
    await stream.send_attached(payload, item.attachment)


async def receive_item(
    stream: RPCStream,
    frame,
    message_type: type[Message],
    what: str,
    attachments: bool,
    attachment_buffer: Callable[[Message, int], Any] | None = None,
):
    """The message of a MESSAGE or ATTACHED_MESSAGE frame (``Attached``, with the attachment
    received into ``attachment_buffer(message, size)`` or a new numpy array)."""
    message = parse_message(message_type, frame.payload, what)
    if frame.kind == KIND_MESSAGE:
        return message
    if not attachments:
        raise RPCProtocolError(f"{what} came with an attachment, which this method does not take")
    size = frame.attachment_size
    buffer = attachment_buffer(message, size) if attachment_buffer is not None else None
    return Attached(message, await stream.receive_attachment(buffer))


def _remote_failure(method: str, header: p2p_pb2.RPCFrameHeader) -> RPCError:
    code, kind, text = header.error_code, header.error_type, header.error_message
    if code == ErrorCode.NO_SUCH_METHOD:
        return NoSuchMethodError(f"the peer has no handler named {method!r}")
    if code == ErrorCode.MESSAGE_TOO_LARGE:
        return MessageTooLargeError(f"{method}: the peer refused a message: {text}")
    if code == ErrorCode.PROTOCOL_ERROR:
        return RPCProtocolError(f"{method}: the peer reported a protocol error: {text}")
    if code == ErrorCode.CANCELLED:
        return RPCCancelledError(f"{method}: the peer cancelled the call: {text}")
    if code == ErrorCode.NOT_SERVED:
        return CallNotServedError(f"{method}: the peer closed the stream unread: {text}")
    if code == ErrorCode.TIMEOUT:
        return RPCTimeoutError(f"{method}: the peer timed out: {text}")
    if code == ErrorCode.RESOURCE_EXHAUSTED:
        return ResourceLimitError(f"{method}: the peer refused the call: {text}")
    return RemoteError(method, kind or "Exception", text)


def _error_code(error: RPCError) -> p2p_pb2.RPCErrorCode:
    """The ERROR code that tells the caller about a call we refuse."""
    if isinstance(error, MessageTooLargeError):
        return ErrorCode.MESSAGE_TOO_LARGE
    if isinstance(error, ResourceLimitError):
        return ErrorCode.RESOURCE_EXHAUSTED
    return ErrorCode.PROTOCOL_ERROR


class _IncomingMessages:
    """Async iterator over the request messages of a stream-input call (server side)."""

    def __init__(self, stream: RPCStream, spec: HandlerSpec, idle_timeout: float):
        self._stream, self._spec, self._idle_timeout = stream, spec, idle_timeout
        self.finished = trio.Event()
        self._on_bytes: Callable[[int], None] | None = None

    def __aiter__(self) -> _IncomingMessages:
        return self

    def set_on_bytes(self, callback: Callable[[int], None] | None) -> None:
        """Call ``callback(count)`` for every read that brings bytes of this request (a
        deadline that moves while a large message keeps arriving); None: stop."""
        self._on_bytes = callback

    def _relay_bytes(self, count: int) -> None:
        if self._on_bytes is not None:
            self._on_bytes(count)

    async def __anext__(self) -> Message:
        """The next message; ``RPCTimeoutError`` if none began within ``idle_timeout`` or
        its bytes stopped coming for that long (a large message over a slow path may take
        longer: ``stall_core.ProgressDeadline``)."""
        if self.finished.is_set():
            raise StopAsyncIteration
        stream = self._stream
        moving = deadline_moved_by_bytes(stream, self._idle_timeout, self._relay_bytes)
        with moving as (scope, guard):
            frame = await stream.receive_frame()
            if frame is not None and frame.kind in MESSAGE_KINDS:
                return await receive_item(
                    stream,
                    frame,
                    self._spec.input_type,
                    "the request",
                    self._spec.attachments,
                    self._spec.attachment_buffer,
                )
        if scope.cancelled_caught:
            what = f"{guard.received} bytes of a" if guard.received else "no"
            raise RPCTimeoutError(
                f"{what} request message, then nothing for {self._idle_timeout} s"
            )
        if frame is None:
            raise RPCCancelledError("the caller closed the stream before END")
        if frame.kind == KIND_END:
            self.finished.set()
            raise StopAsyncIteration
        raise RPCProtocolError(f"unexpected frame {FrameKind.Name(frame.kind)} in a request")


class RPCServer:
    """Handler registry plus the callee side of the protocol. Owned by a ``P2P`` object."""

    def __init__(
        self,
        default_max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        limits: ResourceLimits | None = None,
    ):
        self.default_max_message_size = default_max_message_size
        self.limits = limits if limits is not None else ResourceLimits()
        #: bytes held by incoming messages not yet complete, over all inbound streams and
        #: per calling peer
        self.budget = ByteBudget(
            self.limits.max_bytes_in_flight,
            self.limits.bytes_in_flight_per_peer(default_max_message_size),
        )
        self.calls_per_peer = PeerCounter(
            self.limits.max_inbound_calls_per_peer, "concurrent inbound calls"
        )
        self.request_idle_timeout = DEFAULT_REQUEST_IDLE_TIMEOUT
        #: how long a stream waits for the caller's next call (``serve_stream`` may be given
        #: its own)
        self.stream_idle_timeout = SERVER_STREAM_IDLE_TIMEOUT
        self._handlers: dict[str, HandlerSpec] = {}
        self._active_calls: set[trio.CancelScope] = set()
        self._closing = False
        self._became_idle = trio.Event()
        self.calls_served = 0

    def add_handler(
        self,
        name: str,
        handler: Callable[..., Any],
        input_type: type[Message],
        *,
        stream_input: bool = False,
        stream_output: bool = False,
        max_message_size: int | None = None,
        timeout: float | None = None,
        replace: bool = False,
        attachments: bool = False,
        attachment_buffer: Callable[[Message, int], Any] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("handler name must be a non-empty string")
        if not (isinstance(input_type, type) and issubclass(input_type, Message)):
            raise TypeError(f"input_type must be a protobuf message class, got {input_type!r}")
        if name in self._handlers and not replace:
            raise ValueError(f"a handler named {name!r} is already registered")
        if stream_output and not inspect.isasyncgenfunction(handler):
            if not callable(handler):
                raise TypeError("handler must be callable")
        elif not stream_output and not inspect.iscoroutinefunction(handler):
            raise TypeError(f"handler for {name!r} must be an async function")
        self._handlers[name] = HandlerSpec(
            name=name,
            handler=handler,
            input_type=input_type,
            stream_input=stream_input,
            stream_output=stream_output,
            max_message_size=max_message_size or self.default_max_message_size,
            timeout=timeout,
            attachments=attachments,
            attachment_buffer=attachment_buffer,
        )

    def remove_handler(self, name: str) -> None:
        self._handlers.pop(name, None)

    @property
    def handler_names(self) -> list[str]:
        return sorted(self._handlers)

    def cancel_all(self) -> None:
        """Stop accepting calls and cancel the running ones (they answer ERROR(CANCELLED))."""
        self._closing = True
        for scope in list(self._active_calls):
            scope.cancel()

    async def wait_idle(self) -> None:
        """Wait until no call is being served (e.g. after ``cancel_all``)."""
        if self._active_calls:
            await self._became_idle.wait()

    async def serve_stream(
        self,
        net_stream,
        remote_id,
        on_call: Callable[[bool], None] | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        """Serve the calls of one incoming stream. Never raises: failures go to the caller or
        the debug log.

        ``idle_timeout``: how long the stream waits for each call, the first one included
        (a data lane's own, ``lane.LANE_IDLE_TIMEOUT``); None: ``request_idle_timeout`` for
        the first call and ``stream_idle_timeout`` for each next one. A peer past
        ``limits.max_inbound_calls_per_peer`` streams gets ERROR(RESOURCE_EXHAUSTED) at once;
        receive buffers are charged to the host's ``budget`` and to the peer's share of it.
        ``on_call(True)`` is called when a call's OPEN arrived, ``on_call(False)`` when it
        ended and the stream waits for the next one (a data lane's book of idle lanes)."""
        stream = RPCStream(
            net_stream, self.default_max_message_size, self.budget.for_peer(remote_id)
        )
        try:
            self.calls_per_peer.acquire(remote_id)
        except ResourceLimitError as e:
            logger.debug("refusing a stream from %s: %s", remote_id, e)
            await self._send_error_quietly(
                stream, ErrorCode.RESOURCE_EXHAUSTED, type(e).__name__, str(e)
            )
            await stream.aclose()
            return
        scope = trio.CancelScope()
        self._active_calls.add(scope)
        try:
            try:
                with scope:
                    if self._closing:
                        scope.cancel()
                    # One stream carries calls one after another: the caller may reuse it
                    # after a call ended with END.
                    first = self.request_idle_timeout if idle_timeout is None else idle_timeout
                    after = self.stream_idle_timeout if idle_timeout is None else idle_timeout
                    waiting = first
                    while await self._serve(stream, remote_id, waiting, on_call):
                        waiting = after
            except trio.Cancelled:
                # py-libp2p itself is being cancelled (host shutdown): still tell the caller.
                if stream.serving_call:
                    await self._send_error_quietly(
                        stream, ErrorCode.CANCELLED, "Cancelled", "the callee is shutting down"
                    )
                raise
            if scope.cancelled_caught and stream.serving_call:
                # (an idle stream waiting for its next call learns it from the connection)
                await self._send_error_quietly(
                    stream, ErrorCode.CANCELLED, "Cancelled", "the callee is shutting down"
                )
        except (RPCProtocolError, MessageTooLargeError, ResourceLimitError) as e:
            logger.debug("rejecting a call from %s: %s", remote_id, e)
            await self._send_error_quietly(stream, _error_code(e), type(e).__name__, str(e))
        except RPCError as e:
            logger.debug("call from %s ended early: %s", remote_id, e)
        except Exception:
            logger.exception("unexpected failure serving a call from %s", remote_id)
        finally:
            stream.release_buffers()
            self.calls_per_peer.release(remote_id)
            self._active_calls.discard(scope)
            if not self._active_calls:
                self._became_idle.set()
                self._became_idle = trio.Event()
        await stream.aclose()

    async def _send_error_quietly(
        self, stream: RPCStream, code: p2p_pb2.RPCErrorCode, kind: str, text: str
    ):
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            try:
                await stream.send_error(code, kind, text)
            except RPCError:
                pass

    async def _serve(
        self,
        stream: RPCStream,
        remote_id,
        idle_timeout: float,
        on_call: Callable[[bool], None] | None = None,
    ) -> bool:
        """Serve one call; True if it ended cleanly and the stream may carry another."""
        stream.expect_open()  # nothing but a header-sized OPEN is read before the method
        with trio.move_on_after(idle_timeout) as open_scope:
            frame = await stream.receive_frame()
        if open_scope.cancelled_caught or frame is None:
            return False
        stream.serving_call = True  # stays set if the call is cancelled: see serve_stream
        if on_call is not None:
            on_call(True)
        ended_cleanly = await self._serve_call(stream, remote_id, frame)
        stream.serving_call = False
        if on_call is not None:
            on_call(False)
        return ended_cleanly

    async def _serve_call(self, stream: RPCStream, remote_id, frame) -> bool:
        if frame.kind != KIND_OPEN:
            raise RPCProtocolError(f"a call must start with OPEN, got {FrameKind.Name(frame.kind)}")
        spec = self._handlers.get(frame.header.method)
        if spec is None:
            await stream.send_error(
                ErrorCode.NO_SUCH_METHOD,
                "NoSuchMethod",
                f"no handler named {frame.header.method!r}",
            )
            return False
        stream.set_max_message_size(spec.max_message_size)
        context = RPCContext(remote_id=remote_id, method=spec.name)
        incoming = _IncomingMessages(stream, spec, self.request_idle_timeout)
        if spec.stream_input:
            request: Any = incoming
        else:
            request = await incoming.__anext__()
            try:
                await incoming.__anext__()
            except StopAsyncIteration:
                pass
            else:
                raise RPCProtocolError(f"{spec.name} takes one request message, got more")

        caller_gone = handler_ended = False
        with collapse_exception_groups():
            async with trio.open_nursery() as nursery:

                async def watch_caller() -> None:
                    # After the request is complete the caller only reads; anything it sends now
                    # (normally the end of stream) means it gave up on the call.
                    nonlocal caller_gone
                    await incoming.finished.wait()
                    stream.expect_open()  # (the caller's next call, if anything)
                    try:
                        frame = await stream.receive_frame()
                    except RPCError:
                        frame = None
                    if handler_ended:
                        stream.unread(frame)  # the caller's next call, not a cancellation
                        return
                    caller_gone = True
                    nursery.cancel_scope.cancel()

                async def run_handler() -> None:
                    nonlocal handler_ended
                    try:
                        with trio.fail_after(spec.timeout if spec.timeout else math.inf):
                            handler_ended = await self._run_handler(spec, request, context, stream)
                    except trio.TooSlowError:
                        await stream.send_error(
                            ErrorCode.TIMEOUT, "Timeout", f"handler ran past {spec.timeout} s"
                        )
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_caller)
                nursery.start_soon(run_handler)
        if caller_gone:
            logger.debug("%s: the caller %s cancelled the call", spec.name, remote_id)
        self.calls_served += 1
        if handler_ended and not caller_gone and not incoming.finished.is_set():
            # The handler answered without reading the whole request: the caller's remaining
            # messages and its END are still on the stream, ahead of its next call.
            return await self._drain_request(incoming)
        return handler_ended and not caller_gone

    async def _drain_request(self, incoming: _IncomingMessages) -> bool:
        """Skip the rest of a request the handler did not read; True if its END arrived in time
        (the stream may carry another call), False if the stream must be closed."""
        with trio.move_on_after(min(self.request_idle_timeout, _DRAIN_TIMEOUT)):
            try:
                async for _ in incoming:
                    pass
            except RPCError:
                return False
            return True
        return False

    async def _run_handler(self, spec, request, context, stream: RPCStream) -> bool:
        """Run the handler and answer; True if the call ended with END."""
        try:
            if spec.stream_output:
                responses = spec.handler(request, context)
                try:
                    async for response in responses:
                        await send_item(
                            stream,
                            response,
                            spec.max_message_size,
                            f"a response of {spec.name}",
                            spec.attachments,
                        )
                finally:
                    aclose = getattr(responses, "aclose", None)
                    if aclose is not None:
                        with trio.CancelScope(shield=True):
                            await aclose()
            else:
                response = await spec.handler(request, context)
                if isinstance(response, Attached):
                    await send_item(
                        stream,
                        response,
                        spec.max_message_size,
                        f"the response of {spec.name}",
                        spec.attachments,
                    )
                    await stream.send_end()
                    return True
                if not isinstance(response, Message):
                    raise TypeError(
                        f"handler {spec.name} returned {type(response).__name__}, "
                        "not a protobuf message"
                    )
                payload = serialize_checked(
                    response, spec.max_message_size, f"the response of {spec.name}"
                )
                await stream.send_message(payload, end=True)
                return True
        except (RPCCancelledError, RPCTimeoutError):
            raise  # the caller is gone or too slow: nobody to answer
        except RPCProtocolError:
            raise
        except (MessageTooLargeError, ResourceLimitError) as e:
            await stream.send_error(_error_code(e), type(e).__name__, str(e))
            return False
        except Exception as e:
            logger.debug("handler %s raised", spec.name, exc_info=True)
            await stream.send_error(ErrorCode.HANDLER_ERROR, type(e).__name__, str(e))
            return False
        await stream.send_end()
        return True
