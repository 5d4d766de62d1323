"""Msgpack serialization of DHT keys, subkeys and values, and the bounded decoder of peer data.

Allowed types (checked before packing):

* ``None``, ``bool``, ``int`` (from -2**63 to 2**64 - 1), ``float``, ``str``, ``bytes``
  (``bytearray`` and ``memoryview`` are packed as ``bytes``);
* ``list`` and ``tuple`` (both come back as ``list``);
* ``dict`` whose keys are ``str``, ``bytes`` or ``int`` (not ``bool``).

Anything else (numpy arrays, tensors, sets, custom classes, ...) raises
:class:`UnsupportedValueTypeError`, which names the type and where in the value it was found.

Limits. Every decode of data that came from a peer (DHT values, keys and subkeys, gossip,
matchmaking gather data, state metadata, packed dictionaries) goes through :func:`deserialize`,
which enforces them *while it reads the bytes*, before any Python object is built, so that no
message can cost more than a bounded amount of CPU:

* ``max_size`` bytes of serialized data (default :data:`MAX_VALUE_SIZE`, 1 MiB);
* ``max_elements`` msgpack objects in all (default :data:`MAX_VALUE_ELEMENTS`, 16384); every
  scalar, container, map key and map value counts as one, so ``{"a": [1, 2]}`` has 5;
* :data:`MAX_NESTING_DEPTH` (32) levels of nested containers.

:func:`serialize` checks the same limits, so a value it accepts is accepted by every peer with
the same defaults. Breaking a limit raises a subclass of :class:`DHTLimitError` (a
``ValueError``) that names the limit: :class:`ValueTooLargeError`,
:class:`TooManyElementsError` or :class:`NestingTooDeepError`. Decoding a value that stays
within the limits costs at most ``max_elements`` steps of the scanner plus msgpack's C decoder
on that many objects.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = [
    "MAX_NESTING_DEPTH",
    "MAX_VALUE_ELEMENTS",
    "MAX_VALUE_SIZE",
    "DHTLimitError",
    "DHTValueError",
    "NestingTooDeepError",
    "TooManyElementsError",
    "UnsupportedValueTypeError",
    "ValueTooLargeError",
    "check_serialized",
    "check_serialized_subkey",
    "deserialize",
    "serialize",
]

MAX_VALUE_SIZE = 1024 * 1024  #: default limit on one serialized value, in bytes (1 MiB)
MAX_VALUE_ELEMENTS = 16384  #: default limit on the msgpack objects in one value (see above)
MAX_NESTING_DEPTH = 32  #: containers nested deeper than this are rejected

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


class DHTValueError(ValueError):
    """A key, subkey or value cannot be stored in the DHT."""


class UnsupportedValueTypeError(DHTValueError, TypeError):
    """The value contains an object of a type that the DHT does not serialize."""


class DHTLimitError(DHTValueError):
    """A value breaks one of the limits of the module docstring; :attr:`limit` names it
    (``"max_size"``, ``"max_elements"`` or ``"max_depth"``) and :attr:`maximum` is its value."""

    def __init__(self, message: str, limit: str, maximum: int):
        super().__init__(message)
        self.limit, self.maximum = limit, maximum


class ValueTooLargeError(DHTLimitError):
    """The serialized value is longer than the allowed size (``max_size``)."""

    def __init__(self, size: int, max_size: int):
        super().__init__(
            f"serialized DHT value is {size} bytes, larger than the limit {max_size}",
            "max_size",
            max_size,
        )
        self.size, self.max_size = size, max_size


class TooManyElementsError(DHTLimitError):
    """The value holds more msgpack objects than allowed (``max_elements``)."""

    def __init__(self, max_elements: int, where: str = "value"):
        super().__init__(
            f"{where} has more than {max_elements} elements (limit max_elements)",
            "max_elements",
            max_elements,
        )


class NestingTooDeepError(DHTLimitError):
    """Containers are nested deeper than :data:`MAX_NESTING_DEPTH` (``max_depth``)."""

    def __init__(self, where: str):
        super().__init__(
            f"{where} is nested deeper than {MAX_NESTING_DEPTH} levels (limit max_depth)",
            "max_depth",
            MAX_NESTING_DEPTH,
        )


# ---------------------------------------------------------------------------------------------
# serialize: an iterative type check that builds a location string only when it raises


def _type_name(obj: object) -> str:
    cls = type(obj)
    module = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    return module + cls.__qualname__


_LEAVES = frozenset({type(None), bool, float, str, bytes, bytearray, memoryview})
_KEYS = frozenset({str, bytes})
_SCALARS = (type(None), bool, float, str, bytes, bytearray, memoryview)
_LIST, _DICT, _LEAF, _INT = 0, 1, 2, 3


def _kind(obj: object) -> int | None:
    """Slow path of the type dispatch (subclasses): None for an unsupported object."""
    if isinstance(obj, _SCALARS):
        return _LEAF
    if isinstance(obj, int):
        return _INT
    if isinstance(obj, msgpack.ExtType):
        return None
    if isinstance(obj, (list, tuple)):
        return _LIST
    if isinstance(obj, dict):
        return _DICT
    return None


def _location(trail: tuple | None, step: str = "") -> str:
    """``value[...][...]`` from a linked trail ``(parent_trail, container, child)``."""
    steps = [step]
    while trail is not None:
        trail, container, child = trail
        if isinstance(container, dict):
            steps.append(f"[{child!r}]")
        else:
            index = next(i for i, item in enumerate(container) if item is child)
            steps.append(f"[{index}]")
    return "value" + "".join(reversed(steps))


def _check_object(obj: object, max_elements: int | None) -> None:
    """Raise unless ``obj`` is within the allowed types and limits (module docstring)."""
    if type(obj) in _LEAVES:
        return
    elements = 1
    # (container, depth, trail) where trail locates the container for error messages
    pending: list[tuple[Any, int, tuple | None]] = []

    def visit(item: object, depth: int, trail: tuple | None, step: str) -> None:
        nonlocal elements
        cls = type(item)
        kind = (
            _LEAF
            if cls in _LEAVES
            else _INT
            if cls is int
            else _LIST
            if cls is list or cls is tuple
            else _DICT
            if cls is dict
            else _kind(item)
        )
        if kind == _LEAF:
            return
        if kind == _INT:
            if not _INT_MIN <= item <= _INT_MAX:  # type: ignore[operator]
                raise DHTValueError(
                    f"integer at {_location(trail, step)} does not fit in 64 bits: {item}"
                )
            return
        if kind is None:
            raise UnsupportedValueTypeError(
                f"unsupported type {_type_name(item)} at {_location(trail, step)}; DHT values may "
                f"contain only None, bool, int, float, str, bytes, list, tuple and dict"
            )
        if depth >= MAX_NESTING_DEPTH:
            raise NestingTooDeepError(f"value at {_location(trail, step)}")
        elements += len(item) * (2 if kind == _DICT else 1)  # type: ignore[arg-type]
        if max_elements is not None and elements > max_elements:
            raise TooManyElementsError(max_elements)
        pending.append((item, depth, trail))

    visit(obj, 0, None, "")
    while pending:
        container, depth, trail = pending.pop()
        if isinstance(container, dict):
            for key, item in container.items():
                if type(key) not in _KEYS and (
                    isinstance(key, bool) or not isinstance(key, (str, bytes, int))
                ):
                    raise UnsupportedValueTypeError(
                        f"unsupported dict key type {_type_name(key)} at {_location(trail)} "
                        f"(keys must be str, bytes or int)"
                    )
                if type(key) is not str and type(key) is not bytes:
                    visit(key, depth + 1, trail, f" key {key!r}")
                if type(item) not in _LEAVES:
                    visit(item, depth + 1, (trail, container, key), "")
        else:
            for item in container:
                if type(item) not in _LEAVES:
                    visit(item, depth + 1, (trail, container, item), "")


def serialize(
    obj: Any,
    max_size: int | None = MAX_VALUE_SIZE,
    *,
    max_elements: int | None = MAX_VALUE_ELEMENTS,
) -> bytes:
    """Serialize ``obj`` with msgpack after checking its types and limits (None: no limit).

    :raises UnsupportedValueTypeError: ``obj`` contains a type that is not allowed
    :raises DHTLimitError: the result is longer than ``max_size`` bytes
      (:class:`ValueTooLargeError`), holds more than ``max_elements`` objects
      (:class:`TooManyElementsError`) or is nested too deep (:class:`NestingTooDeepError`)
    :raises DHTValueError: an integer does not fit in 64 bits
    """
    _check_object(obj, max_elements)
    data = msgpack.packb(obj, use_bin_type=True)
    if max_size is not None and len(data) > max_size:
        raise ValueTooLargeError(len(data), max_size)
    return data


# ---------------------------------------------------------------------------------------------
# deserialize: a scan of the msgpack bytes that enforces the limits, then msgpack's C decoder

# what the first byte of an object says: a fixed-size scalar, a str/bin with a length field,
# an array or map (with its count), or something we never accept (ext types, 0xc1); for a
# scalar the third field is 1 for a str (its UTF-8 is checked by check_serialized)
_FIXED, _SIZED, _ARRAY, _MAP, _BAD = range(5)
_FORMAT: list[tuple[int, int, int]] = []  # per first byte: (kind, size or length bytes, count)
for _byte in range(256):
    if _byte <= 0x7F or _byte >= 0xE0 or _byte in (0xC0, 0xC2, 0xC3):  # fixints, nil, bools
        _FORMAT.append((_FIXED, 1, 0))
    elif _byte <= 0x8F:
        _FORMAT.append((_MAP, 0, _byte & 0x0F))
    elif _byte <= 0x9F:
        _FORMAT.append((_ARRAY, 0, _byte & 0x0F))
    elif _byte <= 0xBF:
        _FORMAT.append((_FIXED, 1 + (_byte & 0x1F), 1))  # fixstr
    elif _byte in (0xC4, 0xC5, 0xC6):  # bin 8/16/32
        _FORMAT.append((_SIZED, 1 << (_byte - 0xC4), 0))
    elif _byte in (0xD9, 0xDA, 0xDB):  # str 8/16/32
        _FORMAT.append((_SIZED, 1 << (_byte - 0xD9), 1))
    elif _byte in (0xCA, 0xCB):  # float 32/64
        _FORMAT.append((_FIXED, 5 if _byte == 0xCA else 9, 0))
    elif 0xCC <= _byte <= 0xD3:  # uint 8..64, int 8..64
        _FORMAT.append((_FIXED, 1 + (1 << ((_byte - 0xCC) % 4)), 0))
    elif _byte in (0xDC, 0xDD):
        _FORMAT.append((_ARRAY, 2 if _byte == 0xDC else 4, -1))
    elif _byte in (0xDE, 0xDF):
        _FORMAT.append((_MAP, 2 if _byte == 0xDE else 4, -1))
    else:  # 0xc1 (never used), ext 8/16/32, fixext 1..16
        _FORMAT.append((_BAD, 0, 0))
# first bytes that may start a map key: ints, str and bin (not nil, bools, floats, containers)
_KEY_BYTES = frozenset(
    [*range(0x00, 0x80), *range(0xE0, 0x100), *range(0xA0, 0xC0), *range(0xCC, 0xD4)]
) | {0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB}


def _malformed(reason: str) -> DHTValueError:
    return DHTValueError(f"malformed serialized DHT value: {reason}")


def _check_utf8(data: bytes, start: int, end: int) -> None:
    if end > len(data):
        raise _malformed("truncated data")
    try:
        data[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed(f"a str at offset {start} is not valid UTF-8") from None


def _bad_key(first: int, pos: int) -> UnsupportedValueTypeError:
    return UnsupportedValueTypeError(
        f"unsupported dict key (format byte 0x{first:02x} at offset {pos}); "
        f"keys must be str, bytes or int"
    )


def _scan(data: bytes, max_elements: int, check_utf8: bool) -> None:
    """Walk the msgpack encoding of one object without building it; raise on any limit.

    Elements are counted when a container's header declares them, so a container that would
    break the budget is refused before its items are read."""
    formats, key_bytes, end = _FORMAT, _KEY_BYTES, len(data)
    pos, elements = 0, 1
    remaining, is_map = 1, False  # items left in the open container (at first: the root)
    suspended: list[tuple[int, bool]] = []  # the enclosing containers' (remaining, is_map)
    try:
        while True:
            while remaining:
                remaining -= 1
                first = data[pos]
                kind, size, count = formats[first]
                if kind == _FIXED:
                    if is_map and remaining & 1 and first not in key_bytes:
                        raise _bad_key(first, pos)
                    if count and check_utf8:
                        _check_utf8(data, pos + 1, pos + size)
                    pos += size
                elif kind == _SIZED:
                    start = pos + 1 + size
                    pos = start + int.from_bytes(data[pos + 1 : start], "big")
                    if count and check_utf8:
                        _check_utf8(data, start, pos)
                elif kind == _BAD:
                    raise _malformed(f"format byte 0x{first:02x} at offset {pos} (extension)")
                else:
                    if is_map and remaining & 1:
                        raise _bad_key(first, pos)
                    if count < 0:
                        count = int.from_bytes(data[pos + 1 : pos + 1 + size], "big")
                    pos += 1 + size
                    if kind == _MAP:
                        count *= 2
                    elements += count
                    if elements > max_elements:
                        raise TooManyElementsError(max_elements)
                    if count > end - pos:  # every object takes at least one byte
                        raise _malformed(f"a container at offset {pos} declares too many items")
                    if len(suspended) >= MAX_NESTING_DEPTH:
                        raise NestingTooDeepError(f"a container at offset {pos}")
                    suspended.append((remaining, is_map))
                    remaining, is_map = count, kind == _MAP
            if not suspended:
                break
            remaining, is_map = suspended.pop()
    except IndexError:
        raise _malformed("truncated data") from None
    if pos != end:
        raise _malformed("truncated data" if pos > end else "extra data after the value")


def deserialize(
    data: bytes,
    max_size: int | None = MAX_VALUE_SIZE,
    *,
    max_elements: int = MAX_VALUE_ELEMENTS,
) -> Any:
    """Inverse of :func:`serialize`, bounded for untrusted data (see the module docstring).

    ``max_size=None`` leaves the size to the caller (e.g. a message limit); the element budget
    always applies.

    :raises DHTLimitError: ``data`` breaks ``max_size``, ``max_elements`` or the nesting limit
    :raises UnsupportedValueTypeError: a map key that is not str, bytes or int
    :raises DHTValueError: malformed data (truncated, trailing bytes, extension types, ...)
    """
    if max_size is not None and len(data) > max_size:
        raise ValueTooLargeError(len(data), max_size)
    _scan(data, max_elements, check_utf8=False)  # msgpack checks the UTF-8 itself
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            max_array_len=max_elements,
            max_map_len=max_elements,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # e.g. invalid UTF-8
        raise _malformed(repr(e)) from e


def check_serialized(
    data: bytes,
    max_size: int | None = MAX_VALUE_SIZE,
    *,
    max_elements: int = MAX_VALUE_ELEMENTS,
) -> None:
    """Raise what :func:`deserialize` would raise for ``data``, without building the value
    (no Python objects: for data that is only checked and kept as bytes, e.g. by a DHT node
    storing a record for others)."""
    if max_size is not None and len(data) > max_size:
        raise ValueTooLargeError(len(data), max_size)
    _scan(data, max_elements, check_utf8=True)


def check_serialized_subkey(data: bytes, max_size: int | None = MAX_VALUE_SIZE) -> None:
    """:func:`check_serialized` for a dictionary subkey, which must also be usable as a dict
    key once decoded: None, bool, int, float, str or bytes, not a list or a dict.

    :raises UnsupportedValueTypeError: the subkey is a list or a dict
    """
    check_serialized(data, max_size)
    if _FORMAT[data[0]][0] in (_ARRAY, _MAP):
        raise UnsupportedValueTypeError(
            "a dictionary subkey must be None, bool, int, float, str or bytes, not a container"
        )
