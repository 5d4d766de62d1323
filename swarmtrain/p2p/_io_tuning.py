"""Throughput levers for py-libp2p 0.8.1's TCP + Noise path (see benchmarks/RESULTS.md).

- Buffered socket reads: Noise reads every message as a 2-byte length then a body, each a
  socket ``recv`` and a trio checkpoint. ``TrioTCPStream.read`` here pulls up to
  ``READ_BUFFER_SIZE`` bytes per ``recv`` and serves small reads from that buffer.
- One socket write per muxer frame: Noise splits a large write into 64 KiB messages and wrote
  each with its own ``send_all``; here all messages of one write are encrypted and sent at once.

Both replace methods of a pinned version (checked in ``apply_io_tuning``). Set
``SWARMTRAIN_DISABLE_IO_TUNING=1`` to measure without them.
"""

from __future__ import annotations

import os

import trio

READ_BUFFER_SIZE = 1024 * 1024
_applied = False


def apply_io_tuning() -> None:
    """Idempotently install the two levers described in the module docstring."""
    global _applied
    if _applied or os.environ.get("SWARMTRAIN_DISABLE_IO_TUNING") == "1":
        return
    import libp2p.security.noise.io as noise_io
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.io.trio import TrioTCPStream

    for owner, name in (
        (TrioTCPStream, "read"),
        (noise_io.BaseNoiseMsgReadWriter, "write_msg"),
        (noise_io, "MAX_PLAINTEXT_LENGTH"),
        (noise_io.NoisePacketReadWriter, "size_len_bytes"),
    ):
        if not hasattr(owner, name):
            raise RuntimeError(f"libp2p internals changed: {owner!r} has no {name}")
    original_read = TrioTCPStream.read

    async def buffered_read(self, n: int | None = None) -> bytes:
        if n is None:
            return await original_read(self, n)
        if n == 0:
            return b""
        buffer: bytearray | None = getattr(self, "_swarmtrain_buffer", None)
        if buffer:
            chunk = bytes(buffer[:n])
            del buffer[:n]
            return chunk
        async with self.read_lock:
            try:
                data = await self.stream.receive_some(max(n, READ_BUFFER_SIZE))
            except trio.BrokenResourceError as error:
                raise ConnectionClosedError(
                    f"TCP connection reset by remote peer: {error}", transport="tcp"
                ) from error
            except trio.ClosedResourceError:
                return b""
        if len(data) <= n:
            return data
        self._swarmtrain_buffer = bytearray(data[n:])
        return data[:n]

    size_len = noise_io.NoisePacketReadWriter.size_len_bytes
    max_plaintext = noise_io.MAX_PLAINTEXT_LENGTH
    original_write_msg = noise_io.BaseNoiseMsgReadWriter.write_msg

    async def write_msg_once(self, msg: bytes, prefix_encoded: bool = False) -> None:
        if prefix_encoded or len(msg) <= max_plaintext:
            await original_write_msg(self, msg, prefix_encoded)
            return
        out = bytearray()
        view = memoryview(msg)
        for start in range(0, len(msg), max_plaintext):
            encrypted = self.encrypt(bytes(view[start : start + max_plaintext]))
            out += len(encrypted).to_bytes(size_len, "big")
            out += encrypted
        await self.read_writer.read_write_closer.write(bytes(out))

    TrioTCPStream.read = buffered_read
    noise_io.BaseNoiseMsgReadWriter.write_msg = write_msg_once
    _applied = True
