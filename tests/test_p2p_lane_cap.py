"""The host-wide cap on data lanes (``ResourceLimits.max_lanes_total``, security audit 7)
against an attacker with several free identities, each opening all the lanes it may: the
victim runs in a process of its own and its open file descriptors are counted."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value
from polling import wait_until

from swarmtrain.p2p import P2P, ResourceLimitError, ResourceLimits
from swarmtrain.p2p.framing import FrameKind
from swarmtrain.p2p.rpc_stream import RPCStream

MiB = 1024 * 1024
LANES_TOTAL, LANES_PER_PEER, IDENTITIES = 16, 8, 6
STALE_AFTER = 1.0  # the victim's idle time before a lane may be taken (16 s by default)


async def _total_size(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


async def _victim_main() -> None:
    limits = ResourceLimits(max_lanes_total=LANES_TOTAL, max_lanes_per_peer=LANES_PER_PEER)
    async with P2P.create(use_autonat=False, limits=limits) as victim:
        victim.add_protobuf_handler("t::C.total_size", _total_size, BytesValue, stream_input=True)
        victim.lanes.open_lanes.stale_after = STALE_AFTER
        print(json.dumps({"maddrs": victim.get_visible_maddrs()}), flush=True)
        while await trio.to_thread.run_sync(sys.stdin.readline):  # until the test closes stdin
            book = victim.lanes.open_lanes
            stats = {"open": len(book), "evicted": book.evicted, "refused": book.refused}
            print(json.dumps(stats), flush=True)


class _Victim:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--victim"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    async def line(self) -> dict:
        with trio.fail_after(60):
            return json.loads(await trio.to_thread.run_sync(self.process.stdout.readline))

    async def stats(self) -> dict:
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return await self.line()

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


async def _bulk_call(p2p: P2P, victim_id) -> None:
    reply = await p2p.call_protobuf_handler(
        victim_id,
        "t::C.total_size",
        [BytesValue(value=b"z" * MiB)] * 2,
        Int64Value,
        stream_input=True,
        bulk=True,
    )
    assert reply.value == 2 * MiB


@pytest.mark.trio
async def test_many_identities_cannot_take_more_lanes_than_the_host_cap():
    victim = _Victim()
    try:
        maddrs = (await victim.line())["maddrs"]
        victim_id = maddrs[0].split("/p2p/")[-1]
        async with contextlib.AsyncExitStack() as stack:
            attackers = [
                await stack.enter_async_context(P2P.create(initial_peers=maddrs, use_autonat=False))
                for _ in range(IDENTITIES)
            ]
            honest = [
                await stack.enter_async_context(P2P.create(initial_peers=maddrs, use_autonat=False))
                for _ in range(2)
            ]
            fds_before = victim.open_fds()  # (every host is connected to the victim)

            calls: list[RPCStream] = []
            try:
                # 1. each identity opens every lane it may and keeps it busy with a call that
                # never ends (a stream-input call with one message sent)
                refusals = []
                for attacker in attackers:
                    for _ in range(LANES_PER_PEER):
                        try:
                            lane = await attacker.lanes._open(victim_id, "127.0.0.1")
                        except ResourceLimitError as e:
                            refusals.append(str(e))
                            break
                        call = RPCStream(lane, MiB)
                        await call.send_open("t::C.total_size")
                        await call.send_message(BytesValue(value=b"x").SerializeToString())
                        calls.append(call)
                assert len(calls) == LANES_TOTAL  # not IDENTITIES x LANES_PER_PEER = 48
                assert len(refusals) == IDENTITIES - LANES_TOTAL // LANES_PER_PEER
                assert all("data lanes are all in use (16 of 16 in all" in e for e in refusals)
                grown = victim.open_fds() - fds_before
                assert LANES_TOTAL <= grown <= LANES_TOTAL + 4, f"the victim holds {grown} more fds"

                # 2. an honest bulk call goes over libp2p meanwhile (the lanes are all busy)
                await _bulk_call(honest[0], victim_id)
                stats = honest[0].statistics()
                assert stats["lanes_opened"] == 0 and stats["lane_fallbacks"] == 1

                # 3. the attacker's calls end; once its lanes sat idle for STALE_AFTER, a new
                # honest lane takes the place of one of them
                for call in calls:
                    await call.send_end()
                    assert (await call.receive_frame()).kind == FrameKind.MESSAGE
                    assert (await call.receive_frame()).kind == FrameKind.END
                ended = []
                async with trio.open_nursery() as nursery:

                    async def watch(call: RPCStream) -> None:
                        with contextlib.suppress(Exception):
                            await call.receive_frame()
                        ended.append(call)

                    for call in calls:
                        nursery.start_soon(watch, call)
                    await trio.sleep(STALE_AFTER + 0.5)  # the policy under test is an idle time
                    await _bulk_call(honest[1], victim_id)
                    stats = honest[1].statistics()
                    assert stats["lanes_opened"] == 1 and stats["lane_fallbacks"] == 0
                    with trio.fail_after(10):
                        await wait_until(lambda: ended)
                    assert len(ended) == 1  # exactly one attacker lane was closed for it
                    # refused: the 4 identities without a lane and the honest peer in step 2
                    assert await victim.stats() == {"open": LANES_TOTAL, "evicted": 1, "refused": 5}
                    nursery.cancel_scope.cancel()
            finally:
                for call in calls:
                    call.stream.reset_now()
    finally:
        victim.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--victim"]:
    trio.run(_victim_main)
