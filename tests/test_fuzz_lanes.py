"""Property tests of the lane record layer: records round-trip in order; any change to a
record, its order or its direction fails with ``LaneRecordError``; headers are bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.p2p.lane_records import (
    HEADER_SIZE,
    KEY_SIZE,
    MAX_RECORD_CIPHERTEXT,
    TAG_SIZE,
    LaneRecordError,
    RecordOpener,
    RecordSealer,
)

keys = st.binary(min_size=KEY_SIZE, max_size=KEY_SIZE)
messages = st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=5)


def seal_all(key: bytes, items: list[bytes]) -> list[bytes]:
    sealer = RecordSealer(key)
    records = [bytes(record) for data in items for record in sealer.seal(data)]
    return [*records, sealer.seal_end()]


def open_record(opener: RecordOpener, record: bytes) -> bytes:
    size = RecordOpener.ciphertext_size(record[:HEADER_SIZE])
    assert size == len(record) - HEADER_SIZE
    return opener.open(record[HEADER_SIZE:])


@given(keys, messages, st.booleans())
def test_records_round_trip(key, items, into):
    opener = RecordOpener(key)
    records = seal_all(key, items)
    for data, record in zip(items, records, strict=False):
        if into:
            out = bytearray(len(data))
            assert opener.open_into(record[HEADER_SIZE:], out) == len(data)
            assert bytes(out) == data
        else:
            assert open_record(opener, record) == data
    assert open_record(opener, records[-1]) == b"" and opener.ended


@given(keys, messages, st.data())
def test_tampered_records_fail_with_the_typed_error(key, items, data):
    """Flip a bit, drop, repeat or swap records, or use the other key: LaneRecordError."""
    records = seal_all(key, items)
    attack = data.draw(st.sampled_from(["flip", "drop", "repeat", "swap", "other_key", "after"]))
    at = data.draw(st.integers(0, len(records) - 1))
    if attack == "flip":
        record = bytearray(records[at])
        bit = data.draw(st.integers(HEADER_SIZE * 8, len(record) * 8 - 1))
        record[bit // 8] ^= 1 << (bit % 8)
        records[at] = bytes(record)
    elif attack == "drop":
        if len(records) == 1:
            records.append(records[0])  # nothing to drop: repeat the end marker instead
        else:
            del records[at if at < len(records) - 1 else 0]
    elif attack == "repeat":
        records.insert(at, records[at])
    elif attack == "swap":
        if len(records) < 2 or records[at] == records[(at + 1) % len(records)]:
            records.append(records[0])
        else:
            other = (at + 1) % len(records)
            records[at], records[other] = records[other], records[at]
    elif attack == "after":
        records.append(seal_all(key, [b"x"])[0])
    opener = RecordOpener(bytes(b ^ 0xFF for b in key) if attack == "other_key" else key)
    try:
        for record in records:
            opener.open(record[HEADER_SIZE:])
    except LaneRecordError:
        return
    raise AssertionError(f"a {attack} attack went through")


@given(keys, st.binary(max_size=200))
def test_random_ciphertext_fails_with_the_typed_error(key, garbage):
    opener = RecordOpener(key)
    try:
        opener.open(garbage)
    except LaneRecordError:
        return
    raise AssertionError("random bytes authenticated")


@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_record_headers_are_bounded(header):
    try:
        size = RecordOpener.ciphertext_size(header)
    except LaneRecordError:
        assert not TAG_SIZE <= int.from_bytes(header, "big") <= MAX_RECORD_CIPHERTEXT
    else:
        assert TAG_SIZE <= size <= MAX_RECORD_CIPHERTEXT
