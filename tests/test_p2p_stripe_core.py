"""Striped lanes, sans-IO (``stripe_core``): numbering, stripe choice, reassembly and its
bounds, hostile sequence numbers; the striped ticket and lane books."""

import random

import pytest

from swarmtrain.p2p.errors import LaneStripeError, ResourceLimitError
from swarmtrain.p2p.lane_books import LaneBook, TicketBook, wait_after_ticket
from swarmtrain.p2p.stripe_core import (
    MAX_SEQ_LEAD,
    MAX_STRIPES,
    SEQ_SIZE,
    STRIPE_TARGET_MBIT,
    StripeReassembler,
    StripeSender,
    mathis_mbit,
    stripes_for_path,
)


def record(seq: int, payload: bytes = b"x") -> bytes:
    return seq.to_bytes(SEQ_SIZE, "big") + payload


def drain(reassembler: StripeReassembler) -> list[bytes]:
    out = []
    while (payload := reassembler.pop()) is not None:
        out.append(bytes(payload))
    return out


def test_the_sender_numbers_records_and_spreads_them_over_writable_stripes():
    sender = StripeSender(3, record_size=4)
    frames = list(sender.frames(b"abcdefghij"))
    assert [int.from_bytes(f[:SEQ_SIZE], "big") for f in frames] == [0, 1, 2]
    assert [bytes(f[SEQ_SIZE:]) for f in frames] == [b"abcd", b"efgh", b"ij"]
    assert [sender.choose({0, 1, 2}) for _ in range(4)] == [0, 1, 2, 0]
    # a stalled stripe (0) gets nothing while others can take records
    assert [sender.choose({1, 2}) for _ in range(4)] == [1, 2, 1, 2]
    assert sender.choose(set()) is None  # none can: wait for one
    assert sender.records_per_stripe == [2, 3, 3]
    for bad in (0, MAX_STRIPES + 1):
        with pytest.raises(ValueError):
            StripeSender(bad)


def test_records_arriving_out_of_order_come_out_in_order():
    r = StripeReassembler(3)
    assert r.wanted() == [0, 1, 2]
    r.on_record(2, record(2, b"c"))
    r.on_record(1, record(1, b"b"))
    assert r.pop() is None  # record 0 has not arrived
    assert r.wanted() == [0, 1, 2]  # 0 may carry it; 1 and 2 are ahead, the buffer has room
    r.on_record(0, record(0, b"a"))
    assert drain(r) == [b"a", b"b", b"c"]
    r.on_record(0, record(3, b"d"))
    assert drain(r) == [b"d"]
    for stripe in range(3):
        r.on_end(stripe)
    assert r.finished and r.wanted() == []


def test_a_stalled_stripe_holds_only_a_bounded_buffer():
    r = StripeReassembler(3, window=4)
    assert r.max_buffered == 7
    seq = 1  # record 0 sits on stripe 0, which stalls
    while True:
        wanted = r.wanted()
        ahead = [s for s in wanted if s != 0]
        if not ahead:
            break
        for stripe in ahead:
            r.on_record(stripe, record(seq))
            seq += 1
        assert r.buffered <= r.max_buffered
        assert r.pop() is None
    assert r.wanted() == [0]  # only the stripe that can unblock the stream is read
    assert r.buffered <= r.max_buffered and r.peak_buffered == r.buffered
    r.on_record(0, record(0))
    assert len(drain(r)) == seq  # everything, in order


def test_a_stripe_that_ends_with_a_record_missing_is_an_error_not_a_wait():
    r = StripeReassembler(2)
    r.on_record(1, record(1))
    r.on_end(0)  # stripe 0 ended cleanly, but record 0 never came
    with pytest.raises(LaneStripeError, match="record 0 is missing"):
        r.wanted()
    r = StripeReassembler(2)
    r.on_record(0, record(1))
    r.on_record(1, record(2))  # every stripe is past record 0: it is on none
    with pytest.raises(LaneStripeError, match="missing"):
        r.wanted()


