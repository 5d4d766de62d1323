"""Yamux flow control between real py-libp2p hosts on loopback (swarmtrain's patches of 0.8.1).

Receive credit goes back in batches (half the window, as in go-yamux) instead of one
WINDOW_UPDATE frame per read, and a writer blocked on a closed send window is woken by the
update instead of polling every 10 ms.
"""

import sys

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value

from swarmtrain.p2p import P2P

pytestmark = pytest.mark.trio

RAW_PROTOCOL = "/swarmtrain-test/raw/1.0.0"
QUIET = {"use_relay": False, "relay_service": False, "use_autonat": False}
MIB = 1024 * 1024


async def echo_bytes(request, context):
    return request


async def slow_total(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
        await trio.sleep(0.005)  # a slow consumer: the sender's window closes again and again
    return Int64Value(value=total)


@pytest.fixture
def window_updates(monkeypatch):
    """Increments of every WINDOW_UPDATE frame sent for data read (not SYN/ACK/FIN)."""
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    sent: list[int] = []
    original = YamuxStream.send_window_update

    async def counting(self, increment, skip_lock=False):
        sent.append(increment)
        await original(self, increment, skip_lock=skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counting)
    return sent


@pytest.fixture
def window_polls(monkeypatch):
    """10 ms sleeps in py-libp2p's yamux module: its writer's closed-window poll."""
    polls: list[float] = []
    original = trio.sleep

    async def spying_sleep(seconds):
        caller = sys._getframe(1).f_globals.get("__name__")
        if seconds == 0.01 and caller == "libp2p.stream_muxer.yamux.yamux":
            polls.append(seconds)
        await original(seconds)

    monkeypatch.setattr(trio, "sleep", spying_sleep)
    return polls


async def test_small_calls_do_not_send_a_window_update_per_read(window_updates):
    async with (
        P2P.create(**QUIET) as a,
        P2P.create(a.get_visible_maddrs(), **QUIET) as b,
    ):
        a.add_protobuf_handler("test::Yamux.echo", echo_bytes, BytesValue)
        small = BytesValue(value=bytes(300))
        await b.call_protobuf_handler(a.peer_id, "test::Yamux.echo", small, BytesValue)
        window_updates.clear()

        async def calls():
            for _ in range(50):
                reply = await b.call_protobuf_handler(
                    a.peer_id, "test::Yamux.echo", small, BytesValue
                )
                assert reply.value == small.value

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(calls)
        assert len(window_updates) < 10, len(window_updates)  # py-libp2p: 2 per call (400)

        # a large message still gets its credit back (through many closed windows) and arrives
        big = BytesValue(value=bytes(range(256)) * (32 * 1024))
        reply = await b.call_protobuf_handler(a.peer_id, "test::Yamux.echo", big, BytesValue)
        assert reply.value == big.value and window_updates
        reply = await b.call_protobuf_handler(a.peer_id, "test::Yamux.echo", small, BytesValue)
        assert reply.value == small.value


async def test_a_writer_on_a_closed_window_waits_for_the_update_not_a_poll(window_polls):
    async with (
        P2P.create(use_data_lanes=False, **QUIET) as a,
        P2P.create(a.get_visible_maddrs(), use_data_lanes=False, **QUIET) as b,
    ):
        a.add_protobuf_handler("test::Yamux.total", slow_total, BytesValue, stream_input=True)
        chunk = BytesValue(value=b"\x07" * MIB)
        with trio.fail_after(60):
            reply = await b.call_protobuf_handler(
                a.peer_id, "test::Yamux.total", [chunk] * 24, Int64Value, stream_input=True
            )
        assert reply.value == 24 * MIB
        assert window_polls == []  # py-libp2p's writer: a 10 ms sleep per closed window


async def _blocked_writer(a: P2P, b: P2P, on_stream):
    """``b`` writes more than yamux's largest window (16 MiB) to a reader that does not read."""
    a.host.set_stream_handler(RAW_PROTOCOL, on_stream)
    stream = await b.new_stream(a.peer_id, RAW_PROTOCOL)
    await stream.write(bytes(32 * MIB))


async def test_a_blocked_writer_wakes_up_when_the_peer_resets_the_stream():
    from libp2p.network.stream.exceptions import StreamReset

    async def reset_later(stream):
        await trio.sleep(0.3)
        await stream.reset()

    async with (
        P2P.create(use_data_lanes=False, **QUIET) as a,
        P2P.create(a.get_visible_maddrs(), use_data_lanes=False, **QUIET) as b,
    ):
        started = trio.current_time()
        with pytest.raises(StreamReset), trio.fail_after(3):  # not the window wait timeout
            await _blocked_writer(a, b, reset_later)
        assert trio.current_time() - started < 3


async def test_a_writer_without_credit_times_out(monkeypatch):
    from libp2p.network.stream.exceptions import StreamReset

    from swarmtrain.p2p import _yamux

    monkeypatch.setattr(_yamux, "WINDOW_WAIT_TIMEOUT", 0.3)  # read when a wait starts
    never_read = trio.Event()

    async def hold(stream):
        await never_read.wait()

    async with (
        P2P.create(use_data_lanes=False, **QUIET) as a,
        P2P.create(a.get_visible_maddrs(), use_data_lanes=False, **QUIET) as b,
    ):
        with pytest.raises(StreamReset) as raised, trio.fail_after(5):
            await _blocked_writer(a, b, hold)
        assert "send window" in str(raised.value.__cause__)
        never_read.set()


async def count_bytes(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


def _shrink_send_buffers(p2p: P2P, peer_id, size: int) -> None:
    """A small kernel send buffer on ``p2p``'s TCP connections to ``peer_id``: what TCP gives
    a connection on a long fat pipe at first (windows not grown yet), here on loopback."""
    import socket

    for conn in p2p._host.get_network().connections[peer_id]:
        tcp = conn.muxed_conn.secured_conn.conn.conn.stream.stream  # noise, raw, trio
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


async def test_read_loops_answer_new_streams_while_both_sockets_are_full():
    """Both peers stream bulk data to each other and open new streams (calls) meanwhile, over
    sockets with small send buffers. py-libp2p's read loop wrote each new stream's ACK itself,
    behind its own data writer blocked on the full socket; with both loops waiting so, neither
    side read and the connection froze until FRAME_WRITE_TIMEOUT (60 s; the all-reduce stall
    at 300 ms RTT, docs/reliability.md). Our read loop queues such frames."""
    async with (
        P2P.create(use_data_lanes=False, **QUIET) as a,
        P2P.create(a.get_visible_maddrs(), use_data_lanes=False, **QUIET) as b,
    ):
        for host in (a, b):
            host.add_protobuf_handler(
                "test::Yamux.count", count_bytes, BytesValue, stream_input=True
            )
            host.add_protobuf_handler("test::Yamux.echo", echo_bytes, BytesValue)
        small = BytesValue(value=b"y")
        await a.call_protobuf_handler(b.peer_id, "test::Yamux.echo", small, BytesValue)
        _shrink_send_buffers(a, b.peer_id, 4096)
        _shrink_send_buffers(b, a.peer_id, 4096)

        async def bulk(src: P2P, dst: P2P) -> None:
            chunks = [BytesValue(value=bytes(MIB))] * 16
            reply = await src.call_protobuf_handler(
                dst.peer_id, "test::Yamux.count", chunks, Int64Value, stream_input=True
            )
            assert reply.value == 16 * MIB

        async def calls(src: P2P, dst: P2P) -> None:
            for _ in range(10):  # 8 at once: new streams while the bulk calls run
                async with trio.open_nursery() as wave:
                    for _ in range(8):
                        wave.start_soon(
                            src.call_protobuf_handler,
                            dst.peer_id,
                            "test::Yamux.echo",
                            small,
                            BytesValue,
                        )

        with trio.fail_after(40):  # frozen: the 60 s frame write timeout would end it
            async with trio.open_nursery() as nursery:
                for src, dst in ((a, b), (b, a)):
                    nursery.start_soon(bulk, src, dst)
                    nursery.start_soon(calls, src, dst)
