"""The records a progress core holds (``RecordBook``): one per peer id, versioned by
expiration time; pure."""

import math

from swarmtrain.optim.progress_record_book import RecordBook
from swarmtrain.optim.progress_types import LocalProgress

T0 = 1_000.0


def record(peer: bytes, epoch: int = 0, samples: int = 0) -> LocalProgress:
    return LocalProgress(peer, epoch, samples, 1.0, T0, False)


def offer(book: RecordBook, key: bytes, progress, expiration: float, now: float = T0) -> bool:
    """Hold ``progress`` unless the book refuses it (as the core does); returns whether held."""
    if book.refuses(key, progress, expiration, now):
        return False
    book.put(key, progress, expiration)
    return True


def test_ours_unbound_stale_and_endless_records_are_refused():
    book = RecordBook(b"me")
    assert not offer(book, b"me", record(b"me"), T0 + 60)  # the local state is newer
    assert not offer(book, b"a", record(b"b"), T0 + 60)  # signed by a, claims to be b
    assert not offer(book, b"a", record(b"a"), T0)  # expired
    assert not offer(book, b"a", record(b"a"), math.inf)
    assert not offer(book, b"a", record(b"a"), math.nan)
    assert book.num_unbound == 1 and book.num_merged == 0
    assert list(book.records(T0)) == [] and book.held(b"a") is None


def test_a_record_replaces_the_held_one_unless_it_expires_earlier_or_is_the_same():
    book = RecordBook(b"me")
    assert offer(book, b"a", record(b"a", samples=5), T0 + 60)
    assert not offer(book, b"a", record(b"a", samples=9), T0 + 59)  # older
    assert not offer(book, b"a", record(b"a", samples=5), T0 + 60)  # nothing new
    assert offer(book, b"a", record(b"a", samples=9), T0 + 60)  # same expiration, new content
    assert offer(book, b"a", record(b"a", epoch=1), T0 + 61)
    assert book.held(b"a") == record(b"a", epoch=1) and book.num_merged == 3
    assert list(book.records(T0)) == [(b"a", record(b"a", epoch=1), T0 + 61)]


def test_a_departure_is_held_but_listed_as_no_record_and_expired_ones_are_forgotten():
    book = RecordBook(b"me")
    offer(book, b"a", record(b"a"), T0 + 60)
    offer(book, b"b", record(b"b"), T0 + 10)
    assert offer(book, b"a", None, T0 + 70)  # a left the run
    assert book.held(b"a") is None
    assert not offer(book, b"a", record(b"a"), T0 + 65)  # its older record stays out
    assert [key for key, _, _ in book.records(T0)] == [b"b"]
    assert [key for key, _, _ in book.records(T0 + 10)] == []  # expired, not yet pruned
    book.prune(T0 + 10)
    assert offer(book, b"b", record(b"b"), T0 + 5, now=T0)  # forgotten: an older one is new
