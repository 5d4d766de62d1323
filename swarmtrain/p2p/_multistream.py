"""Multistream-select with the header and the protocol sent together (one round trip).

py-libp2p 0.8.1's client writes ``/multistream/1.0.0``, waits for the echo, then writes the
protocol and waits again: two round trips, and two encrypted frames each way, before every
stream's first byte, and four more during each dial (security, then muxer). Here the client
writes both lines in one write and then reads both answers: the same bytes on the wire, in
the order every multistream-select listener (py-libp2p's, go-libp2p's) reads them, one round
trip fewer. Only single-protocol selections (all of swarmtrain's) are pipelined; a list of
protocols keeps py-libp2p's one-at-a-time negotiation.

RPC streams go one step further (``open_lazily_negotiated_stream``): the call's first frame
follows the two lines without waiting, and the answers are checked when the reply is read.
"""

from __future__ import annotations

import trio

_COALESCE_LIMIT = 64 * 1024  # a first write up to this size goes out with the two lines


def pipeline_multistream_select() -> None:
    """Patch ``MultiselectClient.select_one_of`` (idempotent)."""
    from libp2p.io.exceptions import IOException
    from libp2p.protocol_muxer import multiselect_client as client_module
    from libp2p.protocol_muxer.exceptions import (
        MultiselectClientError,
        MultiselectCommunicatorError,
    )
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
    from libp2p.utils import encode_delim

    client_class = client_module.MultiselectClient
    current = getattr(client_class, "select_one_of", None)
    for name in ("MULTISELECT_PROTOCOL_ID", "PROTOCOL_NOT_FOUND_MSG"):
        if not hasattr(client_module, name):
            raise RuntimeError(f"libp2p internals changed: multiselect_client.{name} is missing")
    if current is None:
        raise RuntimeError("libp2p internals changed: MultiselectClient.select_one_of is missing")
    if getattr(current, "swarmtrain_fixed", False):
        return
    header = client_module.MULTISELECT_PROTOCOL_ID
    not_found = client_module.PROTOCOL_NOT_FOUND_MSG

    async def select_one_of(self, protocols, communicator, negotiate_timeout=30):
        if len(protocols) != 1 or type(communicator) is not MultiselectCommunicator:
            return await current(self, protocols, communicator, negotiate_timeout)
        (protocol,) = protocols
        wanted = protocol if protocol is not None else ""
        with trio.move_on_after(negotiate_timeout):
            try:
                await communicator.read_writer.write(
                    encode_delim(header.encode()) + encode_delim(wanted.encode())
                )
            except (IOException, AssertionError, ValueError) as error:
                raise MultiselectClientError(f"handshake write failed: {error}") from error
            try:
                answered_header = await communicator.read()
                answer = await communicator.read()
            except MultiselectCommunicatorError as error:
                raise MultiselectClientError(
                    f"protocol read failed: {error}, protocol={protocol}"
                ) from error
            if answered_header != header:
                raise MultiselectClientError(
                    f"multiselect protocol ID mismatch: expected {header}, got {answered_header!r}"
                )
            if answer == wanted:
                return protocol
            if answer == not_found:
                raise MultiselectClientError(
                    f"protocols not supported: tried {[protocol]}, timeout={negotiate_timeout}s"
                )
            raise MultiselectClientError(
                f"unrecognized response: {answer!r}, expected {wanted!r} or {not_found!r}, "
                f"protocol={protocol}"
            )
        raise MultiselectClientError(
            f"response timed out after {negotiate_timeout}s, protocols tried: {[protocol]}"
        )

    select_one_of.swarmtrain_fixed = True  # type: ignore[attr-defined]
    client_class.select_one_of = select_one_of


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
        from libp2p.protocol_muxer.multiselect_client import MULTISELECT_PROTOCOL_ID
        from libp2p.utils import encode_delim

        self._stream = stream
        self._protocol_id = protocol_id
        self._unsent = encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim(
            protocol_id.encode()
        )
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
        from libp2p.exceptions import ParseError
        from libp2p.network.stream.exceptions import StreamError
        from libp2p.protocol_muxer.multiselect_client import MULTISELECT_PROTOCOL_ID
        from libp2p.utils import read_delim

        try:
            header = await read_delim(self._stream)
            answer = await read_delim(self._stream)
        except ParseError as e:
            raise StreamError(f"malformed multistream-select answer: {e}") from None
        if header.decode(errors="replace") != MULTISELECT_PROTOCOL_ID:
            raise StreamError(f"multistream-select header mismatch: {header[:64]!r}")
        if answer.decode(errors="replace") != self._protocol_id:
            raise StreamError(
                f"the peer does not serve {self._protocol_id} (answered {answer[:64]!r})"
            )
        self._confirmed = True

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()
