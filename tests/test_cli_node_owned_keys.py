"""A bootstrap-only ``swarmtrain node`` (a real process) enforces every owned key pattern of
:mod:`swarmtrain.dht.owned_keys`, and never imports torch (issue 17.3).

The attacker and the honest peer are client-mode DHTs: they store nothing themselves, so every
record lives on the node under test, and each store's answer is the node's verdict.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from swarmtrain.dht import (
    DHT,
    OWNED_KEY_PATTERNS,
    DHTRecord,
    PeerRecordValidator,
    get_dht_time,
    owned_keys_validator,
    serialize,
)
from swarmtrain.dht.owned_keys import RUNS_KEY
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.p2p import PeerID, PeerSigner

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
NODE_COMMAND = [sys.executable, "-X", "importtime", "-m", "swarmtrain.cli.main", "node"]
#: one key of each owned pattern, as the components name them
OWNED_KEYS = [
    "run.0b01",
    "run.all_averagers",
    "run_diloco.peers",
    "run_progress",
    "run_metrics",
    RUNS_KEY,
]


def test_every_owned_pattern_has_an_example_key():
    for pattern in OWNED_KEY_PATTERNS:
        assert any(pattern.fullmatch(key) for key in OWNED_KEYS), pattern.pattern
    assert not any(pattern.fullmatch("run_free") for pattern in OWNED_KEY_PATTERNS)


@contextmanager
def running_node(imports: Path) -> Iterator[str]:
    """A ``swarmtrain node`` process on loopback: yields its address; its ``-X importtime``
    report (stderr) is complete in ``imports`` once the context is left (SIGINT, then wait)."""
    with imports.open("w") as stderr:
        proc = subprocess.Popen(
            [*NODE_COMMAND, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--refresh_period", "0"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        address, deadline = None, time.monotonic() + 60
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("others can join with: --initial_peers "):
                address = line.split("--initial_peers ")[1].strip()
        assert address is not None, imports.read_text()[-2000:]
        yield address
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == 0, imports.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[str]:
    with running_node(tmp_path / "imports.log") as address:
        yield address


@pytest.mark.trio
async def test_the_node_refuses_unsigned_and_forged_records_under_every_owned_key(node):
    node_id = PeerID.from_base58(node.rsplit("/p2p/", 1)[1])
    async with (
        DHT.create([node], client_mode=True, **HOST) as attacker,
        DHT.create([node], client_mode=True, **HOST) as honest,
        DHT.create([node], client_mode=True, **HOST) as reader,
    ):
        honest.add_validators([owned_keys_validator()])
        attacker_signs = PeerRecordValidator(
            OWNED_KEY_PATTERNS, signer=PeerSigner(attacker.p2p.key_pair)
        )
        honest_id = honest.peer_id.to_bytes()
        value = serialize({"claim": "forged"})

        async def on_node(item: StoreItem) -> list[bool]:
            return await attacker.node.protocol.call_store(node_id, [item])

        for key in OWNED_KEYS:
            now = get_dht_time()
            later = now + 120  # outlives the honest record: only a validator can refuse it
            own = DHTRecord(serialize(key), serialize(attacker.peer_id.to_bytes()), value, later)
            forgeries = {
                "plain value": StoreItem(serialize(key), None, value, later),
                "unsigned, victim's id": StoreItem(
                    serialize(key), serialize(honest_id), value, later
                ),
                "unsigned, own id": StoreItem(serialize(key), own.subkey, value, later),
                "attacker-signed, victim's id": StoreItem(
                    serialize(key), serialize(honest_id), attacker_signs.sign_value(own), later
                ),
            }
            for name, forged in forgeries.items():  # before and after the honest record exists
                assert await on_node(forged) == [False], (key, name)
            # signed by the honest peer's node: the bootstrap node accepts it
            assert await honest.store(key, {"claim": "mine"}, now + 60, subkey=honest_id), key
            for name, forged in forgeries.items():
                assert await on_node(forged) == [False], (key, name)
            # through the attacker's own node (it registered nothing): refused as well
            assert not await attacker.store(key, "x", later, subkey=honest_id), key
            found = await reader.get(key, latest=True)
            assert found is not None and set(found.value) == {honest_id}, key
            assert found.value[honest_id].value == {"claim": "mine"}, key
        # the control: the same unsigned record under a key nobody owns is stored
        free = StoreItem(serialize("run_free"), serialize(honest_id), value, get_dht_time() + 60)
        assert await on_node(free) == [True]


def test_the_running_node_never_imports_torch(tmp_path: Path):
    imports = tmp_path / "imports.log"
    with running_node(imports) as address:
        dht = DHT([address], client_mode=True, **HOST)  # the node serves requests
        try:
            assert dht.store("run_free", 1, get_dht_time() + 60, subkey=b"x")
            assert not dht.store("run_metrics", 1, get_dht_time() + 60, subkey=b"x")
        finally:
            dht.shutdown()
    modules = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", imports.read_text(), re.M)
    assert "swarmtrain.dht.owned_keys" in modules and "swarmtrain.cli.node" in modules
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]
