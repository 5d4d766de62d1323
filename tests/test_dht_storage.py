import pytest

from swarmtrain.dht import (
    DHTID,
    CacheRefreshQueue,
    DHTLocalStorage,
    DictionaryDHTValue,
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


def test_regular_values_and_dictionaries_replace_each_other_by_expiration():
    storage = DHTLocalStorage()
    storage.store(KEY, b"regular", 10.0, now=0.0)
    assert not storage.store(KEY, b"sub", 10.0, now=0.0, subkey=b"s")  # not newer
    assert storage.store(KEY, b"sub", 11.0, now=0.0, subkey=b"s")  # replaces the regular value
    assert isinstance(storage.get(KEY, now=0.0).value, DictionaryDHTValue)
    assert not storage.store(KEY, b"regular", 11.0, now=0.0)
    assert storage.store(KEY, b"regular", 12.0, now=0.0)  # replaces the whole dictionary
    assert storage.get(KEY, now=0.0) == ValueWithExpiration(b"regular", 12.0)


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


def test_maxsize_evicts_soonest_expiring():
    storage = DHTLocalStorage(maxsize=3)
    keys = [DHTID.generate(i) for i in range(5)]
    for key, expiration in zip(keys[:3], (30.0, 10.0, 20.0), strict=True):
        assert storage.store(key, b"v", expiration, now=0.0)
    assert storage.store(keys[3], b"v", 40.0, now=0.0)
    assert keys[1] not in storage and len(storage) == 3
    # a newcomer that expires sooner than everything stored is evicted at once
    assert not storage.store(keys[4], b"v", 5.0, now=0.0)
    assert [k for k, _ in storage.items(now=0.0)] == [keys[0], keys[2], keys[3]]
    with pytest.raises(ValueError):
        DHTLocalStorage(maxsize=0)


def test_max_subkeys_evicts_soonest_expiring_subkey():
    storage = DHTLocalStorage(max_subkeys=2)
    for subkey, expiration in ((b"a", 30.0), (b"b", 10.0), (b"c", 20.0)):
        assert storage.store(KEY, b"v", expiration, now=0.0, subkey=subkey)
    assert [k for k, _ in storage.get(KEY, now=0.0).value.items(now=0.0)] == [b"a", b"c"]
    assert not storage.store(KEY, b"v", 5.0, now=0.0, subkey=b"d")
    with pytest.raises(ValueError):
        DHTLocalStorage(max_subkeys=0)


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
