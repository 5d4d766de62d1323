"""Multistream-select with the header and the protocol sent together (one round trip).

py-libp2p 0.8.1's client writes ``/multistream/1.0.0``, waits for the echo, then writes the
protocol and waits again: two round trips, and two encrypted frames each way, before every
stream's first byte, and four more during each dial (security, then muxer). Here the client
writes both lines in one write and then reads both answers: the same bytes on the wire, in
the order every multistream-select listener (py-libp2p's, go-libp2p's) reads them, one round
trip fewer. Only single-protocol selections (all of swarmtrain's) are pipelined; a list of
protocols keeps py-libp2p's one-at-a-time negotiation. Our hosts get their own client instances
(``use_pipelined_multistream``); py-libp2p's ``MultiselectClient`` class is not changed.

RPC streams go one step further (``open_lazily_negotiated_stream``): the call's first frame
follows the two lines without waiting, and the answers are checked when the reply is read.
"""

from __future__ import annotations

import trio
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IOException
from libp2p.network.stream.exceptions import StreamError
from libp2p.protocol_muxer import multiselect_client as client_module
from libp2p.protocol_muxer.exceptions import MultiselectClientError, MultiselectCommunicatorError
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.utils import encode_delim, read_delim

HEADER = client_module.MULTISELECT_PROTOCOL_ID
NOT_FOUND = client_module.PROTOCOL_NOT_FOUND_MSG
_COALESCE_LIMIT = 64 * 1024  # a first write up to this size goes out with the two lines


def selection_lines(protocol: str) -> bytes:
    """What a client sends to select ``protocol``: the header line, then the protocol line."""
    return encode_delim(HEADER.encode()) + encode_delim(protocol.encode())


def answer_problem(header: str, answer: str, protocol: str) -> str | None:
    """Why the answers to ``selection_lines(protocol)`` refuse it, or None if they accept."""
    if header != HEADER:
        return f"multistream-select protocol ID mismatch: expected {HEADER}, got {header[:64]!r}"
    if answer == protocol:
        return None
    if answer == NOT_FOUND:
        return f"the peer does not serve {protocol} (protocols not supported)"
    return f"unrecognized response {answer[:64]!r} to {protocol}"


class PipelinedMultiselectClient(client_module.MultiselectClient):
    """py-libp2p's multistream-select client, pipelined for single-protocol selections."""

    async def select_one_of(self, protocols, communicator, negotiate_timeout=30):
        if len(protocols) != 1 or type(communicator) is not MultiselectCommunicator:
            return await super().select_one_of(protocols, communicator, negotiate_timeout)
        (protocol,) = protocols
        wanted = protocol if protocol is not None else ""
        with trio.move_on_after(negotiate_timeout):
            try:
                await communicator.read_writer.write(selection_lines(wanted))
            except (IOException, AssertionError, ValueError) as error:
                raise MultiselectClientError(f"handshake write failed: {error}") from error
            try:
                header = await communicator.read()
                answer = await communicator.read()
            except MultiselectCommunicatorError as error:
                raise MultiselectClientError(
                    f"protocol read failed: {error}, protocol={protocol}"
                ) from error
            problem = answer_problem(header, answer, wanted)
            if problem is not None:
                raise MultiselectClientError(problem)
            return protocol
        raise MultiselectClientError(
            f"response timed out after {negotiate_timeout}s, protocols tried: {[protocol]}"
        )


def use_pipelined_multistream(host) -> None:
    """Give ``host`` (a py-libp2p BasicHost) and its upgrader's security and muxer selection a
    ``PipelinedMultiselectClient`` each: instance attributes, py-libp2p's class stays as is."""
    upgrader = host.get_network().upgrader
    selectors = [upgrader.security_multistream._selector, upgrader.muxer_multistream._selector]
    for owner in (host, *selectors):
        current = getattr(owner, "multiselect_client", None)
        if not isinstance(current, client_module.MultiselectClient):
            raise RuntimeError(f"libp2p internals changed: {owner!r} has no multiselect_client")
        owner.multiselect_client = PipelinedMultiselectClient()


async def open_lazily_negotiated_stream(network, peer_id, protocol_id: str):
    """A new stream to ``peer_id`` that speaks ``protocol_id`` without waiting for the peer's
    agreement: the header and the protocol go out with our first write, and the answers are
    checked on the first read (0 round trips instead of 1, and one frame fewer). For
    protocols every peer we call serves (swarmtrain's RPC): a peer that refuses fails the
    first read with ``StreamError`` (our first message then reached its multistream-select
    reader, which answers ``na`` to it or closes the stream)."""
    stream = await network.new_stream(peer_id)
    stream.set_protocol(protocol_id)
    return LazilyNegotiatedStream(stream, protocol_id)


class LazilyNegotiatedStream:
    """A py-libp2p stream whose multistream-select lines go out with its first write and
    whose answers are read before its first byte."""

    def __init__(self, stream, protocol_id: str):
        self._stream = stream
        self._protocol_id = protocol_id
        self._unsent = selection_lines(protocol_id)
        self._confirmed = False

    def __getattr__(self, name):  # everything else as the stream itself (muxed_stream, ...)
        return getattr(self._stream, name)

    async def write(self, data: bytes) -> None:
        if self._unsent:
            unsent, self._unsent = self._unsent, b""
            if len(data) > _COALESCE_LIMIT:  # not worth a copy: two frames
                await self._stream.write(unsent)
            else:
                data = unsent + bytes(data)
        await self._stream.write(data)

    async def read(self, n: int | None = None) -> bytes:
        if not self._confirmed:
            if self._unsent:
                await self.write(b"")
            await self._confirm()
        return await self._stream.read(n)

    async def _confirm(self) -> None:
        try:
            header = await read_delim(self._stream)
            answer = await read_delim(self._stream)
        except ParseError as e:
            raise StreamError(f"malformed multistream-select answer: {e}") from None
        problem = answer_problem(
            header.decode(errors="replace"), answer.decode(errors="replace"), self._protocol_id
        )
        if problem is not None:
            raise StreamError(problem)
        self._confirmed = True

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()
