"""swarmtrain changes its own hosts only: py-libp2p's modules and classes stay as imported.

Our hosts get their behaviour from subclasses and instances (``p2p/_tuning.py`` lists them).
``tests/libp2p_scoped_probe.py`` runs in a fresh process: it records every loaded ``libp2p.*``
module's and class's attributes, runs two swarmtrain hosts (small RPCs, 3 MiB over yamux),
records again, then runs two plain py-libp2p hosts in the same process. No process-wide change
is left (``ALLOWED_CHANGES``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).resolve().parent / "libp2p_scoped_probe.py"

#: assignments onto py-libp2p's modules and classes that we allow: none (the last one, the
#: routing of ``SwarmConn``'s root-logger calls, is per host since 2026-12-04)
ALLOWED_CHANGES: list[str] = []
STOCK_PIECES = {
    "connection": "SwarmConn",
    "muxer": "Yamux",
    "streams": "dict",
    "noise": "NoiseTransportReadWriter",
    "tcp": "TrioTCPStream",
    "multiselect": ["MultiselectClient"],
    "muxer_multistream": "MuxerMultistream",
    "tcp_transport": ["TCP"],
    "identify_on_instance": False,
    "dial_delay": 0.25,
}
OUR_PIECES = {
    "connection": "ScopedSwarmConn",  # logs to a module logger, not the root logger
    "muxer": "TunedYamux",
    "streams": "_AdoptingStreams",
    "noise": "BatchingNoiseReadWriter",
    "tcp": "BufferedTCPStream",
    "multiselect": ["PipelinedMultiselectClient"],
    "muxer_multistream": "TunedMuxerMultistream",
    "tcp_transport": ["HolePunchTCP"],
    "identify_on_instance": True,
    "dial_delay": 0.0,
}
STOCK_MAX_FRAME = 64 * 1024 - 12  # py-libp2p's MAX_MESSAGE_SIZE minus the yamux header


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's swarmtrain, not an installed one
    result = subprocess.run(
        [sys.executable, str(PROBE)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert Path(report["swarmtrain"]).is_relative_to(ROOT)
    return report


def test_our_hosts_assign_nothing_onto_libp2p(probe):
    assert probe["namespaces"] > 500  # every loaded libp2p module and class was recorded
    assert probe["changes"] == ALLOWED_CHANGES, (
        "swarmtrain assigned onto py-libp2p's modules or classes (scope it to our hosts): "
        f"{probe['changes']}"
    )


def test_our_hosts_run_on_our_subclasses(probe):
    assert probe["ours"]["pieces"] == OUR_PIECES
    assert probe["ours"]["max_frame"] > STOCK_MAX_FRAME  # our 1 MiB yamux frames


def test_a_plain_host_next_to_ours_is_stock(probe):
    stock = probe["stock"]
    assert stock["pieces"] == STOCK_PIECES
    assert stock["listener_pieces"] == STOCK_PIECES
    assert stock["received"] == [200 * 1024]
    assert stock["max_frame"] == STOCK_MAX_FRAME  # not our 1 MiB frames
    assert stock["identified_inbound"]  # py-libp2p identifies peers that dialled it
