"""The relay side of a circuit: py-libp2p 0.8.1's circuit relay v2 with our own splice.

Once a relay accepted a circuit (the hop CONNECT and the target's STOP exchange, py-libp2p's
``CircuitV2Protocol._handle_connect``), two tasks copy bytes between the source's and the
target's streams (``_relay_data``, one per direction). py-libp2p 0.8.1's copy loop has these
faults, so ``SplicingCircuitRelay`` replaces it (for the relays our hosts run; py-libp2p's class
is not changed):

- It cleans up by *peer*: when either direction of a circuit ends, it closes the streams it
  finds under that peer's id in ``_active_relays``, a dict that holds one circuit per peer. A
  second circuit between the same two peers (both dialled at once, or a redial) overwrote the
  first one's entries, so when the first ended it closed the second's streams: the other
  connection died with it (its calls failed, or their answers never came back).
- A clean end of one direction (EOF) closed both streams: a half-closed circuit lost its other
  direction.
- A write that waited 15 s (``write_timeout``) for the target to read ended the direction: a
  relayed stream under backpressure (a receiver that reads later) lost its circuit. Our
  muxer bounds a window wait (``_yamux.WINDOW_WAIT_TIMEOUT``) and each frame write itself.
- Reads of at most 64 KiB (``MAX_READ_LEN``): a 1 MiB yamux frame of the relayed connection
  crossed the relay as 16 reads, writes and frames.
- The circuit's duration cap was checked only when data arrived (an idle circuit outlived it).

Here each direction reads up to ``SPLICE_READ_SIZE`` bytes and writes them on; on EOF it
half-closes the other stream (the other direction goes on), on a reset, an error or a lapsed
limit it resets both streams; the two streams are closed once both directions ended, and
only this circuit's entries leave ``_active_relays``. Data and duration limits are the
relay's (shared by both directions, as py-libp2p's).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

from swarmtrain.p2p._yamux import FRAME_WRITE_TIMEOUT, WINDOW_WAIT_TIMEOUT

logger = logging.getLogger("swarmtrain.p2p.relay")

#: the most bytes one read of a circuit's stream takes (a whole 1 MiB frame of ours)
SPLICE_READ_SIZE = 1024 * 1024
#: a backstop on one write into a circuit (our muxer bounds window waits and frame writes)
SPLICE_WRITE_TIMEOUT = WINDOW_WAIT_TIMEOUT + FRAME_WRITE_TIMEOUT
#: how long closing a finished circuit's streams may take
SPLICE_CLOSE_TIMEOUT = 5.0


class _CircuitEnded(Exception):
    """A direction of a circuit must end with both streams reset (``reason`` says why)."""


class SplicingCircuitRelay(CircuitV2Protocol):
    """py-libp2p's circuit relay v2 protocol whose circuits are spliced by our copy loop."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # circuits (by their two streams) of which one direction ended: "half" (EOF: the
        # other still copies) or "reset" (both streams reset: the other ends at once)
        self._ending: dict[frozenset[int], str] = {}
        self.circuits_spliced = 0  # ended cleanly (EOF both ways)
        self.circuits_reset = 0  # ended by a reset, an error or a limit

    async def _relay_data(  # type: ignore[override]  # same call, keyword defaults as stock
        self,
        src_stream: Any,
        dst_stream: Any,
        peer_id: Any,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        """Copy ``src_stream`` to ``dst_stream`` until EOF, a reset, an error or a limit."""
        circuit = frozenset((id(src_stream), id(dst_stream)))
        try:
            timeout = float("inf") if deadline is None else deadline - time.monotonic()
            with trio.move_on_after(max(timeout, 0.0)) as cap:
                await _copy(src_stream, dst_stream, circuit_data_limit)
            if cap.cancelled_caught:
                raise _CircuitEnded(f"duration limit of the circuit with {peer_id}")
        except Exception as e:  # a reset, a broken stream or a limit
            other = self._ending.pop(circuit, None)
            if other == "reset":
                return  # the other direction reset both streams
            if other is None:
                self._ending[circuit] = "reset"  # the other direction ends with our reset
            logger.debug("circuit with %s reset: %s", peer_id, e)
            self._forget(src_stream, dst_stream)
            self.circuits_reset += 1
            with trio.CancelScope(shield=True):
                await _reset(src_stream)
                await _reset(dst_stream)
            return
        # EOF: the source will send no more; the other direction may still carry data
        other = self._ending.pop(circuit, None)
        if other == "reset":
            return
        if other is None:
            self._ending[circuit] = "half"
            with trio.CancelScope(shield=True), trio.move_on_after(SPLICE_CLOSE_TIMEOUT):
                try:
                    await dst_stream.close_write()
                except Exception:
                    await _reset(dst_stream)
            return
        self._forget(src_stream, dst_stream)
        self.circuits_spliced += 1
        with trio.CancelScope(shield=True), trio.move_on_after(SPLICE_CLOSE_TIMEOUT):
            for stream in (dst_stream, src_stream):
                try:
                    await stream.close()
                except Exception:
                    await _reset(stream)

    def _forget(self, *streams: Any) -> None:
        """Drop the ``_active_relays`` entries (keyed by peer) that name one of ``streams``."""
        for peer, pair in list(self._active_relays.items()):
            if any(s is not None and any(s is t for t in streams) for s in pair):
                del self._active_relays[peer]


async def _copy(src_stream: Any, dst_stream: Any, data_limit: list[int] | None) -> None:
    """Copy until EOF (returns); raises on a reset, an error or the data limit."""
    while True:
        try:
            data = await src_stream.read(SPLICE_READ_SIZE)
        except StreamEOF:
            return
        if not data:
            return
        if data_limit is not None:
            if len(data) > data_limit[0]:
                raise _CircuitEnded("data limit of the circuit")
            data_limit[0] -= len(data)
        with trio.fail_after(SPLICE_WRITE_TIMEOUT):
            await dst_stream.write(data)


async def _reset(stream: Any) -> None:
    with trio.move_on_after(SPLICE_CLOSE_TIMEOUT):
        try:
            await stream.reset()
        except Exception:
            logger.debug("error resetting a circuit's stream", exc_info=True)
