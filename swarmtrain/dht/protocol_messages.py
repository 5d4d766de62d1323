"""Checks of the DHT's wire messages (:mod:`swarmtrain.dht.protocol`): a store request's
items and a find result's value, each against :class:`DHTProtocolLimits`."""

from __future__ import annotations

import logging
import math

from swarmtrain.p2p import PeerID
from swarmtrain.proto import dht_pb2

from .protocol_types import (
    EXPIRATION_CLOCK_ALLOWANCE,
    DHTProtocolLimits,
    FoundValue,
    MalformedRequestError,
    StoreItem,
)
from .serialization import DHTValueError, check_serialized, check_serialized_subkey
from .storage import DictionaryDHTValue, ValueWithExpiration
from .validation import NO_SUBKEY

__all__ = ["check_serialized_field", "parse_found_value", "parse_store_request"]

# logged as part of DHTProtocol
logger = logging.getLogger("swarmtrain.dht.protocol")


def parse_store_request(
    request: dht_pb2.DHTStoreRequest, limits: DHTProtocolLimits
) -> list[StoreItem]:
    """The items of a store request, each checked against ``limits``.

    :raises MalformedRequestError: any item breaks a limit or is undecodable
    """
    lengths = {
        len(request.keys),
        len(request.subkeys),
        len(request.values),
        len(request.expiration_time),
    }
    if len(lengths) != 1:
        raise MalformedRequestError(
            "keys, subkeys, values and expiration_time must have the same length"
        )
    if len(request.keys) > limits.max_items:
        raise MalformedRequestError(
            f"{len(request.keys)} items in one request, more than {limits.max_items}"
        )
    items = []
    for index, (key, subkey, value, expiration_time) in enumerate(
        zip(
            request.keys,
            request.subkeys,
            request.values,
            request.expiration_time,
            strict=True,
        )
    ):
        check_serialized_field(key, limits.max_key_size, f"keys[{index}]")
        if subkey != NO_SUBKEY:
            check_serialized_field(
                subkey,
                limits.max_subkey_size,
                f"subkeys[{index}]",
                check_serialized_subkey,
            )
        if len(value) > limits.max_signed_value_size:
            raise MalformedRequestError(
                f"values[{index}] is {len(value)} bytes, larger than the limit "
                f"{limits.max_signed_value_size}"
            )
        if not math.isfinite(expiration_time):
            raise MalformedRequestError(f"expiration_time[{index}] is not finite")
        items.append(StoreItem(key, subkey or None, value, expiration_time))
    return items


def check_serialized_field(data: bytes, max_size: int, what: str, check=check_serialized) -> None:
    try:
        check(data, max_size)
    except DHTValueError as e:
        raise MalformedRequestError(f"{what}: {e}") from None


def parse_found_value(
    peer_id: PeerID,
    result: dht_pb2.DHTFindResult,
    now: float,
    limits: DHTProtocolLimits,
    max_expiration_horizon: float | None,
) -> FoundValue | None:
    """The value in a peer's find result, or None if there is none or it is expired, expires
    beyond the horizon, is too large or malformed (not validated yet)."""
    if result.type == dht_pb2.DHTFindResult.NOT_FOUND:
        return None
    if not math.isfinite(result.expiration_time) or result.expiration_time <= now:
        return None
    if (
        max_expiration_horizon is not None
        and result.expiration_time > now + max_expiration_horizon + EXPIRATION_CLOCK_ALLOWANCE
    ):
        logger.debug("%s returned a value expiring beyond the horizon; ignored", peer_id)
        return None
    if result.type == dht_pb2.DHTFindResult.FOUND_REGULAR:
        if len(result.value) > limits.max_signed_value_size:
            logger.warning("%s sent a value over the size limit; ignored", peer_id)
            return None
        return ValueWithExpiration(result.value, result.expiration_time)
    if result.type == dht_pb2.DHTFindResult.FOUND_DICTIONARY:
        try:
            dictionary = DictionaryDHTValue.unpackb(result.value, now)
        except ValueError as e:
            logger.warning("%s sent a malformed dictionary value (%s); ignored", peer_id, e)
            return None
        return ValueWithExpiration(dictionary, result.expiration_time)
    return None
