import pytest

from swarmtrain.dht import (
    DHTID,
    CacheRefreshQueue,
    DHTLocalStorage,
    DictionaryDHTValue,
    PeerUsage,
    StorageLedger,
    StorageQuota,
    StorageStatistics,
    StoreOutcome,
    TimedStorage,
    ValueWithExpiration,
)

KEY, OTHER = DHTID.generate("key"), DHTID.generate("other")


def test_value_with_expiration_is_frozen_and_unpacks():
    item = ValueWithExpiration(b"v", 5.0)
    value, expiration = item
    assert (value, expiration) == (b"v", 5.0)
    with pytest.raises(AttributeError):
        item.value = b"w"  # type: ignore[misc]


def test_expiry_with_explicit_now():
    storage = DHTLocalStorage()
    assert storage.store(KEY, b"v", 10.0, now=0.0)
    assert storage.get(KEY, now=9.99) == ValueWithExpiration(b"v", 10.0)
    assert storage.get(KEY, now=10.0) is None  # live while now < expiration
    assert len(storage) == 0
    assert not storage.store(KEY, b"late", 5.0, now=5.0)  # already expired on arrival
    assert storage.items(now=0.0) == []


def test_newer_expiration_wins():
    storage = DHTLocalStorage()
    assert storage.store(KEY, b"old", 10.0, now=0.0)
    assert storage.store(KEY, b"new", 20.0, now=1.0)
    assert not storage.store(KEY, b"older", 15.0, now=2.0)
    assert not storage.store(KEY, b"same time", 20.0, now=2.0)  # ties keep the first write
    assert storage.get(KEY, now=2.0) == ValueWithExpiration(b"new", 20.0)
    # the replaced value's earlier expiration must not delete the newer one
    assert storage.get(KEY, now=12.0) == ValueWithExpiration(b"new", 20.0)
    with pytest.raises(TypeError, match="bytes"):
        storage.store(KEY, "not bytes", 30.0, now=0.0)  # type: ignore[arg-type]


def test_subkeys_from_several_writers_merge():
    storage = DHTLocalStorage()
    assert storage.store(KEY, b"alice", 10.0, now=0.0, subkey=b"a")
    assert storage.store(KEY, b"bob", 30.0, now=0.0, subkey=b"b")
    assert storage.store(KEY, b"carol", 20.0, now=0.0, subkey=b"c")
    assert not storage.store(KEY, b"stale alice", 5.0, now=0.0, subkey=b"a")
    assert storage.store(KEY, b"alice 2", 15.0, now=0.0, subkey=b"a")
    found = storage.get(KEY, now=1.0)
    assert found is not None and isinstance(found.value, DictionaryDHTValue)
    assert found.expiration_time == 30.0 == found.value.latest_expiration_time
    assert dict(found.value.items(now=1.0)) == {
        b"a": ValueWithExpiration(b"alice 2", 15.0),
        b"b": ValueWithExpiration(b"bob", 30.0),
        b"c": ValueWithExpiration(b"carol", 20.0),
    }
    # subkeys expire one by one, the dictionary lives as long as its latest subkey
    found = storage.get(KEY, now=25.0)
    assert found is not None and [k for k, _ in found.value.items(now=25.0)] == [b"b"]
    assert storage.get(KEY, now=30.0) is None


def test_subkeys_replace_a_regular_value_but_never_the_reverse():
    storage = DHTLocalStorage()
    assert storage.store(KEY, b"regular", 30.0, now=0.0)
    # a dictionary collects many writers' records: a subkey turns the key into a dictionary
    # whatever the regular value's expiration ...
    assert storage.store(KEY, b"sub", 10.0, now=0.0, subkey=b"s")
    assert isinstance(storage.get(KEY, now=0.0).value, DictionaryDHTValue)
    assert storage.usage(None, now=0.0) == PeerUsage(1, len(b"sub") + 1)  # regular value gone
    # ... and no regular value replaces live subkeys, however late it expires
    outcome = storage.store_record(KEY, b"wipe", 1e9, now=0.0)
    assert outcome is StoreOutcome.KEY_HOLDS_DICTIONARY and not outcome.stored
    assert [k for k, _ in storage.get(KEY, now=0.0).value.items(now=0.0)] == [b"s"]
    # once the subkeys expired, the key is free again
    assert storage.store(KEY, b"regular", 40.0, now=10.0)
    assert storage.get(KEY, now=10.0) == ValueWithExpiration(b"regular", 40.0)


