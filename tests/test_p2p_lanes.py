"""Direct data lanes (``bulk=True`` calls): records, tickets, and real hosts on loopback."""

import os

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value, StringValue
from lane_util import lane_over_socketpair

from swarmtrain.p2p import P2P, RemoteError, RPCTimeoutError, lane_caller
from swarmtrain.p2p import lane as lane_module
from swarmtrain.p2p.lane import TICKET_METHOD
from swarmtrain.p2p.lane_books import TicketBook
from swarmtrain.p2p.lane_records import (
    HEADER_SIZE,
    MAX_RECORD_PLAINTEXT,
    LaneRecordError,
    RecordOpener,
    RecordSealer,
)
from swarmtrain.p2p.rpc_stream import DirectByteStream
from swarmtrain.proto import p2p_pb2

# ------------------------------------------------------------------ records (sans-IO)


def _open_all(opener: RecordOpener, wire: bytes) -> list[bytes]:
    out, view = [], memoryview(wire)
    while view:
        size = opener.ciphertext_size(bytes(view[:HEADER_SIZE]))
        out.append(opener.open(view[HEADER_SIZE : HEADER_SIZE + size]))
        view = view[HEADER_SIZE + size :]
    return out


def test_records_round_trip_split_and_end():
    key = os.urandom(32)
    sealer, opener = RecordSealer(key), RecordOpener(key)
    data = os.urandom(2 * MAX_RECORD_PLAINTEXT + 5)
    wire = b"".join(bytes(r) for r in sealer.seal(data)) + sealer.seal_end()
    plaintexts = _open_all(opener, wire)
    assert [len(p) for p in plaintexts] == [MAX_RECORD_PLAINTEXT, MAX_RECORD_PLAINTEXT, 5, 0]
    assert b"".join(plaintexts) == data
    assert opener.ended and sealer.ended
    with pytest.raises(LaneRecordError):
        next(sealer.seal(b"more"))
    with pytest.raises(ValueError):
        next(RecordSealer(key).seal(b""))


def test_records_reject_tampering_replay_reordering_and_the_wrong_key():
    key = os.urandom(32)
    sealer = RecordSealer(key)
    first, second = (bytes(next(sealer.seal(m))) for m in (b"first", b"second"))
    tampered = bytearray(first)
    tampered[-1] ^= 1
    for wire in (bytes(tampered), second, first + first):  # flipped bit, reordered, replayed
        with pytest.raises(LaneRecordError):
            _open_all(RecordOpener(key), wire)
    with pytest.raises(LaneRecordError):
        _open_all(RecordOpener(os.urandom(32)), first)
    for size in (0, 15, MAX_RECORD_PLAINTEXT + 17, 2**32 - 1):
        with pytest.raises(LaneRecordError):
            RecordOpener.ciphertext_size(size.to_bytes(4, "big"))
    with pytest.raises(ValueError):
        RecordSealer(b"short")


def test_tickets_are_single_use_expire_and_are_capped():
    book = TicketBook(ttl=10.0, capacity=3, per_peer=2)
    ticket_id, ticket = book.issue("peer-a", now=0.0)
    assert len(ticket.caller_key) == len(ticket.callee_key) == 32
    assert ticket.caller_key != ticket.callee_key
    assert book.redeem(ticket_id, now=1.0) is ticket
    assert book.redeem(ticket_id, now=1.0) is None  # used
    late_id, _ = book.issue("peer-a", now=0.0)
    assert book.redeem(late_id, now=10.5) is None  # expired
    first_b, _ = book.issue("peer-b", now=20.0)
    book.issue("peer-b", now=20.0)
    book.issue("peer-b", now=20.0)  # over its own cap: its oldest goes
    assert book.outstanding("peer-b") == 2 and book.redeem(first_b, now=20.0) is None
    book.issue("peer-b", now=31.0)  # the expired ones made room
    assert book.outstanding("peer-b") == 1


