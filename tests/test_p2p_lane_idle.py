"""How long idle data lanes live, between real hosts on loopback: the callee's own idle timeout
for lanes (``LaneTicket.idle_timeout``; older peers keep the 30 s of any stream), the caller
reusing a lane for it, and a lane its callee takes for a newcomer while the caller reuses it
(``RPCErrorCode.NOT_SERVED``: the call is sent again over another stream; the callee closes
the lane only after its caller, so no reset drops the answer). Timeouts are scaled down:
what is under test is an idle time, so the tests sleep through it."""

import os
import socket

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value
from polling import wait_until

from swarmtrain.p2p import P2P, CallNotServedError, ResourceLimits, lane_caller
from swarmtrain.p2p import lane as lane_module
from swarmtrain.p2p import rpc as rpc_module
from swarmtrain.p2p.errors import LaneEndOfStream, LaneResetError
from swarmtrain.p2p.lane import TICKET_METHOD
from swarmtrain.p2p.lane_books import LANE_REUSE_MARGIN, lane_reuse_time
from swarmtrain.p2p.lane_records import RecordOpener, RecordSealer
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME, SERVER_STREAM_IDLE_TIMEOUT
from swarmtrain.proto import p2p_pb2

PAYLOAD = 200_000
STREAM_IDLE = 1.0  # the callee's idle timeout of libp2p streams (30 s by default)
OLD_REUSE = 0.5  # what callers reuse any stream for (15 s by default)
LANE_IDLE = 5.0  # the callee's idle timeout of lanes (240 s by default)
IDLE_GAP = 2.0  # a pause between rounds: past STREAM_IDLE and OLD_REUSE, within LANE_IDLE


class Callee:
    """A host serving a stream-input call (unary and streamed answers), counting the calls
    its handlers saw."""

    def __init__(self, p2p: P2P):
        self.p2p, self.calls = p2p, 0
        p2p.add_protobuf_handler("t::I.total", self.total, BytesValue, stream_input=True)
        p2p.add_protobuf_handler(
            "t::I.echo_sizes", self.echo_sizes, BytesValue, stream_input=True, stream_output=True
        )

    async def total(self, requests, context) -> Int64Value:
        self.calls += 1
        total = 0
        async for request in requests:
            total += len(request.value)
        return Int64Value(value=total)

    async def echo_sizes(self, requests, context):
        self.calls += 1
        async for request in requests:
            yield Int64Value(value=len(request.value))


async def unary_bulk_call(caller: P2P, callee: P2P) -> None:
    reply = await caller.call_protobuf_handler(
        callee.peer_id,
        "t::I.total",
        [BytesValue(value=b"u" * PAYLOAD)],
        Int64Value,
        stream_input=True,
        bulk=True,
    )
    assert reply.value == PAYLOAD


async def streamed_bulk_call(caller: P2P, callee: P2P, parts: int = 3) -> list[int]:
    """A call shaped like the all-reduce's: requests from a generator, answers streamed."""

    async def requests():
        for _ in range(parts):
            yield BytesValue(value=b"s" * PAYLOAD)

    async with caller.iterate_protobuf_handler(
        callee.peer_id,
        "t::I.echo_sizes",
        requests(),
        Int64Value,
        stream_input=True,
        next_message_timeout=10.0,
        bulk=True,
    ) as responses:
        return [response.value async for response in responses]


def scale_down_stream_timeouts(monkeypatch) -> None:
    """libp2p streams idle out after STREAM_IDLE at the callee and callers keep any stream
    for OLD_REUSE (what an older callee's lanes get: ``lane_reuse_time``'s old rule)."""
    monkeypatch.setattr(rpc_module, "SERVER_STREAM_IDLE_TIMEOUT", STREAM_IDLE)
    monkeypatch.setattr(lane_caller, "SERVER_STREAM_IDLE_TIMEOUT", STREAM_IDLE)
    monkeypatch.setattr(lane_caller, "CALLER_STREAM_REUSE_TIME", OLD_REUSE)


def idle_lanes(p2p: P2P, peer) -> list:
    return [
        s.stream
        for s, _ in p2p._bulk_pool._idle.get(peer, [])
        if isinstance(s.stream, (lane_module.LaneStream, lane_module.StripedLane))
    ]


# ------------------------------------------------------------------ the lanes' own idle timeout