@pytest.mark.parametrize(
    "stripe, plaintext, match",
    [
        (0, record(MAX_SEQ_LEAD), "ahead"),  # far ahead
        (0, record(2**64 - 1), "ahead"),
        (0, b"\x00" * SEQ_SIZE, "without payload"),
        (0, b"\x00\x00", "without payload"),
        (0, record(0, b"y" * 65), "65 bytes"),  # over max_payload
    ],
)
def test_hostile_records_are_refused(stripe, plaintext, match):
    r = StripeReassembler(2, max_payload=64)
    with pytest.raises(LaneStripeError, match=match):
        r.on_record(stripe, plaintext)
    assert r.buffered == 0 and r.buffered_bytes == 0


def test_duplicates_going_back_and_data_after_an_end_are_refused():
    r = StripeReassembler(2)
    r.on_record(0, record(0))
    assert drain(r) == [b"x"]
    with pytest.raises(LaneStripeError, match="twice"):
        r.on_record(1, record(0))  # already taken
    r.on_record(1, record(2))
    with pytest.raises(LaneStripeError, match="twice"):
        r.on_record(0, record(2))  # held in the buffer
    with pytest.raises(LaneStripeError, match="went back"):
        r.on_record(1, record(1))  # a stripe's numbers increase
    r.on_end(0)
    with pytest.raises(LaneStripeError, match="after its end"):
        r.on_record(0, record(1))
    with pytest.raises(ValueError):
        r.on_record(2, record(1))  # no such stripe


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_keep_order_and_the_bound(seed):
    rng = random.Random(seed)
    stripes = rng.randint(1, 6)
    total = rng.randint(1, 200)
    sender = StripeSender(stripes, record_size=3)
    data = bytes(rng.getrandbits(8) for _ in range(total * 3))
    frames = list(sender.frames(data))
    queues: list[list[bytes]] = [[] for _ in range(stripes)]  # what each flow holds
    r = StripeReassembler(stripes, window=rng.randint(0, 4), max_payload=3)
    sent, out, ended = 0, [], False
    while True:
        out.extend(drain(r))
        if r.finished:
            break
        if sent < len(frames) and rng.random() < 0.5:
            writable = {s for s in range(stripes) if rng.random() < 0.7}
            stripe = sender.choose(writable)
            if stripe is not None:
                queues[stripe].append(bytes(frames[sent]))
                sent += 1
            continue
        if sent == len(frames) and not ended:
            for queue in queues:
                queue.append(b"")  # each stripe ends after its records
            ended = True
        ready = [s for s in r.wanted() if queues[s]]
        if not ready:
            assert sent < len(frames)  # only waiting for the sender, never stuck
            continue
        stripe = rng.choice(ready)
        item = queues[stripe].pop(0)
        if item:
            r.on_record(stripe, item)
        else:
            r.on_end(stripe)
        assert r.buffered <= r.max_buffered
        assert r.buffered_bytes <= r.max_buffered * 3
    assert b"".join(out) == data


# ------------------------------------------------------------------ the books


def test_a_striped_ticket_admits_each_stripe_once_up_to_its_count():
    book = TicketBook(ttl=10.0, per_peer=2)
    ticket_id, ticket = book.issue("p", now=0.0, stripes=4)
    assert book.outstanding("p") == 4
    assert book.lookup(ticket_id, now=1.0) is ticket and book.lookup(ticket_id, now=11.0) is None
    assert book.redeem(ticket_id, now=1.0, stripe=0, count=5) is None  # more than granted
    assert book.redeem(ticket_id, now=1.0, stripe=3, count=3) is None  # index past count
    assert book.redeem(ticket_id, now=1.0, stripe=0, count=3) is ticket
    assert ticket.count == 3 and book.outstanding("p") == 2  # the 4th slot is given back
    assert book.redeem(ticket_id, now=1.0, stripe=0, count=3) is None  # the same index again
    assert book.redeem(ticket_id, now=1.0, stripe=1, count=2) is None  # another count
    assert book.redeem(ticket_id, now=1.0, stripe=2, count=3) is ticket
    assert book.redeem(ticket_id, now=1.0, stripe=1, count=3) is ticket
    assert len(book) == 0 and book.outstanding("p") == 0  # used up
    assert book.redeem(ticket_id, now=1.0, stripe=1, count=3) is None
    late_id, _ = book.issue("p", now=0.0, stripes=2)
    book.redeem(late_id, now=1.0, stripe=0, count=2)
    book.cancel(late_id)  # the lane failed to form: its other stripe is refused
    assert book.redeem(late_id, now=1.0, stripe=1, count=2) is None
    assert book.outstanding("p") == 0
    plain_id, _ = book.issue("p", now=0.0)  # a plain ticket: one connection, stripe 0
    assert book.redeem(plain_id, now=1.0, stripe=1, count=2) is None
    assert book.redeem(plain_id, now=1.0) is not None


