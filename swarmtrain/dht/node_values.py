"""What a :class:`~swarmtrain.dht.node.DHTNode` does with the values a search finds: drop the
records the validators reject, turn them into items to cache, and decode them for the caller
(signatures stripped, dictionaries as ``{subkey: ValueWithExpiration}``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import trio

from .protocol_types import INLINE_VALIDATION_BYTES, FoundValue, MalformedRequestError, StoreItem
from .serialization import deserialize
from .storage import DictionaryDHTValue, ValueWithExpiration, get_dht_time
from .validation import NO_SUBKEY, DHTRecord, RecordValidatorBase

if TYPE_CHECKING:
    from .protocol import DHTProtocol

__all__ = ["cache_items", "decode", "found_bytes", "validated", "validated_off_loop"]


def validated(
    protocol: DHTProtocol, serialized_key: bytes, found: FoundValue | None
) -> FoundValue | None:
    """``found`` without the records the validators reject (None if nothing is left)."""
    if found is None:
        return None
    if isinstance(found.value, DictionaryDHTValue):
        now = get_dht_time()
        valid = DictionaryDHTValue()
        for subkey, item in found.value.items(now):
            if _is_valid(
                protocol, StoreItem(serialized_key, subkey, item.value, item.expiration_time)
            ):
                valid.store(subkey, item.value, item.expiration_time, now)
        if len(valid) == 0:
            return None
        return ValueWithExpiration(valid, valid.latest_expiration_time)
    if _is_valid(protocol, StoreItem(serialized_key, None, found.value, found.expiration_time)):
        return found
    return None


def found_bytes(found: FoundValue | None) -> int:
    """The value (and subkey) bytes of ``found``: what validating it costs, roughly."""
    if found is None:
        return 0
    if isinstance(found.value, DictionaryDHTValue):
        return sum(
            len(subkey) + len(item.value) for subkey, item in found.value.items(get_dht_time())
        )
    return len(found.value)


async def validated_off_loop(
    protocol: DHTProtocol,
    serialized_key: bytes,
    found: FoundValue | None,
) -> FoundValue | None:
    """:func:`validated`, in the node's validation thread (``protocol.validation_limiter``)
    when ``found`` holds more than ``INLINE_VALIDATION_BYTES``, so a large dictionary never
    holds the event loop. ``found`` must be this caller's own object (an answer, or the
    storage's snapshot)."""
    if found_bytes(found) <= INLINE_VALIDATION_BYTES:
        return validated(protocol, serialized_key, found)
    return await trio.to_thread.run_sync(
        validated, protocol, serialized_key, found, limiter=protocol.validation_limiter
    )


def _is_valid(protocol: DHTProtocol, item: StoreItem) -> bool:
    try:
        return protocol.validate_record(item)
    except MalformedRequestError:
        return False


def cache_items(serialized_key: bytes, found: FoundValue) -> list[StoreItem]:
    """The records of ``found`` as items to store in a cache (one per subkey of a dictionary)."""
    if isinstance(found.value, DictionaryDHTValue):
        now = get_dht_time()
        items = [
            StoreItem(serialized_key, subkey, item.value, item.expiration_time)
            for subkey, item in found.value.items(now)
        ]
    else:
        items = [StoreItem(serialized_key, None, found.value, found.expiration_time)]
    return items


def decode(
    record_validator: RecordValidatorBase, serialized_key: bytes, found: FoundValue | None
) -> ValueWithExpiration | None:
    """``found`` as the caller sees it: values deserialized without their signatures."""
    if found is None:
        return None
    if isinstance(found.value, DictionaryDHTValue):
        now = get_dht_time()
        return ValueWithExpiration(
            {
                deserialize(subkey): ValueWithExpiration(
                    _unsigned(record_validator, serialized_key, subkey, item), item.expiration_time
                )
                for subkey, item in found.value.items(now)
            },
            found.expiration_time,
        )
    return ValueWithExpiration(
        _unsigned(
            record_validator, serialized_key, NO_SUBKEY, cast(ValueWithExpiration[bytes], found)
        ),
        found.expiration_time,
    )


def _unsigned(
    record_validator: RecordValidatorBase,
    key: bytes,
    subkey: bytes,
    item: ValueWithExpiration[bytes],
) -> Any:
    record = DHTRecord(key, subkey, item.value, item.expiration_time)
    return deserialize(record_validator.strip_value(record), max_size=None)
