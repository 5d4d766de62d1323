"""Buffered TCP reads (``p2p._io_tuning.BufferedTCPStream``) over a real socket pair."""

import pytest
import trio
import trio.testing
from libp2p.io.trio import TrioTCPStream

from swarmtrain.p2p._io_tuning import CHECKPOINT_BYTES, BufferedTCPStream

pytestmark = pytest.mark.trio


async def socket_pair():
    left, right = trio.socket.socketpair()
    return BufferedTCPStream(trio.SocketStream(left)), TrioTCPStream(trio.SocketStream(right))


async def test_small_reads_come_from_one_recv_in_order():
    reader, writer = await socket_pair()
    async with trio.open_nursery():
        data = bytes(range(256)) * 64
        await writer.write(data)
        got = bytearray()
        with trio.fail_after(5):
            while len(got) < len(data):
                got += await reader.read(3)
        assert bytes(got) == data
        assert not reader._buffer
    await reader.close()
    await writer.close()


async def test_concurrent_readers_and_read_all_never_reorder_bytes():
    reader, writer = await socket_pair()
    data = bytes(i % 251 for i in range(200_000))
    pieces: list[tuple[int, bytes]] = []
    counter = 0

    async def read_some(size):
        nonlocal counter
        chunk = await reader.read(size)
        counter += 1
        pieces.append((counter, chunk))

    await writer.write(data)
    with trio.fail_after(5):
        while sum(len(c) for _, c in pieces) < len(data):
            async with trio.open_nursery() as nursery:  # two readers race for the buffer
                nursery.start_soon(read_some, 7)
                nursery.start_soon(read_some, 1000)
            if reader._buffer:
                pieces.append((counter + 1, await reader.read(None)))  # the whole buffer
                counter += 1
    joined = b"".join(c for _, c in sorted(pieces, key=lambda p: p[0]))
    assert joined == data
    await reader.close()
    await writer.close()


async def test_a_burst_of_small_reads_from_the_buffer_lets_other_tasks_run():
    """A 1 MiB burst read as 1 KiB pieces (a yamux reader parsing small frames) is served from
    one recv; without checkpoints the loop would run nothing else until the burst is parsed."""
    sender, receiver = trio.testing.memory_stream_pair()  # one receive_some returns it all
    reader = BufferedTCPStream(receiver)  # type: ignore[arg-type]
    burst = bytes(i % 253 for i in range(1024 * 1024))
    await sender.send_all(burst)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    got = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()  # the ticker starts
        before = ticks
        while len(got) < len(burst):
            got += await reader.read(1024)
        during = ticks - before
        nursery.cancel_scope.cancel()
    assert bytes(got) == burst
    assert during >= len(burst) // CHECKPOINT_BYTES - 1
