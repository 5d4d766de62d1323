"""Throughput levers for py-libp2p 0.8.1's TCP + Noise path, on our connections only.

- Buffered socket reads: Noise reads every message as a 2-byte length then a body, each a
  socket ``recv`` and a trio checkpoint. ``BufferedTCPStream`` pulls up to
  ``READ_BUFFER_SIZE`` bytes per ``recv`` and serves small reads from that buffer, with a
  checkpoint every ``CHECKPOINT_BYTES`` served (a burst of small frames would otherwise be
  parsed in one task step, holding the loop).
- One socket write per muxer frame: Noise splits a large write into 64 KiB messages and
  writes each with its own ``send_all``; ``BatchingNoiseReadWriter`` encrypts all messages of
  one write and sends them at once.

Our Noise transport (``private_network.PrivateNoiseTransport``) adopts the TCP stream of every
connection it secures (``adopt_raw_connection``) and the read-writer it builds
(``adopt_secured_connection``) into these subclasses, in place; py-libp2p's classes are not
changed. Set ``SWARMTRAIN_DISABLE_IO_TUNING=1`` to measure without them.
"""

from __future__ import annotations

import os

import trio
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.io.trio import TrioTCPStream
from libp2p.security.noise import io as noise_io
from libp2p.security.noise.io import NoiseTransportReadWriter

READ_BUFFER_SIZE = 1024 * 1024
#: bytes served from the buffer between two checkpoints of the reading task
CHECKPOINT_BYTES = 64 * 1024
_SIZE_LEN = noise_io.NoisePacketReadWriter.size_len_bytes
_MAX_PLAINTEXT = noise_io.MAX_PLAINTEXT_LENGTH


def _disabled() -> bool:
    return os.environ.get("SWARMTRAIN_DISABLE_IO_TUNING") == "1"


class BufferedTCPStream(TrioTCPStream):
    """py-libp2p's TCP stream reading up to ``READ_BUFFER_SIZE`` bytes per ``recv``."""

    _buffer: bytearray | None = None
    _served = 0  # bytes served from the buffer since the last checkpoint

    async def read(self, n: int | None = None) -> bytes:
        if self._buffer and self._served >= CHECKPOINT_BYTES:
            # before taking, so readers still return bytes in the order they took them
            self._served = 0
            await trio.lowlevel.checkpoint()
        if n is None:  # whatever is available: the buffer first, never behind a later recv
            if self._buffer:
                return self._take(len(self._buffer))
            return await super().read(n)
        if n == 0:
            return b""
        if self._buffer:
            return self._take(n)
        async with self.read_lock:
            if self._buffer:  # another reader filled it while we waited for the lock
                return self._take(n)
            try:
                data = await self.stream.receive_some(max(n, READ_BUFFER_SIZE))
            except trio.BrokenResourceError as error:
                raise ConnectionClosedError(
                    f"TCP connection reset by remote peer: {error}", transport="tcp"
                ) from error
            except trio.ClosedResourceError:
                return b""
            self._served = 0  # the recv was a checkpoint
            if len(data) <= n:
                return data
            self._buffer = bytearray(data[n:])
            return data[:n]

    def _take(self, n: int) -> bytes:
        buffer = self._buffer
        assert buffer is not None  # callers take only from a non-empty buffer
        chunk = bytes(buffer[:n])
        del buffer[:n]
        self._served += len(chunk)
        return chunk


class BatchingNoiseReadWriter(NoiseTransportReadWriter):
    """py-libp2p's Noise transport read-writer sending all messages of one write at once."""

    async def write_msg(self, msg: bytes, prefix_encoded: bool = False) -> None:
        if prefix_encoded or len(msg) <= _MAX_PLAINTEXT:
            await super().write_msg(msg, prefix_encoded)
            return
        out = bytearray()
        view = memoryview(msg)
        for start in range(0, len(msg), _MAX_PLAINTEXT):
            encrypted = self.encrypt(bytes(view[start : start + _MAX_PLAINTEXT]))
            out += len(encrypted).to_bytes(_SIZE_LEN, "big")
            out += encrypted
        await self.read_writer.read_write_closer.write(bytes(out))


def adopt_raw_connection(conn) -> None:
    """Make the TCP stream of a raw connection about to be secured a ``BufferedTCPStream``."""
    stream = getattr(conn, "stream", None)
    if type(stream) is TrioTCPStream and not _disabled():
        stream.__class__ = BufferedTCPStream


def adopt_secured_connection(secured) -> None:
    """Make the Noise read-writer of a secured connection a ``BatchingNoiseReadWriter``."""
    read_writer = getattr(secured, "conn", None)
    if type(read_writer) is NoiseTransportReadWriter and not _disabled():
        read_writer.__class__ = BatchingNoiseReadWriter
