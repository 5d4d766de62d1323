"""How long bulk calls wait for data lanes and how long idle lanes are reused: the rules
(``lane_books.lane_reuse_time``, ``first_lane_wait``) and their wiring between real hosts on
loopback (``KNOWN_PEER_WAIT``, the first lane's wait, ``lane_pool.BulkStreamPool``)."""

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value

from swarmtrain.p2p import P2P, lane_caller
from swarmtrain.p2p import lane as lane_module
from swarmtrain.p2p.autonat import connection_path, connection_rtt
from swarmtrain.p2p.lane import TICKET_METHOD
from swarmtrain.p2p.lane_books import (
    LANE_IDLE_TIMEOUT,
    LANE_REUSE_MARGIN,
    MAX_LANE_IDLE_TIMEOUT,
    first_lane_wait,
    lane_reuse_time,
    lane_reuse_window,
)
from swarmtrain.p2p.lane_pool import LANE_REUSE_LIMIT
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME, SERVER_STREAM_IDLE_TIMEOUT
from swarmtrain.p2p.tcp_info import MIN_SEGMENTS_FOR_LOSS, tcp_loss
from swarmtrain.proto import p2p_pb2

BASE, CALLEE_IDLE = CALLER_STREAM_REUSE_TIME, SERVER_STREAM_IDLE_TIMEOUT

# ------------------------------------------------------------------ the rules (sans-IO)


def test_a_lane_quick_to_open_is_reused_as_long_as_any_stream():
    assert lane_reuse_time(0.002, 0.0001, BASE, CALLEE_IDLE) == pytest.approx(BASE + 0.02)
    assert lane_reuse_time(0.0, 0.0, BASE, CALLEE_IDLE) == BASE


def test_a_lane_slow_to_open_outlives_a_slow_round_but_not_the_callee():
    # 300 ms RTT, 1.5 s to open (ticket, dials, handshakes of its stripes)
    reuse = lane_reuse_time(1.5, 0.3, BASE, CALLEE_IDLE)
    assert reuse == pytest.approx(CALLEE_IDLE - LANE_REUSE_MARGIN - 0.6)
    assert BASE < reuse < CALLEE_IDLE
    assert lane_reuse_time(0.6, 0.3, BASE, CALLEE_IDLE) == pytest.approx(BASE + 6.0)
    # never past what the callee keeps, whatever the lane cost; never below the base
    for open_seconds in (0.0, 0.5, 5.0, 500.0):
        for rtt in (0.0, 0.3, 2.0, 20.0):
            reuse = lane_reuse_time(open_seconds, rtt, BASE, CALLEE_IDLE)
            assert reuse >= BASE
            assert reuse == BASE or reuse <= CALLEE_IDLE - LANE_REUSE_MARGIN - 2 * rtt


def test_a_lane_the_callee_keeps_for_minutes_is_reused_until_just_before_it_closes():
    granted = LANE_IDLE_TIMEOUT  # the ticket's idle_timeout
    assert lane_reuse_time(0.002, 0.0001, BASE, CALLEE_IDLE, granted) == pytest.approx(
        granted - LANE_REUSE_MARGIN - 0.0002
    )
    assert lane_reuse_time(1.5, 0.3, BASE, CALLEE_IDLE, granted) == pytest.approx(
        granted - LANE_REUSE_MARGIN - 0.6
    )
    assert lane_reuse_window(granted) == granted - LANE_REUSE_MARGIN  # what the callee counts
    # a short grant is a hard limit, below the base too; never negative
    assert lane_reuse_time(0.0, 0.0, BASE, CALLEE_IDLE, 3.0) == pytest.approx(1.0)
    assert lane_reuse_time(0.0, 0.3, BASE, CALLEE_IDLE, 1.0) == 0.0
    # an older callee grants nothing: the old rule, below its 30 s
    for open_seconds, rtt in ((0.002, 0.0001), (1.5, 0.3), (500.0, 2.0)):
        old_rule = lane_reuse_time(open_seconds, rtt, BASE, CALLEE_IDLE)
        assert lane_reuse_time(open_seconds, rtt, BASE, CALLEE_IDLE, None) == old_rule
        assert old_rule < CALLEE_IDLE
    # the pool keeps a lane as long as any ticket may grant
    assert LANE_REUSE_LIMIT >= MAX_LANE_IDLE_TIMEOUT >= LANE_IDLE_TIMEOUT > CALLEE_IDLE


def test_a_first_lane_waits_longer_on_a_long_path_within_the_limit():
    assert first_lane_wait(None, 0.5, 6.0) == 0.5  # unknown path: the short wait
    assert first_lane_wait(0.0001, 0.5, 6.0) == pytest.approx(0.5024)  # loopback / LAN
    assert first_lane_wait(0.3, 0.5, 6.0) == pytest.approx(0.5 + 1.2 + 1.0)  # 150 ms each way
    assert first_lane_wait(0.05, 0.5, 6.0) == pytest.approx(0.5 + 0.2 + 1.0)
    assert first_lane_wait(5.0, 0.5, 6.0) == 6.0
    assert first_lane_wait(0.3, 0.5, 1.0) == 1.0


# ------------------------------------------------------------------ wiring (real hosts)

TICKET_DELAY = 1.0  # the callee answers ticket calls this late (a slow path)