@pytest.mark.trio
async def test_a_lane_read_cancelled_midway_resumes_where_it_stopped():
    key = os.urandom(32)
    lane, sock_b = lane_over_socketpair(key)
    try:
        data = os.urandom(300_000)
        wire = b"".join(bytes(r) for r in RecordSealer(key).seal(data))
        await sock_b.send(wire[:2])  # half a header
        with trio.move_on_after(0.2) as scope:
            await lane.read(1 << 20)
        assert scope.cancelled_caught
        await sock_b.send(wire[2:100_000])  # the rest of the header, part of the body
        with trio.move_on_after(0.2) as scope:
            await lane.read(1 << 20)
        assert scope.cancelled_caught
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sock_b.send, wire[100_000:])
            received = await lane.read(1 << 20)
        assert received == data
    finally:
        await lane.reset()
        sock_b.close()


async def _yields_during(work) -> int:
    """How often other tasks ran while ``work()`` (which never waits for its socket) ran."""
    turns = 0
    running = True

    async def ticker():
        nonlocal turns
        while running:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        while not turns:  # the ticker is running
            await trio.lowlevel.checkpoint()
        before = turns
        await work()
        yielded = turns - before
        running = False
    return yielded


@pytest.mark.trio
async def test_a_lane_is_the_byte_stream_rpc_streams_expect():
    lane, sock_b = lane_over_socketpair(os.urandom(32))
    try:
        assert isinstance(lane, DirectByteStream) and lane.cancel_safe and lane.record_size
    finally:
        await lane.reset()
        sock_b.close()


@pytest.mark.trio
async def test_a_long_transfer_lets_other_tasks_run():
    key = os.urandom(32)
    lane, sock_b = lane_over_socketpair(key)
    lane.yield_every_bytes = 8 * 1024
    try:
        records = []
        sealer = RecordSealer(key)
        for _ in range(16):  # 16 records of 4 KiB, all in the socket buffer before reading
            records += [bytes(r) for r in sealer.seal(os.urandom(4096))]
        await sock_b.send(b"".join(records))
        view = memoryview(bytearray(4096))

        async def read_all():
            for _ in range(16):
                assert await lane.read_into(view) == 4096

        # every byte is there: without pacing the reader never waits and nobody else runs
        assert await _yields_during(read_all) >= 6

        async def write_all():  # 64 KiB fit in the socket buffer: the writer never waits
            for _ in range(16):
                await lane.write(os.urandom(4096))

        assert await _yields_during(write_all) >= 6
    finally:
        await lane.reset()
        sock_b.close()


# ------------------------------------------------------------------ real hosts


