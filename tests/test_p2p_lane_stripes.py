"""Striped data lanes (``lane_stripes.StripedLane``): over socket pairs (a stalled and a dying
stripe, a hostile far end) and between real hosts on loopback (the bytes, reuse, the
callee's limits, a peer opening stripes it was not granted)."""

import hashlib
import os
import socket

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, StringValue

from swarmtrain.p2p import P2P, ResourceLimits
from swarmtrain.p2p.errors import (
    LaneEndOfStream,
    LaneResetError,
    LaneStripeError,
    ResourceLimitError,
)
from swarmtrain.p2p.lane import TICKET_METHOD, LaneStream, tcp_rtt
from swarmtrain.p2p.lane_records import RecordOpener, RecordSealer
from swarmtrain.p2p.lane_stripes import StripedLane
from swarmtrain.p2p.rpc_stream import DirectByteStream
from swarmtrain.p2p.stripe_core import SEQ_SIZE
from swarmtrain.proto import p2p_pb2
from tests.test_p2p_lanes import _closed_by_peer


def stripe_pairs(count: int) -> tuple[list[LaneStream], list[LaneStream]]:
    """``count`` connected stripe pairs (near, far) sharing two keys, as a ticket gives."""
    key_a, key_b = os.urandom(32), os.urandom(32)
    near, far = [], []
    for stripe in range(count):
        raw_a, raw_b = socket.socketpair()
        for raw in (raw_a, raw_b):
            raw.setblocking(False)
        sock_a, sock_b = (trio.socket.from_stdlib_socket(r) for r in (raw_a, raw_b))
        near.append(
            LaneStream(raw_a, sock_a, RecordSealer(key_a, stripe), RecordOpener(key_b, stripe))
        )
        far.append(
            LaneStream(raw_b, sock_b, RecordSealer(key_b, stripe), RecordOpener(key_a, stripe))
        )
    return near, far


async def read_exactly(lane, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        out += await lane.read(size - len(out))
    return bytes(out)


@pytest.mark.trio
async def test_a_striped_lane_carries_a_byte_stream_both_ways_and_ends_cleanly():
    near, far = stripe_pairs(3)
    a, b = StripedLane(near), StripedLane(far)
    assert isinstance(a, DirectByteStream) and a.cancel_safe
    data = os.urandom(3_000_001)
    back = os.urandom(500_000)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.write, data)
            nursery.start_soon(b.write, back)
            assert await read_exactly(b, len(data)) == data
            view = bytearray(len(back))
            got = 0
            while got < len(back):
                got += await a.read_into(memoryview(view)[got:])
            assert bytes(view) == back
        assert a.is_reusable() and b.is_reusable()
        assert sum(1 for n in a.statistics()["records_per_stripe"] if n) >= 2  # spread
        await a.close()
        with pytest.raises(LaneEndOfStream):
            await b.read()
    await b.reset()


@pytest.mark.trio
async def test_a_stalled_stripe_does_not_hold_the_others():
    near, far = stripe_pairs(3)
    a = StripedLane(near)
    received = [0, 0, 0]

    async def drain(stripe: int) -> None:
        while record := await far[stripe].receive_record():
            received[stripe] += len(record) - SEQ_SIZE

    size = 16_000_000  # far more than stripe 0's socket buffer holds
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for stripe in (1, 2):  # stripe 0's far end never reads: that flow stalls
                nursery.start_soon(drain, stripe)
            await a.write(os.urandom(size))  # completes: the others take the rest
            per_stripe = a.statistics()["records_per_stripe"]
            for stripe in (1, 2):
                await near[stripe].close()  # their drains end (stripe 0's would never)
    assert received[1] + received[2] > 0.9 * size, (received, per_stripe)
    assert per_stripe[0] < 0.1 * sum(per_stripe)
    a.reset_now()
    for lane in far:
        lane.reset_now()


