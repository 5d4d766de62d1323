import math

import msgpack
import numpy as np
import pytest

from swarmtrain.dht import (
    MAX_NESTING_DEPTH,
    MAX_VALUE_ELEMENTS,
    MAX_VALUE_SIZE,
    DHTLimitError,
    DHTValueError,
    NestingTooDeepError,
    TooManyElementsError,
    UnsupportedValueTypeError,
    ValueTooLargeError,
    check_serialized,
    deserialize,
    serialize,
)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**63),
        2**64 - 1,
        1.5,
        "text",
        b"\x00bytes",
        [1, "a", None, [2.0, b"x"]],
        {"s": 1, b"b": [1, 2], 7: {"nested": True}},
    ],
)
def test_roundtrip(value):
    assert deserialize(serialize(value)) == value


def test_tuples_become_lists_and_nan_survives():
    assert deserialize(serialize((1, (2, 3)))) == [1, [2, 3]]
    assert math.isnan(deserialize(serialize(float("nan"))))
    assert deserialize(serialize(bytearray(b"ab"))) == b"ab"


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "set"),
        (np.zeros(3), "numpy.ndarray"),
        ([1, {"a": object()}], "object"),
        ({(1, 2): "tuple key"}, "tuple"),
        ({True: 1}, "bool"),
    ],
)
def test_unsupported_types_are_named(value, type_name):
    with pytest.raises(UnsupportedValueTypeError, match=type_name) as info:
        serialize(value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, DHTValueError)


def test_error_names_the_location():
    with pytest.raises(UnsupportedValueTypeError, match=r"value\['a'\]\[1\]"):
        serialize({"a": [1, {2}]})


def test_out_of_range_int_and_deep_nesting():
    with pytest.raises(DHTValueError, match="64 bits"):
        serialize(2**64)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(DHTValueError, match="nested deeper"):
        serialize(deep)
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(DHTValueError):
        serialize(cyclic)


def test_size_limit():
    assert MAX_VALUE_SIZE == 1024 * 1024
    serialize(b"x" * 1000, max_size=1003)
    with pytest.raises(ValueTooLargeError, match="1004 bytes") as info:
        serialize(b"x" * 1001, max_size=1003)
    assert (info.value.size, info.value.max_size) == (1004, 1003)
    with pytest.raises(ValueTooLargeError):
        serialize(b"x" * MAX_VALUE_SIZE)
    assert len(serialize(b"x" * MAX_VALUE_SIZE, max_size=None)) > MAX_VALUE_SIZE
    with pytest.raises(ValueTooLargeError):
        deserialize(b"\xc4\x05hello", max_size=3)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used
        b"\x92\x01",  # truncated array
        b"\x01\x02",  # extra data
        b"\xc4\x05abc",  # truncated bytes
        b"\xdc\x00",  # truncated array header
        b"\x81\x01",  # map without its value
        b"\xa2\xff\xfe",  # invalid UTF-8
        b"\xdd\x00\x00\x10\x00" + b"\xc0" * 10,  # declares more items than there are bytes
        msgpack.packb(msgpack.ExtType(5, b"ext")),
        msgpack.packb(msgpack.Timestamp(1, 0)),
    ],
)
def test_malformed_data(data):
    with pytest.raises(DHTValueError):
        deserialize(data)
    with pytest.raises(DHTValueError):
        check_serialized(data)