async def total_size(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


async def chunks(request, context):
    for i in range(request.value):
        yield BytesValue(value=bytes([i % 256]) * (300_000 + i))


async def whoami(request, context):
    return StringValue(value=str(context.remote_id))


async def fail(request, context):
    raise KeyError("nope")


def serve(p2p):
    p2p.add_protobuf_handler("t::L.total_size", total_size, BytesValue, stream_input=True)
    p2p.add_protobuf_handler("t::L.chunks", chunks, Int64Value, stream_output=True)
    p2p.add_protobuf_handler("t::L.whoami", whoami, StringValue)
    p2p.add_protobuf_handler("t::L.fail", fail, StringValue)


@pytest.mark.trio
async def test_bulk_calls_travel_over_one_reused_lane():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        payload = [BytesValue(value=os.urandom(700_000)) for _ in range(5)]
        for _ in range(3):
            reply = await b.call_protobuf_handler(
                a.peer_id, "t::L.total_size", payload, Int64Value, stream_input=True, bulk=True
            )
            assert reply.value == 3_500_000
        async with b.iterate_protobuf_handler(
            a.peer_id, "t::L.chunks", Int64Value(value=7), BytesValue, bulk=True
        ) as responses:
            received = [r.value async for r in responses]
        assert received == [bytes([i]) * (300_000 + i) for i in range(7)]
        who = await b.call_protobuf_handler(
            a.peer_id, "t::L.whoami", StringValue(), StringValue, bulk=True
        )
        assert who.value == str(b.peer_id)  # the lane's calls are attributed to the ticket's peer
        with pytest.raises(RemoteError, match="nope"):
            await b.call_protobuf_handler(
                a.peer_id, "t::L.fail", StringValue(), StringValue, bulk=True
            )
        assert b.statistics()["lanes_opened"] == 1, b.statistics()
        assert a.statistics()["lanes_accepted"] == 1
        # the same calls without bulk still take libp2p streams
        reply = await b.call_protobuf_handler(
            a.peer_id, "t::L.total_size", payload, Int64Value, stream_input=True
        )
        assert reply.value == 3_500_000
        assert b.statistics()["rpc_streams_opened"] >= 2  # the ticket call and this one
        assert len(a.lanes.tickets) == 0  # the ticket was used up


@pytest.mark.trio
async def test_bulk_call_falls_back_to_libp2p_without_a_lane():
    async with (
        P2P.create(use_data_lanes=False) as a,
        P2P.create(initial_peers=a.get_visible_maddrs()) as b,
    ):
        serve(a)
        for _ in range(2):
            reply = await b.call_protobuf_handler(
                a.peer_id,
                "t::L.total_size",
                [BytesValue(value=b"x" * 1000)],
                Int64Value,
                stream_input=True,
                bulk=True,
            )
            assert reply.value == 1000
        stats = b.statistics()
        assert stats["lanes_opened"] == 0 and stats["lane_fallbacks"] == 1, stats
        assert TICKET_METHOD not in a.statistics()["handlers"]


@pytest.mark.trio
async def test_a_lane_slower_than_the_call_serves_the_next_call(monkeypatch):
    monkeypatch.setattr(lane_caller, "OPEN_WAIT", 0.0)  # no call waits for a new lane
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        payload = [BytesValue(value=b"q" * 500_000)] * 3
        reply = await b.call_protobuf_handler(
            a.peer_id, "t::L.total_size", payload, Int64Value, stream_input=True, bulk=True
        )
        assert reply.value == 1_500_000  # over libp2p, while the lane opens in the background
        for _ in range(100):
            if b.statistics()["lanes_opened"]:
                break
            await trio.sleep(0.05)
        assert b.statistics()["lanes_opened"] == 1
        reused_before = b._bulk_pool.streams_reused
        reply = await b.call_protobuf_handler(
            a.peer_id, "t::L.total_size", payload, Int64Value, stream_input=True, bulk=True
        )
        assert reply.value == 1_500_000
        assert b._bulk_pool.streams_reused == reused_before + 1
        idle = [s.stream for s, _ in b._bulk_pool._idle[a.peer_id]]
        lanes = [s for s in idle if isinstance(s, lane_module.LaneStream)]
        assert len(lanes) == 1 and lanes[0].bytes_on_wire > 1_500_000  # it went over the lane
        assert a.statistics()["lanes_accepted"] == 1 and b.statistics()["lane_fallbacks"] == 0


@pytest.mark.trio
async def test_cancelling_a_bulk_call_cancels_the_remote_handler():
    started, cancelled = trio.Event(), trio.Event()

    async def slow_sink(requests, context):
        try:
            async for _ in requests:
                started.set()
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler("t::L.slow", slow_sink, BytesValue, stream_input=True)
        serve(a)
        # open the lane first: the slow call's 1 s is then all the handler's (a first lane
        # may take most of a second to open on a loaded box)
        reply = await b.call_protobuf_handler(
            a.peer_id, "t::L.whoami", StringValue(), StringValue, bulk=True
        )
        assert reply.value == str(b.peer_id)
        with pytest.raises(RPCTimeoutError):
            await b.call_protobuf_handler(
                a.peer_id,
                "t::L.slow",
                [BytesValue(value=b"y" * 2_000_000)],
                Int64Value,
                stream_input=True,
                bulk=True,
                timeout=1.0,
            )
        assert started.is_set()
        with trio.fail_after(5):
            await cancelled.wait()
        assert b.statistics()["lanes_opened"] == 1


async def _raw_connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def _closed_by_peer(stream: trio.SocketStream) -> bool:
    with trio.move_on_after(8):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


@pytest.mark.trio
async def test_strangers_and_forged_records_are_dropped():
    async with (
        P2P.create(use_autonat=False) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), use_autonat=False) as b,
    ):
        serve(a)
        port = a.lanes.port
        # 1. a stranger with a made-up ticket: closed without an answer
        stranger = await _raw_connect(port)
        await stranger.send_all(os.urandom(16))
        assert await _closed_by_peer(stranger)
        await stranger.aclose()
        # 2. a real ticket (asked over libp2p), then records under a wrong key: no call runs
        ticket = await b.call_protobuf_handler(
            a.peer_id,
            TICKET_METHOD,
            p2p_pb2.LaneTicketRequest(version=1),
            p2p_pb2.LaneTicket,
        )
        assert ticket.ticket_id and ticket.port == port
        forger = await _raw_connect(port)
        await forger.send_all(ticket.ticket_id)
        accept = await forger.receive_some(4)  # the callee's accept record header
        assert len(accept) > 0
        forged = RecordSealer(os.urandom(32))
        for record in forged.seal(b"\x00" * 64):
            await forger.send_all(bytes(record))
        assert await _closed_by_peer(forger)
        await forger.aclose()
        # 3. the used ticket cannot be replayed
        replay = await _raw_connect(port)
        await replay.send_all(ticket.ticket_id)
        assert await _closed_by_peer(replay)
        await replay.aclose()
        # 4. an oversized record header from a ticket holder is refused before any allocation
        ticket = await b.call_protobuf_handler(
            a.peer_id, TICKET_METHOD, p2p_pb2.LaneTicketRequest(version=1), p2p_pb2.LaneTicket
        )
        big = await _raw_connect(port)
        await big.send_all(ticket.ticket_id + (2**31).to_bytes(4, "big"))
        assert await _closed_by_peer(big)
        await big.aclose()
        assert a.statistics()["calls_served"] == 2  # the two ticket calls, nothing else
        # honest bulk calls still work
        reply = await b.call_protobuf_handler(
            a.peer_id,
            "t::L.total_size",
            [BytesValue(value=b"z" * 10)],
            Int64Value,
            stream_input=True,
            bulk=True,
        )
        assert reply.value == 10 and b.statistics()["lanes_opened"] == 1


