"""The sender side of an all-reduce round (a mixin of ``AllReduceRunner``): one stream per
remote reducer sends the parts of its slice and reads back their averaged deltas (v2 wire:
bytes as attachments, deltas received in place; v1 for a peer without it). The attributes used
here are set by ``AllReduceRunner``; its log records go to the all-reduce logger.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import numpy as np
import torch

from swarmtrain.averaging.allreduce_core import Failure
from swarmtrain.averaging.allreduce_parts import (
    decode_part,
    encode_part,
    inline_decode,
    inline_encode,
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
)
from swarmtrain.compression import CompressionInfo, CompressionType, TensorDescriptor
from swarmtrain.compression.wire import dtype_name, tensor_to_numpy
from swarmtrain.p2p import Attached, CallNotServedError, NoSuchMethodError, P2PError
from swarmtrain.proto import averaging_pb2

if TYPE_CHECKING:
    from swarmtrain.averaging.allreduce import AllReduceConfig

__all__ = ["AllReduceSender"]

logger = logging.getLogger("swarmtrain.averaging.allreduce")


class AllReduceSender(RunnerSide):
    """``AllReduceRunner`` as a sender: our parts to each remote reducer, its deltas back."""

    # set by AllReduceRunner.__init__
    config: AllReduceConfig
    tensors: tuple[torch.Tensor, ...]
    weight: float
    part_bytes_sent: int
    _call_bytes: dict[int, int]
    _deadline: float

    async def _requests_for(
        self, reducer: int, attached: bool
    ) -> AsyncIterator[averaging_pb2.AveragingRequest | Attached]:
        core, compression = self.core, self.config.compression
        for k in range(core.num_parts_for(reducer)):
            spec = core.container.part_spec(reducer, k)
            part = core.container.input_part(reducer, k)
            info = CompressionInfo(
                key=spec.tensor_index,
                descriptor=TensorDescriptor.from_tensor(self.tensors[spec.tensor_index]),
                part_index=k,
                part_size=spec.numel,
                part_offset=spec.start,
            )
            inline = inline_encode(compression, part)
            if attached:  # lossless parts are views of our tensors: no copy before the wire
                message = await run_codec(inline, encode_part, compression, part, info)
                part_proto = part_header(message)
            else:
                message = await run_codec(inline, compression.compress, part, info)
                part_proto = part_to_proto(message)
            request = averaging_pb2.AveragingRequest(part_index=k, part=part_proto)
            if k == 0:
                request.group_id = self.group.group_id
                request.weight = self.weight
                if self.group.leader is not None:
                    request.leader = self.group.leader.to_bytes()
            self.part_bytes_sent += message.nbytes
            # taken back if the call is sent again (a reducer without v2, or one that read none)
            self._call_bytes[reducer] = self._call_bytes.get(reducer, 0) + message.nbytes
            self._trace("part_queued", reducer, k, message.nbytes)
            yield Attached(request, message.buffer) if attached else request
            self._trace("part_written", reducer, k, message.nbytes)

    async def _communicate_with_reducer(self, reducer: int) -> None:
        core = self.core
        peer_id = self.group.peer_ids[reducer]
        try:
            attached = self.service.speaks_v2(peer_id)
            try:
                await self._call_reducer_again_if_unread(reducer, attached)
            except NoSuchMethodError:
                if not attached or core.container.num_received(reducer):
                    raise
                logger.debug("reducer %s has no v2 all-reduce: parts go inside protobufs", peer_id)
                self.part_bytes_sent -= self._call_bytes.pop(reducer, 0)
                serves_v1 = True
                try:
                    await self._call_reducer(reducer, attached=False)
                except NoSuchMethodError:
                    serves_v1 = False  # neither (e.g. it is leaving): nothing to remember
                    raise
                finally:
                    if serves_v1:
                        self.service._remember_v1_peer(peer_id)
        except P2PError as e:
            logger.debug("reducer %s failed: %r", peer_id, e)
            core.fail_reducer(reducer, Failure.DISCONNECTED)
        finally:
            # A no-op unless the reducer is unfinished (we were cancelled).
            past_deadline = anyio.current_time() >= self._deadline
            core.fail_reducer(reducer, Failure.DEADLINE if past_deadline else Failure.DISCONNECTED)
            self._notify()

    async def _call_reducer_again_if_unread(self, reducer: int, attached: bool) -> None:
        """``_call_reducer``, sent once more (over another lane or libp2p) when the reducer
        closed the stream without reading any of it (``CallNotServedError``: an idle lane it
        took for a newcomer just as we reused it). Other failures are raised."""
        try:
            await self._call_reducer(reducer, attached)
        except CallNotServedError:
            if self.core.container.num_received(reducer):
                raise  # (not sent before any answer: never the case)
            logger.debug("reducer %s read none of our call: sending it again", reducer)
            self.part_bytes_sent -= self._call_bytes.pop(reducer, 0)
            await self._call_reducer(reducer, attached)

    async def _call_reducer(self, reducer: int, attached: bool) -> None:
        """One call that sends the parts of ``reducer``'s slice and receives their deltas."""
        core = self.core
        service = self.service
        async with service.p2p.iterate_protobuf_handler(
            self.group.peer_ids[reducer],
            service.handler_v2_name if attached else service.handler_name,
            self._requests_for(reducer, attached),
            averaging_pb2.AveragingResponse,
            stream_input=True,
            next_message_timeout=None,
            max_message_size=service.max_message_size,
            bulk=True,
            attachments=attached,
            attachment_buffer=self._delta_buffer_chooser(reducer) if attached else None,
        ) as responses:
            for k in range(core.num_parts_for(reducer)):
                if not await self._receive_result(reducer, k, responses):
                    return
            with anyio.move_on_after(1.0):  # let the reducer end the call cleanly
                await _next_or_none(responses)

    def _delta_buffer_chooser(self, reducer: int):
        """Where a lossless delta of ``reducer`` is received: straight into the round's delta
        buffer when it is the part due next and its header fits, else None (a new array)."""
        container = self.core.container

        def choose(response: averaging_pb2.AveragingResponse, size: int):
            k = response.part_index
            if (
                response.code != Code.AVERAGING_AVERAGED_PART
                or response.delta.compression != CompressionType.NONE
                or k != container.num_received(reducer)
                or container.reducer_done(reducer)
            ):
                return None
            dtype = container.part_dtype(reducer, k)
            numel = container.part_spec(reducer, k).numel
            if response.delta.dtype != dtype_name(dtype) or tuple(response.delta.size) != (numel,):
                return None
            if size != numel * dtype.itemsize:
                return None
            region = container.delta_target(reducer, k)
            return None if region is None else tensor_to_numpy(region).view(np.uint8)

        return choose

    async def _receive_result(self, reducer: int, k: int, responses) -> bool:
        core = self.core
        deadline = core.reducer_deadline(reducer)
        with _progress_deadline(responses, deadline, core.reducer_timeout) as scope:
            response, attachment = unwrap(await _next_or_none(responses))
        if scope.cancelled_caught:
            core.fail_reducer(reducer, Failure.TIMEOUT)
            return False
        if response is None:
            core.fail_reducer(reducer, Failure.DISCONNECTED)
            return False
        if response.code == Code.AVERAGING_PART_UNCHANGED:
            ok = core.receive_delta(
                reducer, response.part_index, None, unchanged=True, now=anyio.current_time()
            )
        elif response.code == Code.AVERAGING_AVERAGED_PART:
            shape = (core.container.part_spec(reducer, k).numel,)
            dtype = core.container.part_dtype(reducer, k)
            inline = inline_decode(response.delta, shape[0])
            out = None  # a lossless attachment may already be in place (_delta_buffer_chooser)
            if response.delta.compression != CompressionType.NONE and response.part_index == k:
                out = core.container.delta_target(reducer, k)  # decode straight into place
            delta = await run_codec(
                inline, decode_part, response.delta, attachment, shape, dtype, out
            )
            ok = core.receive_delta(
                reducer, response.part_index, delta, unchanged=False, now=anyio.current_time()
            )
            if not ok and core.failed_reducers.get(self.group.peer_ids[reducer]) == (
                Failure.NON_FINITE
            ):
                logger.warning(
                    "peer %s sent NaN or inf averaged values (all-reduce %s): its slice keeps "
                    "this peer's own values",
                    self.group.peer_ids[reducer],
                    self.group.group_id.hex(),
                )
        else:
            logger.debug(
                "reducer %s answered %s: %s",
                self.group.peer_ids[reducer],
                Code.Name(response.code) if response.code in Code.values() else response.code,
                response.detail,
            )
            core.fail_reducer(reducer, Failure.REJECTED)
            if response.code in (Code.AVERAGING_FINISHED, Code.AVERAGING_BAD_GROUP_ID):
                # it has no live round for this group: it will not send us its parts either
                self._notify(core.ban_absent_sender(reducer, Failure.REJECTED))
            return False
        self._trace("delta_received", reducer, response.part_index)
        self._notify()
        return ok
