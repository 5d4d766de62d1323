"""Msgpack serialization of DHT keys, subkeys and values.

Allowed types (checked recursively before packing):

* ``None``, ``bool``, ``int`` (from -2**63 to 2**64 - 1), ``float``, ``str``, ``bytes``
  (``bytearray`` and ``memoryview`` are packed as ``bytes``);
* ``list`` and ``tuple`` (both come back as ``list``);
* ``dict`` whose keys are ``str``, ``bytes`` or ``int`` (not ``bool``).

Containers may nest up to :data:`MAX_NESTING_DEPTH` levels. Anything else (numpy arrays,
tensors, sets, custom classes, ...) raises :class:`UnsupportedValueTypeError`, which names the
type and where in the value it was found. A serialized value longer than ``max_size`` (default
:data:`MAX_VALUE_SIZE`) raises :class:`ValueTooLargeError`.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = [
    "MAX_NESTING_DEPTH",
    "MAX_VALUE_SIZE",
    "DHTValueError",
    "UnsupportedValueTypeError",
    "ValueTooLargeError",
    "deserialize",
    "serialize",
]

MAX_VALUE_SIZE = 1024 * 1024  #: default limit on one serialized value, in bytes (1 MiB)
MAX_NESTING_DEPTH = 32  #: containers nested deeper than this are rejected

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SCALARS = (type(None), bool, float, str, bytes, bytearray, memoryview)


class DHTValueError(ValueError):
    """A key, subkey or value cannot be stored in the DHT."""


class UnsupportedValueTypeError(DHTValueError, TypeError):
    """The value contains an object of a type that the DHT does not serialize."""


class ValueTooLargeError(DHTValueError):
    """The serialized value is longer than the allowed size."""

    def __init__(self, size: int, max_size: int):
        super().__init__(f"serialized DHT value is {size} bytes, larger than the limit {max_size}")
        self.size, self.max_size = size, max_size


def _type_name(obj: object) -> str:
    cls = type(obj)
    module = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    return module + cls.__qualname__


def _check(obj: object, path: str, depth: int) -> None:
    if isinstance(obj, _SCALARS):
        return
    if isinstance(obj, int):
        if not _INT_MIN <= obj <= _INT_MAX:
            raise DHTValueError(f"integer at {path} does not fit in 64 bits: {obj}")
        return
    if isinstance(obj, (list, tuple, dict)) and not isinstance(obj, msgpack.ExtType):
        if depth >= MAX_NESTING_DEPTH:
            raise DHTValueError(f"value at {path} is nested deeper than {MAX_NESTING_DEPTH} levels")
        if isinstance(obj, dict):
            for key, item in obj.items():
                if isinstance(key, bool) or not isinstance(key, (str, bytes, int)):
                    raise UnsupportedValueTypeError(
                        f"unsupported dict key type {_type_name(key)} at {path} "
                        f"(keys must be str, bytes or int)"
                    )
                _check(key, f"{path} key {key!r}", depth + 1)
                _check(item, f"{path}[{key!r}]", depth + 1)
        else:
            for index, item in enumerate(obj):
                _check(item, f"{path}[{index}]", depth + 1)
        return
    raise UnsupportedValueTypeError(
        f"unsupported type {_type_name(obj)} at {path}; DHT values may contain only None, bool, "
        f"int, float, str, bytes, list, tuple and dict"
    )


def serialize(obj: Any, max_size: int | None = MAX_VALUE_SIZE) -> bytes:
    """Serialize ``obj`` with msgpack after checking its types (``max_size=None``: no limit).

    :raises UnsupportedValueTypeError: ``obj`` contains a type that is not allowed
    :raises ValueTooLargeError: the result is longer than ``max_size`` bytes
    :raises DHTValueError: an integer does not fit in 64 bits or nesting is too deep
    """
    _check(obj, "value", 0)
    data = msgpack.packb(obj, use_bin_type=True)
    if max_size is not None and len(data) > max_size:
        raise ValueTooLargeError(len(data), max_size)
    return data


def deserialize(data: bytes, max_size: int | None = MAX_VALUE_SIZE) -> Any:
    """Inverse of :func:`serialize`; raises :class:`DHTValueError` on malformed or too long data."""
    if max_size is not None and len(data) > max_size:
        raise ValueTooLargeError(len(data), max_size)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise DHTValueError(f"malformed serialized DHT value: {e!r}") from e
    _check(obj, "value", 0)  # rejects msgpack extension types and over-deep nesting
    return obj