@pytest.mark.trio
async def test_a_lane_idle_past_the_stream_idle_timeout_is_reused(monkeypatch):
    scale_down_stream_timeouts(monkeypatch)
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        callee = Callee(a)
        a.lanes.idle_timeout = LANE_IDLE
        await unary_bulk_call(b, callee.p2p)
        (lane,) = idle_lanes(b, a.peer_id)
        assert (
            LANE_IDLE - LANE_REUSE_MARGIN - 0.1 < lane.reuse_time <= LANE_IDLE - LANE_REUSE_MARGIN
        )
        await trio.sleep(IDLE_GAP)  # the idle time under test
        assert a.statistics()["lanes_open"] == 1  # the callee kept it past STREAM_IDLE
        assert await streamed_bulk_call(b, a) == [PAYLOAD] * 3
        stats = b.statistics()
        assert stats["lanes_opened"] == 1 and stats["lane_fallbacks"] == 0, stats
        assert b._bulk_pool.streams_reused == 1
        assert a.statistics()["lanes_accepted"] == 1 and callee.calls == 2


@pytest.mark.trio
async def test_the_callees_idle_timeout_closes_a_lane_and_the_next_call_opens_a_new_one(
    monkeypatch,
):
    # a caller that would reuse its lane past the callee's timeout (its own clock is slow)
    monkeypatch.setattr(lane_caller, "lane_reuse_time", lambda *args: 10 * IDLE_GAP)
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        callee = Callee(a)
        a.lanes.idle_timeout = IDLE_GAP / 2
        await unary_bulk_call(b, a)
        assert len(idle_lanes(b, a.peer_id)) == 1 and a.statistics()["lanes_open"] == 1
        with trio.fail_after(10):  # the callee ends the idle lane by itself
            await wait_until(lambda: a.statistics()["lanes_open"] == 0)
        await streamed_bulk_call(b, a)  # not on the closed lane: on a new one
        stats = b.statistics()
        assert stats["lanes_opened"] == 2 and stats["lane_fallbacks"] == 0, stats
        assert b._bulk_pool.streams_reused == 0
        assert a.statistics()["lanes_accepted"] == 2 and callee.calls == 2


@pytest.mark.trio
async def test_older_peers_keep_the_old_idle_times(monkeypatch):
    scale_down_stream_timeouts(monkeypatch)
    async with (
        P2P.create() as old_callee,
        P2P.create() as new_callee,
        P2P.create(
            initial_peers=old_callee.get_visible_maddrs() + new_callee.get_visible_maddrs()
        ) as b,
    ):
        Callee(old_callee)
        Callee(new_callee)
        issue = old_callee.lanes._issue_ticket

        async def ticket_of_an_older_callee(request, context):
            ticket = await issue(request, context)
            ticket.ClearField("idle_timeout")  # it knows no such field: it sends none
            return ticket

        old_callee.add_protobuf_handler(
            TICKET_METHOD, ticket_of_an_older_callee, p2p_pb2.LaneTicketRequest, replace=True
        )
        # a caller to an older callee keeps the old rule (below its 30 s, here STREAM_IDLE)
        await unary_bulk_call(b, old_callee)
        (lane,) = idle_lanes(b, old_callee.peer_id)
        assert lane.reuse_time == OLD_REUSE
        assert lane.reuse_time == lane_reuse_time(0.0, 0.0, OLD_REUSE, STREAM_IDLE)
        # an older caller (it asks for no idle timeout): the callee keeps the stream timeout
        b.lanes.idle_timeout = 0.0
        await unary_bulk_call(b, new_callee)
        with trio.fail_after(10):
            await wait_until(lambda: new_callee.statistics()["lanes_open"] == 0)
        assert new_callee.statistics()["lanes_accepted"] == 1


def test_the_default_lane_idle_timeout_outlasts_the_stream_one():
    assert lane_module.LANE_IDLE_TIMEOUT > SERVER_STREAM_IDLE_TIMEOUT > CALLER_STREAM_REUSE_TIME
    assert lane_module.STALE_LANE_AFTER < lane_module.LANE_IDLE_TIMEOUT


# ------------------------------------------------------------------ lanes taken while reused

STALE_AFTER = 0.2  # the callee's idle time before a lane may be taken (16 s by default)


def take_idle_lanes_for_a_newcomer(callee: P2P) -> object:
    """What the callee's lane book does when a newcomer's lane arrives on a full host: count
    it and cancel the lanes it takes (their tasks close them). The newcomer's token."""
    newcomer = trio.CancelScope()
    taken = callee.lanes.open_lanes.admit(newcomer, "newcomer", trio.current_time())
    assert len(taken) == 1
    for token in taken:
        token.cancel()
    return newcomer


