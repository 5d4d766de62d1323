"""AllReduceTrace: a traced round between real py-libp2p hosts on loopback records every part
and delta of every peer; the trace's buffer is bounded."""

import pytest
import trio

from swarmtrain.averaging import AllReduceConfig, AllReduceGroup, AllReduceRunner
from swarmtrain.averaging.allreduce_trace import AllReduceTrace
from tests.test_averaging_allreduce import random_tensors, run_all, swarm

pytestmark = pytest.mark.trio

CONFIG = AllReduceConfig(
    part_size_bytes=16 * 1024, sender_timeout=5.0, reducer_timeout=10.0, allreduce_timeout=30.0
)


async def test_traced_round_records_every_part_and_delta():
    tensors = random_tensors(3, seed=3)
    async with swarm(3) as (hosts, services):
        traces = []
        for service in services:
            service.trace = AllReduceTrace()
            traces.append(service.trace)
        group = AllReduceGroup(b"traced", tuple(h.peer_id for h in hosts), (1.0, 1.0, 1.0))
        runners = [AllReduceRunner(services[i], group, tensors[i], config=CONFIG) for i in range(3)]
        with trio.fail_after(30):
            results = await run_all(runners)
    assert all(r.complete for r in results)
    for me, (runner, trace) in enumerate(zip(runners, traces, strict=True)):
        events = trace.take()
        assert trace.events == [] and trace.dropped == 0
        kinds = [e.kind for e in events]
        assert kinds[0] == "round_began" and kinds[-1] == "round_ended"
        assert {e.group for e in events} == {b"traced".hex()}
        core = runner.core
        for kind, owner in (
            ("part_queued", "reducer"),
            ("part_written", "reducer"),
            ("delta_received", "reducer"),
            ("part_received", "sender"),
            ("delta_queued", "sender"),
            ("delta_written", "sender"),
        ):
            for other in (i for i in range(3) if i != me):
                parts = [e.part for e in events if e.kind == kind and e.peer == other]
                # as a sender: every part of the other's slice; as a reducer: every part of ours
                count = core.num_parts_for(other) if owner == "reducer" else core.num_local_parts
                assert parts == list(range(count)), (me, kind, other)
        reduced = [e.part for e in events if e.kind == "part_reduced"]
        assert sorted(reduced) == list(range(core.num_local_parts))
        assert all(e.peer == me for e in events if e.kind == "part_reduced")
        written = [e for e in events if e.kind == "part_written"]
        assert all(e.nbytes > 0 for e in written)
        stamps = [e.time for e in events]
        assert stamps == sorted(stamps)


async def test_trace_is_bounded():
    trace = AllReduceTrace(max_events=3)
    for k in range(5):
        trace.record(b"g", "part_queued", 1, k, 10)
    assert [e.part for e in trace.events] == [0, 1, 2] and trace.dropped == 2
    first = trace.take()[0].as_dict()
    assert first.pop("time") > 0
    assert first == {"group": b"g".hex(), "kind": "part_queued", "peer": 1, "part": 0, "nbytes": 10}
    assert trace.events == []
