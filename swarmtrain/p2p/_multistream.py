"""Multistream-select with the header and the protocol sent together (one round trip).

py-libp2p 0.8.1's client writes ``/multistream/1.0.0``, waits for the echo, then writes the
protocol and waits again: two round trips, and two encrypted frames each way, before every
stream's first byte, and four more during each dial (security, then muxer). Here the client
writes both lines in one write and then reads both answers: the same bytes on the wire, in
the order every multistream-select listener (py-libp2p's, go-libp2p's) reads them, one round
trip fewer. Only single-protocol selections (all of swarmtrain's) are pipelined; a list of
protocols keeps py-libp2p's one-at-a-time negotiation.
"""

from __future__ import annotations

import trio


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
