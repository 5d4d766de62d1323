"""Progress records bound to peer ids (issue 17, items 3 and 4) against real peers on loopback.

Two honest ``ProgressTracker``s train (report samples, step when the swarm is ready) while an
attacker with its own DHT node (a plain ``DHT``: its node enforces nothing and keeps what it is
given) tries to steer them: it writes progress records under another peer's id, floods many
forged subkeys claiming a far-ahead epoch, and stores unsigned records under its own id, through
its own node, through raw store RPCs to every honest node, and over gossip. Every such record
is refused; the honest peers keep stepping together, count only each other, and never see a
global epoch beyond their own plus one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
import trio
from swarm_util import open_dhts

from swarmtrain.dht import DHTRecord, PeerRecordValidator, get_dht_time, serialize
from swarmtrain.dht.protocol import StoreItem
from swarmtrain.optim import AsyncProgressTracker, LocalProgress, ProgressTracker
from swarmtrain.optim.progress_records import PROGRESS_KEY_PATTERN
from swarmtrain.p2p import PeerSigner
from swarmtrain.p2p.identity import generate_identity, peer_id_of
from swarmtrain.p2p.pubsub import PubSub
from swarmtrain.proto.progress_pb2 import ProgressRecord

PREFIX = "owned"
TARGET = 60  # samples per epoch: 3 steps of 10 per honest peer
QUICK_REFRESH = {
    "min_refresh_period": 0.2,
    "max_refresh_period": 0.5,
    "default_refresh_period": 0.5,
}
FAR = 10**9
FLOOD = 32  # forged subkeys


@dataclasses.dataclass
class Swarm:
    honest: list[AsyncProgressTracker]
    evil: object  # the attacker's DHT
    evil_pubsub: PubSub
    key: str
    highest_global: list[int] = dataclasses.field(default_factory=lambda: [0, 0])

    @property
    def honest_ids(self) -> set[bytes]:
        return {t.dht.peer_id.to_bytes() for t in self.honest}

    def forged(self, peer_id: bytes, epoch: int, samples: int = 0) -> LocalProgress:
        return LocalProgress(peer_id, epoch, samples, 10.0, get_dht_time(), False)

    async def raw_store(self, subkey: bytes, value: bytes, expiration: float) -> list:
        """A record sent as is (no validator of the attacker's node) to every honest node."""
        item = StoreItem(serialize(self.key), serialize(subkey), value, expiration)
        protocol = self.evil.node.protocol
        return [await protocol.call_store(t.dht.peer_id, [item]) for t in self.honest]

    async def gossip(self, subkey: bytes, value: bytes, expiration: float) -> None:
        message = ProgressRecord(subkey=serialize(subkey), value=value, expiration_time=expiration)
        await self.evil_pubsub.publish_protobuf(self.key, message)

    def signed_by_evil(
        self, subkey: bytes, progress: LocalProgress | None, expiration: float
    ) -> bytes:
        """``progress`` (None: "it left") for ``subkey``, signed with the attacker's own
        identity key as if the subkey were its own (the signature covers the attacker's id)."""
        signer = PeerRecordValidator([PROGRESS_KEY_PATTERN], signer=PeerSigner(evil_key(self)))
        own = DHTRecord(
            serialize(self.key),
            serialize(signer.peer_id),
            serialize(None if progress is None else progress.to_dict()),
            expiration,
        )
        signed = signer.sign_value(own)
        assert signed != own.value
        return signed

    async def views_hold_only_honest_records(self) -> None:
        """Each honest tracker (after a fresh DHT read) counts exactly the other honest peer,
        with the record that peer published, and reads no other subkey."""
        for tracker in self.honest:
            await tracker.refresh()
            others = self.honest_ids - {tracker.dht.peer_id.to_bytes()}
            assert set(tracker.peers()) == others
            for other in self.honest:
                if other is not tracker:
                    seen = tracker.peers()[other.dht.peer_id.to_bytes()]
                    assert other.local_progress.epoch - seen.epoch in (0, 1)
            found = await tracker.dht.get(self.key, latest=True)
            assert found is not None and set(found.value) <= self.honest_ids, set(found.value)


def evil_key(swarm: Swarm):
    return swarm.evil.p2p.key_pair


async def train(tracker: AsyncProgressTracker, until_epoch: int, highest: list[int], i: int):
    """A trainer: 10 samples every 20 ms, a step when the swarm is ready (to the swarm's epoch
    when it is ahead). Records the highest global epoch it saw."""
    samples = 0
    while tracker.local_progress.epoch < until_epoch:
        highest[i] = max(highest[i], tracker.global_epoch)
        epoch = tracker.local_progress.epoch
        if tracker.ready_to_update_epoch:
            tracker.update_epoch(max(epoch + 1, tracker.global_epoch))
            samples = 0
        else:
            samples += 10
            tracker.report_local_progress(epoch, samples)
        await trio.sleep(0.02)  # the compute of one step


@contextlib.asynccontextmanager
async def swarm_under_attack() -> AsyncIterator[Swarm]:
    async with open_dhts(3) as (first, second, evil), AsyncExitStack() as stack:
        honest = [
            await stack.enter_async_context(
                AsyncProgressTracker.create(dht, PREFIX, TARGET, **QUICK_REFRESH)
            )
            for dht in (first, second)
        ]
        evil_pubsub = await stack.enter_async_context(PubSub.create(evil.p2p))
        key = honest[0].training_progress_key
        subscription = await evil_pubsub.subscribe(key, protobuf_type=ProgressRecord)
        stack.push_async_callback(subscription.aclose)
        with trio.fail_after(10):
            for pubsub in (evil_pubsub, *(t.pubsub for t in honest)):
                await pubsub.wait_mesh_peers(key, 2)
        yield Swarm(honest, evil, evil_pubsub, key)


async def train_through(swarm: Swarm, attack: Callable[[], Awaitable[None]], epochs: int = 4):
    """The honest peers train ``epochs`` epochs; the attack runs once they reached epoch 1."""
    highest = swarm.highest_global
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i, tracker in enumerate(swarm.honest):
                nursery.start_soon(train, tracker, epochs, highest, i)
            while min(t.local_progress.epoch for t in swarm.honest) < 1:  # noqa: ASYNC110
                await trio.sleep(0.02)  # (polls both trainers)
            await attack()
    for tracker in swarm.honest:
        assert tracker.local_progress.epoch == epochs
        assert tracker.global_epoch <= epochs + 1
    assert max(highest) <= epochs  # never ahead of where the honest peers actually were
    await swarm.views_hold_only_honest_records()


async def wait_rejected(swarm: Swarm, count: int) -> None:
    with trio.fail_after(10):
        while min(t.statistics().gossip_rejected for t in swarm.honest) < count:  # noqa: ASYNC110
            await trio.sleep(0.02)


@pytest.mark.trio
async def test_records_under_another_peers_id_are_refused_everywhere():
    async with swarm_under_attack() as swarm:
        victim, observer = swarm.honest
        victim_id = victim.dht.peer_id.to_bytes()

        async def attack() -> None:
            expiration = get_dht_time() + 120
            for epoch, samples in ((FAR, 0), (victim.local_progress.epoch, 10**6)):
                forged = swarm.forged(victim_id, epoch, samples)
                # 1. through its own node: unsigned (a node signs only its own subkey)
                await swarm.evil.store(swarm.key, forged.to_dict(), expiration, subkey=victim_id)
                # 2. raw store RPCs: unsigned, then signed with the attacker's own key
                unsigned = serialize(forged.to_dict())
                assert await swarm.raw_store(victim_id, unsigned, expiration) == [[False]] * 2
                signed = swarm.signed_by_evil(victim_id, forged, expiration)
                assert await swarm.raw_store(victim_id, signed, expiration) == [[False]] * 2
                # 3. blanking the victim's record ("it left"), unsigned and signed
                blank = swarm.signed_by_evil(victim_id, None, expiration)
                for value in (serialize(None), blank):
                    assert await swarm.raw_store(victim_id, value, expiration) == [[False]] * 2
                # 4. over gossip, all three
                for value in (unsigned, signed, blank):
                    await swarm.gossip(victim_id, value, expiration)
            await wait_rejected(swarm, 6)

        await train_through(swarm, attack)
        assert observer.statistics().unbound_refused == 0  # refused before the tracker


@pytest.mark.trio
async def test_a_flood_of_forged_subkeys_claiming_a_far_epoch_moves_nobody():
    async with swarm_under_attack() as swarm:
        # the ids of peers that do not exist (fresh identities the attacker does not run), and
        # the honest peers' ids: as 34 votes they would be a quorum of 36
        forged_ids = [peer_id_of(generate_identity()).to_bytes() for _ in range(FLOOD)]
        forged_ids += sorted(swarm.honest_ids)

        async def attack() -> None:
            expiration = get_dht_time() + FAR  # "forever" (capped or refused by the nodes)
            for subkey in forged_ids:
                forged = swarm.forged(subkey, FAR, 10**6)
                await swarm.evil.store(swarm.key, forged.to_dict(), expiration, subkey=subkey)
                signed = swarm.signed_by_evil(subkey, forged, get_dht_time() + 120)
                assert await swarm.raw_store(subkey, signed, get_dht_time() + 120) == [[False]] * 2
                await swarm.gossip(subkey, signed, get_dht_time() + 120)
            await wait_rejected(swarm, len(forged_ids))

        await train_through(swarm, attack)
        for tracker in swarm.honest:
            assert tracker.global_epoch < FAR


@pytest.mark.trio
async def test_unsigned_records_under_the_attackers_own_id_are_refused():
    async with swarm_under_attack() as swarm:
        evil_id = swarm.evil.peer_id.to_bytes()

        async def attack() -> None:
            expiration = get_dht_time() + 120
            for epoch in (FAR, max(t.local_progress.epoch for t in swarm.honest) + 1):
                forged = swarm.forged(evil_id, epoch, 10**6)
                unsigned = serialize(forged.to_dict())
                # its own node never registered the progress keys: it stores, unsigned
                await swarm.evil.store(swarm.key, forged.to_dict(), expiration, subkey=evil_id)
                assert await swarm.raw_store(evil_id, unsigned, expiration) == [[False]] * 2
                # a plain value over the whole key (no subkey) is refused as well
                item = StoreItem(serialize(swarm.key), None, unsigned, expiration)
                protocol = swarm.evil.node.protocol
                for tracker in swarm.honest:
                    assert await protocol.call_store(tracker.dht.peer_id, [item]) == [False]
                await swarm.gossip(evil_id, unsigned, expiration)
            await wait_rejected(swarm, 2)

        await train_through(swarm, attack)


@pytest.mark.trio
async def test_one_tracker_per_run_and_peer_and_private_key_is_ignored():
    async with open_dhts(1) as (dht,), AsyncExitStack() as stack:
        with pytest.warns(DeprecationWarning, match="private_key"):
            tracker = await stack.enter_async_context(
                ProgressTracker.create(dht, "one", 10, private_key=object(), use_pubsub=False)
            )
        assert tracker.local_public_key == dht.peer_id.to_bytes()
        with pytest.raises(ValueError, match="already runs a ProgressTracker"):
            async with ProgressTracker.create(dht, "one", 10, use_pubsub=False):
                pass  # pragma: no cover
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            async with ProgressTracker.create(dht, "other", 10, use_pubsub=False) as other:
                assert other.local_public_key == tracker.local_public_key