def test_dictionary_outer_expiration_grows_with_subkeys():
    storage = DHTLocalStorage()
    storage.store(KEY, b"1", 10.0, now=0.0, subkey=b"x")
    storage.store(KEY, b"2", 50.0, now=0.0, subkey=b"y")
    assert storage.get(KEY, now=20.0).expiration_time == 50.0
    top = storage.top(now=20.0)
    assert top is not None and top[0] == KEY and top[1].expiration_time == 50.0


def test_get_copy_is_a_snapshot():
    storage = DHTLocalStorage()
    storage.store(KEY, b"1", 10.0, now=0.0, subkey=b"x")
    snapshot = storage.get_copy(KEY, now=0.0)
    storage.store(KEY, b"2", 10.0, now=0.0, subkey=b"y")
    assert [k for k, _ in snapshot.value.items(now=0.0)] == [b"x"]
    assert len(storage.get(KEY, now=0.0).value) == 2
    storage.store(OTHER, b"plain", 10.0, now=0.0)
    assert storage.get_copy(OTHER, now=0.0) == ValueWithExpiration(b"plain", 10.0)
    assert storage.get_copy(DHTID.generate("missing"), now=0.0) is None


def test_maxsize_evicts_the_oldest_write_not_the_soonest_expiring():
    storage = DHTLocalStorage(maxsize=3)
    keys = [DHTID.generate(i) for i in range(5)]
    for key, expiration in zip(keys[:3], (30.0, 10.0, 20.0), strict=True):
        assert storage.store(key, b"v", expiration, now=0.0)
    assert storage.store(keys[0], b"rewritten", 31.0, now=0.0)  # a rewrite is a new write
    assert storage.store(keys[3], b"v", 1e9, now=0.0)
    assert keys[1] not in storage and len(storage) == 3
    # a newcomer that expires sooner than everything stored is kept: the oldest write goes
    assert storage.store(keys[4], b"v", 5.0, now=0.0)
    assert [k for k, _ in storage.items(now=0.0)] == [keys[0], keys[3], keys[4]]
    assert storage.usage(None, now=0.0).records == 3
    with pytest.raises(ValueError):
        DHTLocalStorage(maxsize=0)


def test_max_subkeys_evicts_the_oldest_subkey():
    storage = DHTLocalStorage(max_subkeys=2)
    for subkey, expiration in ((b"a", 30.0), (b"b", 10.0), (b"c", 20.0)):
        assert storage.store(KEY, b"v", expiration, now=0.0, subkey=subkey)
    assert [k for k, _ in storage.get(KEY, now=0.0).value.items(now=0.0)] == [b"b", b"c"]
    assert storage.store(KEY, b"v", 5.0, now=0.0, subkey=b"d")
    assert [k for k, _ in storage.get(KEY, now=0.0).value.items(now=0.0)] == [b"c", b"d"]
    assert storage.usage(None, now=0.0).records == 2
    with pytest.raises(ValueError):
        DHTLocalStorage(max_subkeys=0)


def test_audit_8_far_future_junk_does_not_push_out_honest_records():
    """The audit's pure-storage evidence: 10 honest keys, then 10 junk keys expiring in 1e9 s
    (the old rule evicted every honest key and kept no new honest store)."""
    storage = DHTLocalStorage(maxsize=10, max_subkeys=3)
    honest = [DHTID.generate(f"honest{i}") for i in range(10)]
    for key in honest:
        assert storage.store(key, b"h", 60.0, now=0.0)
    for i in range(10):
        storage.store(DHTID.generate(f"junk{i}"), b"j", 1e9, now=1.0, peer="evil")
    # the honest peers refresh their records (as every writer does), and they stay
    for key in honest[:5]:
        assert storage.store(key, b"h", 62.0, now=2.0)
    assert all(key in storage for key in honest[:5])
    assert storage.store(DHTID.generate("new honest"), b"h", 63.0, now=3.0)
    # a dictionary full of far-future fake subkeys: an honest subkey is still kept
    for i in range(3):
        storage.store(OTHER, b"fake", 1e9, now=0.0, subkey=b"fake%d" % i, peer="evil")
    assert storage.store(OTHER, b"honest", 60.0, now=1.0, subkey=b"honest")
    assert b"honest" in dict(storage.get(OTHER, now=1.0).value.items(now=1.0))


