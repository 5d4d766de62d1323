"""``dial_owner``: what a dial to the peer a progress record names says about that peer.

Real hosts over loopback. Whatever the record names (garbage, ourselves, a peer nobody told us
the address of), the probe answers with an outcome and never raises.
"""

from __future__ import annotations

import re

import pytest
import trio

from swarmtrain.optim._owner_probe import dial_owner
from swarmtrain.optim.progress_liveness import ProbeOutcome
from swarmtrain.p2p import P2P

pytestmark = pytest.mark.trio
HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


async def test_probe_outcomes_for_what_a_record_may_name():
    async with P2P.create(**HOST) as prober, P2P.create(**HOST) as other:
        other_id = other.peer_id.to_bytes()
        assert await dial_owner(prober, other_id) is ProbeOutcome.UNKNOWN  # no address known
        addrs = [re.sub(r"/p2p/.*$", "", str(a)) for a in other.get_visible_maddrs()]
        prober.add_addrs(other.peer_id, addrs)
        with trio.fail_after(10):
            assert await dial_owner(prober, other_id) is ProbeOutcome.REACHABLE
        # our own id under another key: a record of an earlier process of ours
        assert await dial_owner(prober, prober.peer_id.to_bytes()) is ProbeOutcome.UNREACHABLE
        for garbage in (b"", b"\x00\xff" * 40, b"not a peer id"):
            assert await dial_owner(prober, garbage) in (
                ProbeOutcome.UNREACHABLE,
                ProbeOutcome.UNKNOWN,
            )
