"""Property tests of the DHT's decoders and validators: values round-trip; any bytes decode or
fail with ``DHTValueError``; ``check_serialized`` agrees with ``deserialize``; validators answer
True or False for any record, never raise."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc

import msgpack
import pydantic
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.dht import (
    NO_SUBKEY,
    BytesWithPublicKey,
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    SchemaValidator,
    serialize,
)
from swarmtrain.dht.serialization import (
    MAX_NESTING_DEPTH,
    DHTLimitError,
    DHTValueError,
    check_serialized,
    deserialize,
)
from swarmtrain.dht.storage import DictionaryDHTValue

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
keys = st.text(max_size=8) | st.binary(max_size=8) | st.integers(-(2**63), 2**64 - 1)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(keys, children, max_size=4)
    ),
    max_leaves=20,
)


def normalized(value):
    """What msgpack gives back: tuples become lists."""
    if isinstance(value, (list, tuple)):
        return [normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    return value


@given(values)
def test_values_round_trip(value):
    data = serialize(value)
    check_serialized(data)
    assert deserialize(data) == normalized(value)


def outcome(function, data: bytes):
    """The exception type a decoder raises for ``data`` (None: it accepted it)."""
    try:
        function(data)
    except DHTValueError as e:
        return type(e)
    return None


def mutated(data: st.DataObject) -> bytes:
    raw = bytearray(serialize(data.draw(values)))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "insert" or not raw:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=3))
        elif op == "flip":
            raw[min(at, len(raw) - 1)] = data.draw(st.integers(0, 255))
        else:
            del raw[at : at + 2]
    return bytes(raw)


@given(st.data())
def test_any_bytes_decode_or_raise_dht_value_error(data):
    """Random and mutated bytes: ``deserialize`` returns a value or raises DHTValueError, and
    ``check_serialized`` accepts exactly what ``deserialize`` accepts."""
    raw = data.draw(st.binary(max_size=64)) if data.draw(st.booleans()) else mutated(data)
    decoded = outcome(deserialize, raw)
    checked = outcome(check_serialized, raw)
    assert (decoded is None) == (checked is None), (raw, decoded, checked)
    if decoded is not None and issubclass(decoded, DHTLimitError):
        assert checked is decoded


@given(st.sampled_from([0xDD, 0xDF, 0xC6, 0xDB]), st.integers(2**20, 2**32 - 1))
def test_declared_sizes_allocate_nothing(first, count):
    """A container or string that declares a million to 4 billion items (8 MiB to 32 GiB as
    Python objects), then ends: refused with a typed error, nothing of that size allocated
    (the bound leaves room for other threads of the test process)."""
    raw = bytes([first]) + count.to_bytes(4, "big") + b"\x00" * 8
    tracemalloc.start()
    try:
        for decoder in (deserialize, check_serialized):
            assert outcome(decoder, raw) is not None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@given(st.integers(MAX_NESTING_DEPTH + 1, 2000))
def test_deep_nesting_is_refused(depth):
    raw = b"\x91" * depth + b"\xc0"
    assert outcome(deserialize, raw) is not None and outcome(check_serialized, raw) is not None


class Schema(pydantic.BaseModel):
    epoch: int
    peers: dict[BytesWithPublicKey, float]
    name: str


OWNER = Ed25519SignatureValidator(Ed25519PrivateKey.from_private_bytes(b"\x02" * 32))
MALLORY = Ed25519SignatureValidator(Ed25519PrivateKey.from_private_bytes(b"\x03" * 32))
VALIDATORS = [
    OWNER,
    SchemaValidator(Schema, allow_extra_keys=False),
    CompositeValidator([SchemaValidator(Schema, prefix="run"), OWNER]),
]

serialized_keys = st.sampled_from(
    [serialize(name) for name in ("epoch", "peers", "name", "run_peers", "other")]
) | st.binary(max_size=12).map(lambda b: serialize(b + OWNER.local_public_key))
serialized_subkeys = st.sampled_from(
    [NO_SUBKEY, serialize(OWNER.local_public_key), serialize(MALLORY.local_public_key)]
) | values.map(serialize)
record_values = values.map(serialize) | st.binary(max_size=40)


@st.composite
def records(draw):
    record = DHTRecord(
        draw(serialized_keys),
        draw(serialized_subkeys),
        draw(record_values),
        draw(st.floats(allow_nan=True, allow_infinity=True)),
    )
    signer = draw(st.sampled_from([None, OWNER, MALLORY]))
    if signer is not None:
        record = dataclasses.replace(record, value=signer.sign_value(record))
    return record


@given(records())
def test_validators_answer_any_record(record):
    for validator in VALIDATORS:
        assert validator.validate(record) in (True, False)
        assert isinstance(validator.strip_value(record), bytes)


@given(records())
def test_only_the_owner_writes_protected_records(record):
    if (
        OWNER.local_public_key in record.key or OWNER.local_public_key in record.subkey
    ) and OWNER.validate(record):
        # a valid protected record carries the owner's signature over exactly these fields
        stripped = OWNER.strip_value(record)
        resigned = OWNER.sign_value(dataclasses.replace(record, value=stripped))
        assert resigned == record.value
        assert MALLORY.sign_value(dataclasses.replace(record, value=stripped)) == stripped


packed_dictionaries = st.lists(
    st.tuples(st.binary(max_size=4), st.binary(max_size=4), st.floats()), max_size=4
).flatmap(
    lambda items: st.floats().map(
        lambda latest: msgpack.packb([latest, [list(item) for item in items]])
    )
)


@given(st.binary(max_size=80) | packed_dictionaries)
def test_packed_dictionaries_decode_or_raise_value_error(raw):
    try:
        value = DictionaryDHTValue.unpackb(raw, now=0.0)
    except ValueError:
        return
    for _, item in value.items(0.0):
        assert isinstance(item.value, bytes) and 0.0 < item.expiration_time < math.inf
    assert not math.isnan(value.latest_expiration_time)
