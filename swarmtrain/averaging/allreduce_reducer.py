"""The reducer side of an all-reduce round (a mixin of ``AllReduceRunner``): each sender's
stream brings the parts of our slice; once a part is reduced over all senders, the delta goes
back on that stream (as an attachment on the v2 wire). The attributes used here are set by
``AllReduceRunner``; its log records go to the all-reduce logger.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import anyio
import torch

from swarmtrain.averaging.allreduce_core import (
    Failure,
    Reject,
)
from swarmtrain.averaging.allreduce_parts import (
    INLINE_MAX_BYTES,
    INLINE_WIRE_TYPES,
    decode_part,
    encode_part,
    inline_decode,
    part_header,
    part_to_proto,
    run_codec,
    unwrap,
)
from swarmtrain.averaging.allreduce_rpc import (
    Code,
    RunnerSide,
    _next_or_none,
    _progress_deadline,
    _response,
)
from swarmtrain.compression import CompressionType, NoCompression, serialize_torch_tensor
from swarmtrain.p2p import Attached, P2PError
from swarmtrain.proto import averaging_pb2

if TYPE_CHECKING:
    pass

__all__ = ["AllReduceReducer"]

logger = logging.getLogger("swarmtrain.averaging.allreduce")

_REJECT_CODES = {
    Reject.BAD_GROUP_ID: Code.AVERAGING_BAD_GROUP_ID,
    Reject.NOT_A_SENDER: Code.AVERAGING_NOT_A_SENDER,
    Reject.NOT_A_REDUCER: Code.AVERAGING_NOT_A_REDUCER,
    Reject.DUPLICATE_SENDER: Code.AVERAGING_DUPLICATE_SENDER,
    Reject.BANNED: Code.AVERAGING_BANNED,
    Reject.BAD_PART: Code.AVERAGING_BAD_PART,
    Reject.FINISHED: Code.AVERAGING_FINISHED,
}


class AllReduceReducer(RunnerSide):
    """``AllReduceRunner`` as a reducer: the senders' parts of our slice in, deltas out."""

    # set by AllReduceRunner.__init__
    delta_bytes_sent: int
    _part_ready: list[anyio.Event]
    _read_scopes: dict[int, anyio.CancelScope]
    _closed: bool

    async def _serve_sender(
        self, first, requests, remote_id, attached: bool = False
    ) -> AsyncGenerator[averaging_pb2.AveragingResponse | Attached]:
        """Average one sender's parts with the others' and stream back the deltas
        (``attached``: a v2 call, the deltas go back as attachments)."""
        core = self.core
        peer = self.group.index_of(remote_id)
        if self._closed:
            yield _response(Code.AVERAGING_FINISHED, "this round is over")
            return
        request, payload = unwrap(first)
        reject = core.open_sender(peer, request.group_id, request.weight, anyio.current_time())
        if reject is not None:
            self._notify()
            yield _response(_REJECT_CODES[reject], f"rejected: {reject.value}")
            return
        if peer is None:  # unreachable: open_sender rejects non-members
            return
        try:
            for k in range(core.num_local_parts):
                if k > 0:
                    request, payload = unwrap(await self._next_part(peer, requests))
                    if request is None:
                        yield self._why_stopped(peer)
                        return
                shape, dtype = core.local_part_shape(k)
                inline = inline_decode(request.part, shape[0])
                sent = await run_codec(inline, decode_part, request.part, payload, shape, dtype)
                outcome = core.receive_part(peer, request.part_index, sent, anyio.current_time())
                self._trace("part_received", peer, request.part_index)
                self._notify(outcome.completed)
                if outcome.reject is not None:
                    detail = f"part {k} rejected"
                    if core.banned_senders.get(remote_id) == Failure.NON_FINITE:
                        detail = f"part {k} holds NaN or inf values"
                        logger.warning(
                            "peer %s sent NaN or inf values (part %d of all-reduce %s): its "
                            "contribution is left out of this round",
                            remote_id,
                            k,
                            self.group.group_id.hex(),
                        )
                    yield _response(_REJECT_CODES[outcome.reject], detail)
                    return
                await self._part_ready[k].wait()
                if self._closed or core.sender_banned(peer):
                    yield self._why_stopped(peer)
                    return
                result = await self._result(peer, k, sent, request.part.compression, attached)
                self._trace("delta_queued", peer, k)
                yield result
                self._trace("delta_written", peer, k)
                core.result_sent(peer, k, anyio.current_time())
                # the delta went out: nothing reads the received part any more
                sent = None
                self.service._part_buffers.give(payload)
                self._notify()
        finally:
            self._notify(core.ban_sender(peer, Failure.DISCONNECTED))  # no-op once it is done

    async def _next_part(self, peer: int, requests):
        """The sender's next request, or None (then it is banned, or the round is over)."""
        core = self.core
        deadline = core.sender_deadline(peer)
        with _progress_deadline(requests, deadline, core.sender_timeout) as scope:
            self._read_scopes[peer] = scope
            try:
                request = await _next_or_none(requests)
            except P2PError as e:
                logger.debug("sender %s failed: %r", self.group.peer_ids[peer], e)
                request = None
            finally:
                self._read_scopes.pop(peer, None)
        if scope.cancelled_caught and not self._closed:
            self._notify(core.ban_sender(peer, Failure.TIMEOUT))
            return None
        if request is None:
            self._notify(core.ban_sender(peer, Failure.DISCONNECTED))
        return request

    def _why_stopped(self, peer: int) -> averaging_pb2.AveragingResponse:
        reason = self.core.banned_senders.get(self.group.peer_ids[peer])
        if self._closed or reason in (None, Failure.DEADLINE):
            return _response(Code.AVERAGING_FINISHED, "this round is over")
        if reason == Failure.TIMEOUT:
            return _response(Code.AVERAGING_SENDER_TIMEOUT, "no part within sender_timeout")
        return _response(Code.AVERAGING_BANNED, f"banned: {reason.value}")

    async def _result(
        self, peer: int, k: int, sent: torch.Tensor, compression: int, attached: bool
    ) -> averaging_pb2.AveragingResponse | Attached:
        # ``sent`` was decoded for this call alone (into memory of its own): reuse it
        delta = self.core.delta_for(peer, k, sent, out=sent)
        if delta is None:
            return _response(Code.AVERAGING_PART_UNCHANGED, part_index=k)
        nbytes = delta.numel() * delta.element_size()
        inline = compression in INLINE_WIRE_TYPES and nbytes <= INLINE_MAX_BYTES
        if attached and compression == CompressionType.NONE:
            message = encode_part(NoCompression(), delta)  # a view: sent before it can change
        else:
            message = await run_codec(inline, serialize_torch_tensor, delta, compression)
        self.delta_bytes_sent += message.nbytes
        if not attached:
            return _response(
                Code.AVERAGING_AVERAGED_PART, part_index=k, delta=part_to_proto(message)
            )
        response = _response(Code.AVERAGING_AVERAGED_PART, part_index=k, delta=part_header(message))
        return Attached(response, message.buffer)