def test_expiration_horizon_refuses_far_future_records():
    storage = DHTLocalStorage(expiration_horizon=600.0)
    assert storage.store_record(KEY, b"v", 600.0, now=0.0) is StoreOutcome.STORED
    assert storage.store_record(KEY, b"v", 600.5, now=0.0) is StoreOutcome.EXPIRATION_TOO_FAR
    outcome = storage.store_record(OTHER, b"v", 1e9, now=0.0, subkey=b"s", peer="evil")
    assert outcome is StoreOutcome.EXPIRATION_TOO_FAR and OTHER not in storage
    assert storage.usage("evil", now=0.0) == PeerUsage()
    with pytest.raises(ValueError):
        DHTLocalStorage(expiration_horizon=0.0)


def test_per_peer_record_and_byte_quotas_refuse_without_evicting_others():
    quota = StorageQuota(max_records_per_peer=3, max_bytes_per_peer=100, max_total_bytes=None)
    storage = DHTLocalStorage(quota=quota)
    assert storage.store(KEY, b"honest", 60.0, now=0.0, peer="alice")
    keys = [DHTID.generate(f"k{i}") for i in range(5)]
    for key in keys[:3]:
        assert storage.store(key, b"x", 60.0, now=0.0, peer="evil")
    assert storage.store_record(keys[3], b"x", 60.0, now=0.0, peer="evil") is (
        StoreOutcome.PEER_RECORD_QUOTA
    )
    # rewriting one of its own records does not count twice
    assert storage.store(keys[0], b"y", 61.0, now=0.0, peer="evil")
    assert storage.usage("evil", now=0.0) == PeerUsage(3, 3)
    # bytes: a 98-byte record would bring it to 100 + 1; subkeys count too
    assert storage.store_record(keys[1], b"z" * 99, 62.0, now=0.0, peer="evil") is (
        StoreOutcome.PEER_BYTE_QUOTA
    )
    assert storage.store(keys[1], b"z" * 98, 62.0, now=0.0, peer="evil")
    assert storage.store_record(OTHER, b"v", 60.0, now=0.0, subkey=b"s", peer="evil") is (
        StoreOutcome.PEER_RECORD_QUOTA
    )
    # nothing of alice's was touched; other peers and this node are not limited by evil's use
    assert storage.get(KEY, now=0.0) == ValueWithExpiration(b"honest", 60.0)
    assert storage.store(OTHER, b"v" * 500, 60.0, now=0.0, subkey=b"s")  # this node: no quota
    assert storage.store(keys[4], b"ok", 60.0, now=0.0, peer="bob")
    # charges lapse when the records expire: the quota frees up
    assert storage.usage("evil", now=60.0) == PeerUsage(2, 99)
    assert storage.usage("evil", now=62.0) == PeerUsage()
    assert storage.store(keys[3], b"x", 120.0, now=62.0, peer="evil")


def test_a_record_taken_over_by_another_peer_moves_its_charge():
    storage = DHTLocalStorage(quota=StorageQuota(max_records_per_peer=1))
    assert storage.store(KEY, b"a", 10.0, now=0.0, peer="alice")
    assert storage.store(KEY, b"bb", 20.0, now=0.0, peer="bob")
    assert storage.usage("alice", now=0.0) == PeerUsage()
    assert storage.usage("bob", now=0.0) == PeerUsage(1, 2)
    assert storage.store(OTHER, b"a", 10.0, now=0.0, peer="alice")  # alice's quota is free
    # subkeys: each is charged to its writer; a dictionary that expires releases them all
    assert storage.store(DHTID.generate("d"), b"s", 30.0, now=0.0, subkey=b"x", peer="carol")
    stats = storage.statistics(now=0.0)
    assert (stats.num_keys, stats.num_records, stats.num_peers) == (3, 3, 3)
    assert storage.statistics(now=30.0) == StorageStatistics(0, 0, 0, 0)