@pytest.mark.trio
async def test_a_stripe_that_dies_mid_call_fails_the_read_at_once():
    near, far = stripe_pairs(3)
    a, b = StripedLane(near), StripedLane(far)
    await a.write(b"first")
    assert await b.read() == b"first"
    far_stripe = near[1]
    far_stripe.reset_now()  # one connection is cut: no end record
    with trio.fail_after(5), pytest.raises(LaneResetError):
        while True:  # stripe 1 may carry the next record: its cut is seen
            await b.read()
    assert not b.is_reusable()
    a.reset_now()
    b.reset_now()


@pytest.mark.trio
@pytest.mark.parametrize(
    "seq, payload, match",
    [
        (1 << 40, b"far ahead", "ahead"),
        (0, b"", "without payload"),
        (0, b"x" * (StripedLane.record_size + 1), "bytes"),
    ],
)
async def test_a_hostile_far_end_gets_a_typed_error(seq, payload, match):
    near, far = stripe_pairs(2)
    b = StripedLane(far)
    # the peer writes one stripe record by hand (its stripe keys are valid)
    await near[0].write(seq.to_bytes(SEQ_SIZE, "big") + payload)
    with trio.fail_after(5), pytest.raises(LaneStripeError, match=match):
        await b.read()
    assert not b.is_reusable()
    for lane in near:
        lane.reset_now()
    b.reset_now()


@pytest.mark.trio
async def test_duplicate_records_across_stripes_are_refused():
    near, far = stripe_pairs(2)
    b = StripedLane(far)
    for stripe in (0, 1):
        await near[stripe].write((0).to_bytes(SEQ_SIZE, "big") + b"same")
    with trio.fail_after(5), pytest.raises(LaneStripeError, match="twice"):
        for _ in range(2):
            await b.read()
    for lane in near:
        lane.reset_now()
    b.reset_now()


# ------------------------------------------------------------------ real hosts


async def digest(requests, context):
    total, sha = 0, hashlib.sha256()
    async for request in requests:
        total += len(request.value)
        sha.update(request.value)
    return StringValue(value=f"{total} {sha.hexdigest()}")


async def bulk_digest(caller: P2P, callee_id, chunks: list[bytes]) -> str:
    reply = await caller.call_protobuf_handler(
        callee_id,
        "t::S.digest",
        [BytesValue(value=c) for c in chunks],
        StringValue,
        stream_input=True,
        bulk=True,
    )
    return reply.value


def expected_digest(chunks: list[bytes]) -> str:
    return f"{sum(map(len, chunks))} {hashlib.sha256(b''.join(chunks)).hexdigest()}"


# stripe on loopback too, every granted stripe (with BBR at both ends a lane dials only
# LONG_PATH_STRIPES: tests/test_p2p_lane_congestion.py)
STRIPED = {"lane_stripes": 4, "lane_stripe_min_rtt": 0.0, "lane_congestion": None}


@pytest.mark.trio
async def test_a_striped_bulk_call_between_two_hosts_moves_the_right_bytes():
    async with (
        P2P.create(**STRIPED) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), **STRIPED) as b,
    ):
        a.add_protobuf_handler("t::S.digest", digest, BytesValue, stream_input=True)
        chunks = [os.urandom(700_001) for _ in range(6)]
        for _ in range(2):  # the second call reuses the striped lane
            assert await bulk_digest(b, a.peer_id, chunks) == expected_digest(chunks)
        stats_b, stats_a = b.statistics(), a.statistics()
        assert stats_b["lanes_opened"] == stats_b["striped_lanes_opened"] == 1, stats_b
        assert stats_a["striped_lanes_accepted"] == 1, stats_a
        assert a.lanes.open_lanes.count(b.peer_id) == 4  # each stripe counts as a lane
        (idle, _), *_ = b._bulk_pool._idle[a.peer_id]
        assert isinstance(idle.stream, StripedLane) and len(idle.stream.stripes) == 4
        assert idle.stream.bytes_on_wire > 2 * sum(map(len, chunks))
        assert tcp_rtt(idle.stream.stripes[0].raw) is not None