@pytest.mark.trio
@pytest.mark.parametrize("call", ["streamed", "unary", "striped"])
async def test_a_lane_taken_just_as_its_caller_reuses_it_sends_the_call_again(call):
    stripes = 2 if call == "striped" else 1  # a striped lane: two connections on loopback
    limits = ResourceLimits(max_lanes_total=stripes)
    async with (
        P2P.create(limits=limits) as a,
        P2P.create(
            initial_peers=a.get_visible_maddrs(), lane_stripes=stripes, lane_stripe_min_rtt=0.0
        ) as b,
    ):
        callee = Callee(a)
        a.lanes.open_lanes.stale_after = STALE_AFTER
        await unary_bulk_call(b, a)
        assert len(idle_lanes(b, a.peer_id)) == 1
        await trio.sleep(STALE_AFTER + 0.1)  # the idle time under test
        newcomer = take_idle_lanes_for_a_newcomer(a)
        # the caller reuses its lane before the callee's task saw it was taken
        if call != "unary":
            with pytest.raises(CallNotServedError):
                await streamed_bulk_call(b, a)  # a stream input cannot be sent again here
            assert await streamed_bulk_call(b, a) == [PAYLOAD] * 3  # the caller sends it again
        else:
            await unary_bulk_call(b, a)  # sent again inside the call
        assert b._bulk_pool.streams_reused == 1
        assert callee.calls == 2  # the call on the taken lane never reached a handler
        stats = b.statistics()
        assert stats["striped_lanes_opened"] == (1 if call == "striped" else 0), stats
        if call != "striped":  # (a striped lane's other stripe may not be closed yet)
            # the call went again over libp2p: the callee is full (the newcomer's is fresh)
            assert stats["lanes_opened"] == 1 and stats["lane_fallbacks"] == 1, stats
        a.lanes.open_lanes.done(newcomer)


@pytest.mark.trio
async def test_a_newcomer_takes_the_idle_lane_and_its_caller_goes_on_without_it():
    limits = ResourceLimits(max_lanes_total=1)
    async with (
        P2P.create(limits=limits) as a,
        P2P.create(initial_peers=a.get_visible_maddrs()) as b,
        P2P.create(initial_peers=a.get_visible_maddrs()) as c,
    ):
        callee = Callee(a)
        a.lanes.open_lanes.stale_after = STALE_AFTER
        await unary_bulk_call(b, a)
        (b_lane,) = idle_lanes(b, a.peer_id)
        await trio.sleep(STALE_AFTER + 0.1)  # the idle time under test
        await unary_bulk_call(c, a)  # c's new lane takes b's idle one
        assert c.statistics()["lanes_opened"] == 1
        assert a.lanes.open_lanes.evicted == 1
        with trio.fail_after(10):  # b's lane says it was taken: b will not reuse it
            await wait_until(lambda: not b_lane.is_reusable())
        assert await streamed_bulk_call(b, a) == [PAYLOAD] * 3
        assert b._bulk_pool.streams_reused == 0
        assert callee.calls == 3


# ------------------------------------------------------------------ closing after the peer


def lane_pair() -> tuple[lane_module.LaneStream, lane_module.LaneStream]:
    """Two ends of a lane over a loopback TCP connection (caller, callee)."""
    to_callee, to_caller = os.urandom(32), os.urandom(32)
    with socket.create_server(("127.0.0.1", 0)) as server:
        raw_caller = socket.create_connection(server.getsockname())
        raw_callee, _ = server.accept()
    ends = []
    for raw, sealer, opener in (
        (raw_caller, to_callee, to_caller),
        (raw_callee, to_caller, to_callee),
    ):
        raw.setblocking(False)
        sock = trio.socket.from_stdlib_socket(raw)
        ends.append(lane_module.LaneStream(raw, sock, RecordSealer(sealer), RecordOpener(opener)))
    return ends[0], ends[1]


@pytest.mark.trio
@pytest.mark.parametrize("closing", ["after_peer", "at_once"])
async def test_an_answer_on_a_lane_closed_unread_arrives_and_the_caller_is_not_reset(closing):
    caller, callee = lane_pair()
    seen: dict = {"sent": 0}

    async def caller_side() -> None:
        try:
            for _ in range(16):  # 16 MiB: more than the sockets' buffers hold
                await caller.write(b"c" * (1 << 20))
                seen["sent"] += 1
        except LaneResetError:
            seen["write"] = "reset"
        seen["answer"] = await caller.read()
        try:
            await caller.read()
        except LaneEndOfStream:
            seen["end"] = "clean"
        except LaneResetError:
            seen["end"] = "reset"
        await caller.close()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller_side)
            with trio.fail_after(10):
                await wait_until(lambda: seen["sent"] >= 1)
            await callee.write(b"not served")  # the callee read none of the call
            if closing == "after_peer":
                with trio.fail_after(10):
                    await callee.close_after_peer(linger=30.0)  # ends when the caller closes
            else:
                await callee.reset()  # (how a taken lane was closed before)
    finally:
        await caller.reset()
        await callee.reset()
    assert seen["answer"] == b"not served"
    if closing == "after_peer":
        assert seen == {"sent": 16, "answer": b"not served", "end": "clean"}
    else:  # closing with the call unread resets the connection: the caller's writes fail
        assert seen["write"] == "reset" and seen["end"] == "reset" and seen["sent"] < 16
