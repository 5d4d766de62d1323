"""A get of a large value never holds the reader's event loop for its validation.

Validating a found dictionary costs per record (a signed record ~0.15 ms: 2,000 peers' records
held the loop ~0.3 s per answer, once per answering node, and again to cache them). Real nodes
on loopback; a validator records the thread each check ran in (no timing): a large
dictionary is checked in a worker thread, in the local lookup and in every answer, and not a
second time when cached; a small value stays on the loop (a thread hop costs more than it).
"""

from __future__ import annotations

import threading

import pytest
from test_dht_node import swarm

from swarmtrain.dht import DHTID, DHTRecord, get_dht_time, serialize
from swarmtrain.dht.node_values import INLINE_VALIDATION_BYTES, found_bytes
from swarmtrain.dht.validation import RecordValidatorBase

pytestmark = pytest.mark.trio


class ThreadRecorder(RecordValidatorBase):
    """Accepts every record; remembers which thread checked each record of ``key``."""

    def __init__(self, key: str) -> None:
        self.key = serialize(key)
        self.threads: list[threading.Thread] = []

    def validate(self, record: DHTRecord) -> bool:
        if record.key == self.key:
            self.threads.append(threading.current_thread())
        return True


async def _store_on(node, key: str, subkeys: int, value_size: int) -> None:
    """Put ``subkeys`` records straight into ``node``'s storage (what it answers with)."""
    now = get_dht_time()
    for i in range(subkeys):
        assert node.protocol.storage.store(
            DHTID.generate(key),
            serialize(b"x" * value_size),
            now + 120,
            now,
            subkey=serialize(f"peer{i}"),
        )


async def test_a_large_dictionary_is_validated_off_the_loop():
    key, subkeys = "progress", 400  # 400 x ~60 bytes: above the inline limit
    recorder = ThreadRecorder(key)
    async with swarm(2, validators=[recorder]) as s:
        holder, reader = s.nodes
        await _store_on(holder, key, subkeys, 48)
        loop_thread = threading.current_thread()
        found = await reader.get(key, latest=True)
        assert found is not None and len(found.value) == subkeys
        assert found_bytes(holder.protocol.lookup_locally(DHTID.generate(key), 0.0)) > (
            INLINE_VALIDATION_BYTES
        )
        # one answer (the holder's), checked record by record in a worker thread, and cached
        # by the reader without a second check
        assert len(recorder.threads) == subkeys
        assert loop_thread not in recorder.threads
        assert len(reader.protocol.cache) >= 1
        # a later get finds the cached copy locally and checks it off the loop too
        again = await reader.get(key)
        assert again is not None and len(again.value) == subkeys
        assert len(recorder.threads) == 2 * subkeys
        assert loop_thread not in recorder.threads


async def test_a_small_value_is_validated_on_the_loop():
    key = "small"
    recorder = ThreadRecorder(key)
    async with swarm(2, validators=[recorder]) as s:
        holder, reader = s.nodes
        await _store_on(holder, key, 3, 8)
        found = await reader.get(key, latest=True)
        assert found is not None and len(found.value) == 3
        assert recorder.threads and set(recorder.threads) == {threading.current_thread()}