@pytest.mark.trio
async def test_short_paths_and_full_callees_get_one_connection():
    # the default threshold: loopback is far below it
    async with (
        P2P.create() as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), lane_stripes=4) as b,
    ):
        a.add_protobuf_handler("t::S.digest", digest, BytesValue, stream_input=True)
        chunks = [b"q" * 300_000]
        assert await bulk_digest(b, a.peer_id, chunks) == expected_digest(chunks)
        assert b.statistics()["lanes_opened"] == 1 and b.statistics()["striped_lanes_opened"] == 0
        assert a.lanes.open_lanes.count(b.peer_id) == 1 and len(a.lanes.tickets) == 0
    # a callee with room for one lane of this peer grants one stripe: a plain lane
    async with (
        P2P.create(limits=ResourceLimits(max_lanes_per_peer=1)) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), **STRIPED) as b,
    ):
        a.add_protobuf_handler("t::S.digest", digest, BytesValue, stream_input=True)
        assert await bulk_digest(b, a.peer_id, chunks) == expected_digest(chunks)
        assert b.statistics()["lanes_opened"] == 1 and b.statistics()["striped_lanes_opened"] == 0


@pytest.mark.trio
async def test_a_peer_opening_stripes_it_was_not_granted_is_refused():
    limits = ResourceLimits(max_lanes_per_peer=6)
    async with (
        P2P.create(use_autonat=False, limits=limits, **STRIPED) as victim,
        P2P.create(initial_peers=victim.get_visible_maddrs(), **STRIPED) as attacker,
        P2P.create(initial_peers=victim.get_visible_maddrs(), **STRIPED) as honest,
    ):
        victim.add_protobuf_handler("t::S.digest", digest, BytesValue, stream_input=True)
        victim.lanes.tickets.ttl = 3.0  # how long a striped lane waits for its stripes

        async def ticket(stripes: int):
            return await attacker.call_protobuf_handler(
                victim.peer_id,
                TICKET_METHOD,
                p2p_pb2.LaneTicketRequest(version=1, stripes=stripes),
                p2p_pb2.LaneTicket,
            )

        first = await ticket(16)
        assert first.stripes == 3  # half its per-peer share: one lane never takes all of it
        assert (await ticket(16)).stripes == 3  # the rest of its room
        with pytest.raises(ResourceLimitError):
            await ticket(16)  # both tickets' slots are still held
        port = victim.lanes.port

        async def stripe(ticket_id: bytes, index: int, count: int) -> trio.SocketStream:
            conn = await trio.open_tcp_stream("127.0.0.1", port)
            await conn.send_all(ticket_id + bytes([index, count]))
            return conn

        # more stripes than granted, an index past the count, an index shown twice
        over = await stripe(first.ticket_id, 0, 7)
        assert await _closed_by_peer(over)
        taken = await stripe(first.ticket_id, 0, 2)
        assert len(await taken.receive_some(4)) > 0  # accepted: the accept record's header
        past = await stripe(first.ticket_id, 2, 2)
        again = await stripe(first.ticket_id, 0, 2)
        for conn in (past, again):
            assert await _closed_by_peer(conn)
        # the attacker's half-formed lane is dropped after the ticket's lifetime; meanwhile
        # an honest peer's striped call completes
        chunks = [os.urandom(400_000) for _ in range(3)]
        with trio.fail_after(30):
            assert await bulk_digest(honest, victim.peer_id, chunks) == expected_digest(chunks)
        assert honest.statistics()["striped_lanes_opened"] == 1
        assert await _closed_by_peer(taken)  # its stripe 1 never came (within the TTL)
        assert victim.lanes.open_lanes.count(attacker.peer_id) == 0
        for conn in (over, taken, past, again):
            await conn.aclose()