def test_total_byte_budget_evicts_the_oldest_records_of_anyone():
    storage = DHTLocalStorage(quota=StorageQuota(None, None, max_total_bytes=10))
    assert storage.store(KEY, b"aaaa", 60.0, now=0.0)
    assert storage.store(OTHER, b"bbb", 1e9, now=0.0, subkey=b"s", peer="p")  # 4 bytes
    assert storage.store_record(DHTID.generate(0), b"c" * 11, 60.0, now=0.0) is (
        StoreOutcome.TOO_LARGE
    )
    assert storage.store(DHTID.generate(1), b"cccc", 60.0, now=1.0)  # 12 bytes: KEY goes
    assert KEY not in storage and storage.statistics(now=1.0).num_bytes == 8
    assert storage.store(DHTID.generate(2), b"dddd", 60.0, now=1.0)  # the subkey goes
    assert OTHER not in storage and storage.usage("p", now=1.0) == PeerUsage()


def test_storage_quota_validates():
    with pytest.raises(ValueError, match="max_bytes_per_peer"):
        StorageQuota(max_bytes_per_peer=0)
    with pytest.raises(ValueError, match="max_records_per_peer"):
        StorageQuota(max_records_per_peer=True)


def test_ledger_charges_and_expiry():
    ledger: StorageLedger[str] = StorageLedger(StorageQuota(2, None, None))
    ledger.charge("p", (KEY, None), 5, 10.0)
    ledger.charge("p", (OTHER, b"s"), 3, 20.0)
    assert ledger.refusal("p", (DHTID.generate(1), None), 1, now=0.0) is (
        StoreOutcome.PEER_RECORD_QUOTA
    )
    assert ledger.refusal("p", (KEY, None), 100, now=0.0) is None  # replaces its own
    assert ledger.refusal(None, (DHTID.generate(1), None), 1, now=0.0) is None
    assert ledger.oldest() == (KEY, None) and ledger.total_bytes == 8
    ledger.charge("q", (KEY, None), 1, 30.0)  # taken over: KEY becomes the newest
    assert ledger.oldest() == (OTHER, b"s")
    assert ledger.usage("p", now=0.0) == PeerUsage(1, 3)
    assert ledger.usage("p", now=20.0) == PeerUsage() and ledger.num_peers(now=20.0) == 1
    for i in range(1000):  # rewrites keep the heap bounded
        ledger.charge("q", (KEY, None), 1, 40.0 + i)
    assert len(ledger._heap) < 100 and len(ledger) == 1


def test_heap_stays_bounded_under_rewrites():
    storage: TimedStorage[str, int] = TimedStorage()
    for i in range(1, 10_000):
        storage.store("k", i, float(i), now=0.0)
    assert len(storage._heap) < 100
    assert storage.get("k", now=0.0) == ValueWithExpiration(9999, 9999.0)
    assert storage.pop("k") is not None and storage.pop("k") is None
    assert storage.top(now=0.0) is None


def test_dictionary_pack_roundtrip():
    value = DictionaryDHTValue()
    value.store(b"a", b"1", 10.0, now=0.0)
    value.store(b"b", b"2", 20.0, now=0.0)
    restored = DictionaryDHTValue.unpackb(value.packb(now=0.0), now=15.0)
    assert dict(restored.items(now=15.0)) == {b"b": ValueWithExpiration(b"2", 20.0)}
    assert restored.latest_expiration_time == 20.0
    with pytest.raises(ValueError, match="malformed"):
        DictionaryDHTValue.unpackb(b"\x92\x01", now=0.0)
    with pytest.raises(ValueError, match="malformed"):
        DictionaryDHTValue.unpackb(b"\x92\x01\x91\x93\xa1a\xa1b\x01", now=0.0)  # str subkey


def test_cache_refresh_queue():
    queue = CacheRefreshQueue()
    queue.store(KEY, None, 100.0, now=0.0)
    queue.store(OTHER, None, 50.0, now=0.0)
    assert queue.pop_due(now=0.0, lead_time=10.0) == []
    assert queue.pop_due(now=45.0, lead_time=10.0) == [OTHER]
    assert queue.pop_due(now=200.0, lead_time=10.0) == []  # expired entries are dropped
    assert len(queue) == 0
