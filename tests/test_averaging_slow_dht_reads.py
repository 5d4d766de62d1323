"""Real averagers on loopback whose DHT reads take longer than a matchmaking window.

Every DHT node of the swarm answers find requests late, by design (a node on a loaded machine:
reads of 1.4-1.7 s were seen at load >= 12 with 1 s windows). Declarations stay readable
``declaration_linger`` past their expiration, so a read still brings the peers that were
looking when it began (docs/protocols/matchmaking.md); before, every record had expired by the
time a read returned and nobody formed a group.
"""

from __future__ import annotations

import pytest
import torch
import trio
from test_averaging_averager import FAST, Swarm, local, random_tensors, step_all

from swarmtrain.proto import dht_pb2

#: each find RPC answers this late (below the DHT's wait_timeout of 3 s)
FIND_DELAY = 1.2


def answer_finds_late(dht, seconds: float) -> None:
    """Serve ``dht``'s find RPC ``seconds`` late: the same node, replying slowly."""
    protocol = dht.node.protocol

    async def late_find(request, context):
        await trio.sleep(seconds)  # the slowness under test, not a wait for another task
        return await protocol.rpc_find(request, context)

    dht.p2p.add_protobuf_handler(
        protocol.method_name("rpc_find"),
        late_find,
        dht_pb2.DHTFindRequest,
        max_message_size=protocol.limits.max_message_size,
        replace=True,
    )


@pytest.mark.trio
async def test_averagers_whose_dht_reads_outlast_a_window_still_average():
    tensors = [random_tensors(i) for i in range(3)]
    want = [sum(tensors[i][t] for i in range(3)) / 3 for t in range(len(tensors[0]))]
    group = {"target_group_size": 3, "min_group_size": 3}
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, prefix="slowreads")
        averagers = [
            await swarm.add([t.clone() for t in tensors[i]], **FAST, **group) for i in range(3)
        ]
        for averager in averagers:
            answer_finds_late(averager.dht, FIND_DELAY)
        results = await step_all(averagers, timeout=[20] * 3)
        assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
        for averager in averagers:
            for got, expected in zip(local(averager), want, strict=True):
                torch.testing.assert_close(got, expected)
        # every read of the group key took longer than a declaration's window
        reads = [a._matchmaking.slowest_read for a in averagers]
        assert min(reads) > FAST["min_matchmaking_time"], reads
        swarm.stop_all()
