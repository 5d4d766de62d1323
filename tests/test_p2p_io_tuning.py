"""Buffered TCP reads (``p2p._io_tuning.BufferedTCPStream``) over a real socket pair."""

import pytest
import trio
from libp2p.io.trio import TrioTCPStream

from swarmtrain.p2p._io_tuning import BufferedTCPStream

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
