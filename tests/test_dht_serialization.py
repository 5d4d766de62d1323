import math

import msgpack
import numpy as np
import pytest

from swarmtrain.dht import (
    MAX_VALUE_SIZE,
    DHTValueError,
    UnsupportedValueTypeError,
    ValueTooLargeError,
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
        msgpack.packb(msgpack.ExtType(5, b"ext")),
        msgpack.packb(msgpack.Timestamp(1, 0)),
    ],
)
def test_malformed_data(data):
    with pytest.raises(DHTValueError):
        deserialize(data)