@pytest.mark.trio
async def test_lane_of_a_closed_peer_is_not_reused():
    async with P2P.create() as a:
        serve(a)
        async with P2P.create(initial_peers=a.get_visible_maddrs()) as b:
            serve(b)
            await a.call_protobuf_handler(
                b.peer_id, "t::L.whoami", StringValue(), StringValue, bulk=True
            )
            lane_stream = a._bulk_pool._idle[b.peer_id][0][0]
            assert lane_stream.is_reusable()
        # b is gone: the idle lane shows its end and is not handed out again
        for _ in range(100):
            if not lane_stream.is_reusable():
                break
            await trio.sleep(0.05)
        assert not lane_stream.is_reusable()


def test_lane_listen_host_follows_the_first_tcp_address():
    from swarmtrain.p2p.host import P2PConfig
    from swarmtrain.p2p.lane import lane_listen_host

    def _lane_listen_host(config: P2PConfig):
        return lane_listen_host(config.host_maddrs, config.client_mode)

    assert _lane_listen_host(P2PConfig()) == "127.0.0.1"
    assert _lane_listen_host(P2PConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0",))) == "0.0.0.0"
    assert _lane_listen_host(P2PConfig(host_maddrs=("/ip6/::1/tcp/4001",))) == "::1"
    assert _lane_listen_host(P2PConfig(client_mode=True)) is None
    with pytest.raises(ValueError):
        P2PConfig(data_lane_port=70000)