def test_the_lane_book_grants_stripes_within_its_room():
    book = LaneBook(total=6, per_peer=4, stale_after=10.0)
    assert book.room("a", now=0.0) == 4
    assert book.room("a", now=0.0, tickets=3) == 1
    for token in ("a1", "a2", "a3"):
        book.admit(token, "a", now=0.0)
    assert book.room("a", now=0.0) == 1
    for token in ("b1", "b2", "b3"):
        book.admit(token, "b", now=0.0)
    assert book.room("c", now=0.0) == 0  # full
    with pytest.raises(ResourceLimitError):
        book.check("c", now=0.0)
    assert book.room("c", now=10.0) == 4  # all six are stale idle lanes now; per-peer cap


def test_one_striped_lane_gets_at_most_half_a_peers_lane_share():
    book = LaneBook(total=64, per_peer=16, stale_after=10.0)
    assert book.stripes_to_grant("a", 16, now=0.0) == 8  # not the whole share of 16
    for i in range(8):
        book.admit(f"a{i}", "a", now=0.0)
    assert book.stripes_to_grant("a", 16, now=0.0) == 8  # room for a second lane
    assert book.stripes_to_grant("a", 3, now=0.0) == 3
    for i in range(8, 14):
        book.admit(f"a{i}", "a", now=0.0)
    assert book.stripes_to_grant("a", 16, now=0.0) == 2  # the room left
    assert LaneBook(total=64, per_peer=1, stale_after=10.0).stripes_to_grant("b", 8, 0.0) == 1


def test_a_call_waits_a_few_round_trips_after_its_ticket():
    assert wait_after_ticket(0.001, 4.0) == pytest.approx(0.026)  # a LAN: a few ms
    assert wait_after_ticket(0.3, 4.0) == pytest.approx(2.8)  # 3-4 RTTs and a lost SYN
    assert wait_after_ticket(5.0, 4.0) == 4.0


# ------------------------------------------------------------------ stripes per path


def test_one_lossy_flow_at_a_long_rtt_is_slow():
    assert mathis_mbit(0.3, 0.01) == pytest.approx(0.471, abs=0.001)
    assert mathis_mbit(0.1, 0.01) == pytest.approx(3 * mathis_mbit(0.3, 0.01))
    assert mathis_mbit(0.3, 0.0001) == pytest.approx(10 * mathis_mbit(0.3, 0.01))


def test_stripes_follow_the_path_up_to_the_cap():
    # 300 ms / 1%: ~54 flows for the target; the cap decides
    assert stripes_for_path(0.3, 0.01, 8) == 8
    assert stripes_for_path(0.3, 0.01, 16) == 16
    # a short clean path needs one flow
    assert stripes_for_path(0.01, 0.0001, 16) == 1
    # in between: enough flows for the target at the Mathis rate
    wanted = stripes_for_path(0.05, 0.0005, 16)
    assert wanted == -(-STRIPE_TARGET_MBIT // mathis_mbit(0.05, 0.0005))
    assert 1 < wanted < 16
    # loss unknown (a first contact: a young connection): the cap
    for rtt, loss in ((0.3, None), (0.3, 0.0), (None, 0.01), (None, None)):
        assert stripes_for_path(rtt, loss, 16) == 16
        assert stripes_for_path(rtt, loss, 2) == 2
    # more loss never asks for fewer stripes; the cap always holds
    counts = [stripes_for_path(0.1, p, MAX_STRIPES) for p in (1e-5, 1e-4, 1e-3, 1e-2, 0.5, 1.0)]
    assert counts == sorted(counts) and all(1 <= c <= MAX_STRIPES for c in counts)
    with pytest.raises(ValueError):
        stripes_for_path(0.3, 0.01, 0)