async def total_size(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


def serve(p2p):
    p2p.add_protobuf_handler("t::W.total_size", total_size, BytesValue, stream_input=True)


def slow_tickets(p2p):
    """``p2p`` answers ticket calls ``TICKET_DELAY`` s late, as over a long lossy path."""
    issue = p2p.lanes._issue_ticket

    async def slow_ticket(request, context):
        await trio.sleep(TICKET_DELAY)
        return await issue(request, context)

    p2p.add_protobuf_handler(TICKET_METHOD, slow_ticket, p2p_pb2.LaneTicketRequest, replace=True)


async def bulk_call(caller, callee) -> None:
    reply = await caller.call_protobuf_handler(
        callee.peer_id,
        "t::W.total_size",
        [BytesValue(value=b"w" * 200_000)],
        Int64Value,
        stream_input=True,
        bulk=True,
    )
    assert reply.value == 200_000


def lane_bytes(p2p, peer) -> int:
    idle = [s.stream for s, _ in p2p._bulk_pool._idle.get(peer, [])]
    return sum(s.bytes_on_wire for s in idle if isinstance(s, lane_module.LaneStream))


@pytest.mark.trio
async def test_the_libp2p_connection_reports_its_kernel_rtt_and_loss():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        await bulk_call(b, a)  # the ticket call: segments on the libp2p connection
        rtt = connection_rtt(b, a.peer_id)
        assert rtt is not None and 0 < rtt < 1.0
        path = connection_path(b, a.peer_id)
        assert path is not None and path[0] == rtt
        assert path[1] is None or 0 < path[1] <= 1 / MIN_SEGMENTS_FOR_LOSS  # none lost
        assert connection_path(b, b.peer_id) is None  # no connection to ourselves


@pytest.mark.trio
async def test_a_call_to_a_known_peer_waits_for_its_next_lane(monkeypatch):
    monkeypatch.setattr(lane_caller, "OPEN_WAIT", 0.05)  # a stranger's call would not wait
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        await bulk_call(b, a)  # the first lane (fast ticket)
        assert b.statistics()["lanes_opened"] == 1
        await b._bulk_pool.aclose()  # its lane is gone: the next call needs a new one
        slow_tickets(a)
        await bulk_call(b, a)  # waits up to KNOWN_PEER_WAIT: past the slow ticket
        stats = b.statistics()
        assert stats["lanes_opened"] == 2 and stats["lane_fallbacks"] == 0, stats
        assert lane_bytes(b, a.peer_id) > 200_000  # the call went over the new lane


@pytest.mark.trio
async def test_without_the_known_peer_wait_the_call_goes_over_libp2p(monkeypatch):
    monkeypatch.setattr(lane_caller, "OPEN_WAIT", 0.05)
    monkeypatch.setattr(lane_caller, "KNOWN_PEER_WAIT", 0.05)
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        await bulk_call(b, a)
        await b._bulk_pool.aclose()
        slow_tickets(a)
        await bulk_call(b, a)
        assert lane_bytes(b, a.peer_id) == 0  # over libp2p: the lane came too late


@pytest.mark.trio
async def test_a_first_lane_waits_as_long_as_its_path_needs(monkeypatch):
    monkeypatch.setattr(lane_caller, "OPEN_WAIT", 0.05)
    seen_rtts = []

    def long_path_wait(path_rtt, open_wait, limit):
        seen_rtts.append(path_rtt)
        return 3 * TICKET_DELAY  # what first_lane_wait gives a long path

    monkeypatch.setattr(lane_caller, "first_lane_wait", long_path_wait)
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        serve(a)
        slow_tickets(a)
        await bulk_call(b, a)
        stats = b.statistics()
        assert stats["lanes_opened"] == 1 and stats["lane_fallbacks"] == 0, stats
        assert lane_bytes(b, a.peer_id) > 200_000
        assert len(seen_rtts) == 1 and seen_rtts[0] is not None and seen_rtts[0] > 0


IDLE_GAP = 1.0  # a caller's pause between calls: longer than the default reuse time below


@pytest.mark.trio
async def test_a_lane_is_reused_for_its_own_time_and_a_libp2p_stream_is_not(monkeypatch):
    monkeypatch.setattr(lane_caller, "lane_reuse_time", lambda *args: 3 * IDLE_GAP)
    async with (
        P2P.create() as a,
        P2P.create(use_data_lanes=False) as c,
        P2P.create(initial_peers=a.get_visible_maddrs() + c.get_visible_maddrs()) as b,
    ):
        serve(a)
        serve(c)
        b._bulk_pool.default_reuse_time = IDLE_GAP / 2
        await bulk_call(b, a)
        await bulk_call(b, c)  # over libp2p: c offers no lanes
        opened = b._bulk_pool.streams_opened
        await trio.sleep(IDLE_GAP)  # the idle gap under test
        await bulk_call(b, a)  # the lane, idle past the default, is reused
        assert b._bulk_pool.streams_opened == opened
        assert b.statistics()["lanes_opened"] == 1
        await bulk_call(b, c)  # the libp2p stream is not: a new one
        assert b._bulk_pool.streams_opened == opened + 1


def test_a_socket_that_sent_enough_reports_its_retransmitted_share():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            conn, _ = server.accept()
            with conn:
                assert tcp_loss(client) is None  # too few segments to say
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(2 * MIN_SEGMENTS_FOR_LOSS):
                    client.sendall(b"x" * 100)
                    conn.recv(100, socket.MSG_WAITALL)
                loss = tcp_loss(client)  # loopback loses nothing: at most one in n
                assert loss is not None and 0 < loss <= 1 / (2 * MIN_SEGMENTS_FOR_LOSS)