def _array_header(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def test_the_audit_bomb_is_refused_at_its_header():
    """Audit 2: 1 MiB holding one array of ~1M empty arrays (depth 2) took 2.2 s to decode."""
    n = MAX_VALUE_SIZE - 8
    bomb = _array_header(n) + b"\x90" * n
    with pytest.raises(TooManyElementsError, match="max_elements") as info:
        deserialize(bomb)
    assert isinstance(info.value, DHTLimitError) and isinstance(info.value, ValueError)
    assert (info.value.limit, info.value.maximum) == ("max_elements", MAX_VALUE_ELEMENTS)


def test_element_budget_is_exact_and_counts_every_object():
    budget = 100
    assert deserialize(serialize({"a": [1, 2]}), max_elements=5) == {"a": [1, 2]}
    with pytest.raises(TooManyElementsError):
        deserialize(serialize({"a": [1, 2]}), max_elements=4)
    # the largest legal value: the root and budget - 1 items, of each cheap kind
    for item in (b"\x90", b"\x80", b"\xc0", b"\xd0\x9c", b"\xa0"):
        legal = b"\xdc" + (budget - 1).to_bytes(2, "big") + item * (budget - 1)
        assert len(deserialize(legal, max_elements=budget)) == budget - 1
        over = b"\xdc" + budget.to_bytes(2, "big") + item * budget
        with pytest.raises(TooManyElementsError):
            deserialize(over, max_elements=budget)
    # containers spread over many levels count the same as one flat array
    nested = serialize([[[0] * 10] * 3] * 3)  # 1 + 3 + 9 + 90 objects
    assert deserialize(nested, max_elements=103)
    with pytest.raises(TooManyElementsError):
        deserialize(nested, max_elements=102)


def test_a_bomb_costs_at_most_the_budget(monkeypatch):
    """Whatever the bytes, the scanner reads at most max_elements objects before raising, and
    msgpack decodes nothing until the scan passed."""
    import swarmtrain.dht.serialization as serialization

    reads = 0
    real_format = serialization._FORMAT

    class CountingFormat:
        def __getitem__(self, byte):
            nonlocal reads
            reads += 1
            return real_format[byte]

    monkeypatch.setattr(serialization, "_FORMAT", CountingFormat())
    monkeypatch.setattr(serialization.msgpack, "unpackb", lambda *a, **k: pytest.fail("decoded"))
    level = b"\xdc" + (1000).to_bytes(2, "big") + b"\x90" * 999  # 999 empties, then a level
    bombs = [
        level * 1000 + b"\x90",  # 1M empty arrays under 1000 levels
        b"\x91" * 100_000 + b"\xc0",  # deep
        b"\xdc\xff\xff" + b"\x80" * 65535,  # 65535 empty maps
        b"\xde\x7f\xff" + b"\x00\x00" * 32767,  # one map of duplicate keys
    ]
    for bomb in bombs:
        reads = 0
        with pytest.raises(DHTLimitError):
            deserialize(bomb, max_size=None)
        assert reads <= MAX_VALUE_ELEMENTS, reads


def test_nesting_limit_on_decode():
    deep = b"\x91" * MAX_NESTING_DEPTH + b"\xc0"
    assert deserialize(deep) is not None
    with pytest.raises(NestingTooDeepError, match="max_depth"):
        deserialize(b"\x91" + deep)
    with pytest.raises(NestingTooDeepError):
        serialize([deserialize(deep)])


@pytest.mark.parametrize("key", [b"\xc0", b"\xc3", b"\xcb" + b"\x00" * 8, b"\x90", b"\x80"])
def test_decoded_map_keys_are_str_bytes_or_int(key):
    with pytest.raises(UnsupportedValueTypeError, match="dict key"):
        deserialize(b"\x81" + key + b"\x01")


def test_serialize_checks_the_same_limits():
    serialize(list(range(MAX_VALUE_ELEMENTS - 1)))
    with pytest.raises(TooManyElementsError) as info:
        serialize(list(range(MAX_VALUE_ELEMENTS)))
    assert info.value.limit == "max_elements"
    assert serialize([0] * 10, max_elements=11) and serialize([0] * 10**5, max_elements=None)
    with pytest.raises(TooManyElementsError):
        serialize({"a": 1, "b": 2}, max_elements=4)
    # what serialize accepts, deserialize accepts with the same limits
    value = {"k": [[1.5, "x", None, b"y"]] * 100, 7: {"n": True}}
    assert deserialize(serialize(value)) == value


@pytest.mark.parametrize(
    "data",
    [
        serialize({"s": "täxt", b"b": [1, -2, 2**63, 1.5, None, True], 7: {"x": b"\xff" * 300}}),
        serialize("x" * 70000, max_size=None),
        serialize([[]] * 100),
        b"\xd9\x02\xc3\x28",  # str8 with invalid UTF-8
        b"\xa1\xff",  # fixstr with invalid UTF-8
        b"\x81\xa1\xff\x01",  # ... as a map key
        b"\xda\x00\x05ab",  # truncated str16
        b"\x91" * 40 + b"\xc0",
        b"\xdc\x40\x00" + b"\xc0" * 16384,
    ],
)
def test_check_serialized_raises_exactly_when_deserialize_does(data):
    try:
        deserialize(data, max_size=None)
    except DHTValueError as e:
        with pytest.raises(type(e)):
            check_serialized(data, max_size=None)
    else:
        check_serialized(data, max_size=None)
