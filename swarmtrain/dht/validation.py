"""Record validators: owner signatures (Ed25519), pydantic schemas, and their composition.

Every node runs its validators on each record it is asked to store and on each record it
receives in a lookup; invalid records are dropped. A record's fields are all bytes as sent on
the wire: ``key`` is the serialized key (:func:`~swarmtrain.dht.serialization.serialize`),
``subkey`` the serialized subkey or :data:`NO_SUBKEY`, ``value`` the serialized value plus
whatever validators appended (signatures).

Clock skew: a signature covers the expiration time, so nobody can extend or shorten a signed
record; validators never read the clock. Whether a record is already expired is decided by the
storing node's own clock (see :mod:`swarmtrain.dht.storage`).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Iterable
from typing import Any

import base58
import pydantic
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from .serialization import DHTValueError, deserialize, serialize

__all__ = [
    "NO_SUBKEY",
    "BytesWithPublicKey",
    "CompositeValidator",
    "DHTRecord",
    "Ed25519SignatureValidator",
    "RecordValidatorBase",
    "SchemaValidator",
    "generate_private_key",
]

NO_SUBKEY = b""  #: ``DHTRecord.subkey`` of a regular (non-dictionary) value


@dataclasses.dataclass(frozen=True)
class DHTRecord:
    """One record as validators see it (see the module docstring for the field encodings)."""

    key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float

    def __post_init__(self) -> None:
        for name in ("key", "subkey", "value"):
            if not isinstance(getattr(self, name), bytes):
                raise TypeError(f"DHTRecord.{name} must be bytes")
        if isinstance(self.expiration_time, bool) or not isinstance(
            self.expiration_time, (int, float)
        ):
            raise TypeError("DHTRecord.expiration_time must be a number")


class RecordValidatorBase:
    """Checks records (schemas, ownership) and may add data to values (signatures).

    Validators are applied in order of increasing :attr:`priority` when signing and of
    decreasing priority when validating and stripping.
    """

    def validate(self, record: DHTRecord) -> bool:
        """Whether ``record`` (whose value went through :meth:`sign_value`) is acceptable."""
        raise NotImplementedError

    def sign_value(self, record: DHTRecord) -> bytes:
        """``record.value`` with anything this validator adds (e.g. a signature) appended."""
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        """``record.value`` without what :meth:`sign_value` added; called after validation."""
        return record.value

    @property
    def priority(self) -> int:
        """Order of application relative to other validators (see the class docstring)."""
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Absorb ``other`` into ``self`` and return True, or change nothing and return False.

        By default validators are not merged, so a record must pass each of them.
        """
        return False


class CompositeValidator(RecordValidatorBase):
    """Applies several validators in priority order; a record must pass all of them."""

    def __init__(self, validators: Iterable[RecordValidatorBase] = ()):
        self._validators: list[RecordValidatorBase] = []
        self.extend(validators)

    @property
    def validators(self) -> tuple[RecordValidatorBase, ...]:
        """The validators, in increasing priority (signing order)."""
        return tuple(self._validators)

    def extend(self, validators: Iterable[RecordValidatorBase]) -> None:
        """Add validators, merging each into an existing one where it agrees to merge."""
        for new in validators:
            if not any(existing.merge_with(new) for existing in self._validators):
                self._validators.append(new)
        self._validators.sort(key=lambda validator: validator.priority)

    @property
    def local_public_key(self) -> bytes:
        """The owner marker this composite signs with: its signature validator's
        ``local_public_key``. :raises AttributeError: it has no signature validator"""
        for validator in self._validators:
            if isinstance(validator, Ed25519SignatureValidator):
                return validator.local_public_key
        raise AttributeError("this CompositeValidator has no signature validator")

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Merge ``other`` into the member validator that accepts it (a composite: each of its
        validators); False, changing nothing, if no member merges it."""
        if isinstance(other, CompositeValidator):
            self.extend(other.validators)
            return True
        merged = any(existing.merge_with(other) for existing in self._validators)
        self._validators.sort(key=lambda validator: validator.priority)
        return merged

    def validate(self, record: DHTRecord) -> bool:
        for index, validator in enumerate(reversed(self._validators)):
            if not validator.validate(record):
                return False
            if index < len(self._validators) - 1:
                record = dataclasses.replace(record, value=validator.strip_value(record))
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        for validator in self._validators:
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        for validator in reversed(self._validators):
            record = dataclasses.replace(record, value=validator.strip_value(record))
        return record.value


_BASE58 = rb"[1-9A-HJ-NP-Za-km-z]"
_OWNER_RE = re.compile(rb"\[owner:(" + _BASE58 + rb"{32,48})\]")
_SIGNATURE_PREFIX = b"[signature:"
# base64 of a 64-byte signature is 86 characters and "==", then "]" ends the value
_SIGNATURE_RE = re.compile(re.escape(_SIGNATURE_PREFIX) + rb"([A-Za-z0-9+/]{86}==)\]\Z")
_SIGNING_DOMAIN = b"swarmtrain.dht.record.v1"


def _owner_marker(public_key: Ed25519PublicKey) -> bytes:
    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return b"[owner:" + base58.b58encode(raw) + b"]"


def generate_private_key() -> Ed25519PrivateKey:
    """A new Ed25519 key to sign records with (``Ed25519SignatureValidator(key)``,
    ``ProgressTracker(private_key=key)``): hivemind's ``RSAPrivateKey()``."""
    return Ed25519PrivateKey.generate()


_process_key: Ed25519PrivateKey | None = None
_process_key_lock = threading.Lock()


def _process_wide_private_key() -> Ed25519PrivateKey:
    """This process's default signing key, made on first use; a forked child makes its own."""
    global _process_key
    with _process_key_lock:
        if _process_key is None:
            _process_key = Ed25519PrivateKey.generate()
        return _process_key


def _forget_process_key() -> None:
    global _process_key, _process_key_lock
    _process_key, _process_key_lock = None, threading.Lock()  # the parent's lock may be held


os.register_at_fork(after_in_child=_forget_process_key)


class Ed25519SignatureValidator(RecordValidatorBase):
    """Owner-protected records: only the owner of the key named in the key or subkey may write.

    A record is protected if its key or subkey contains ``[owner:<base58 Ed25519 public key>]``
    (:attr:`local_public_key` is this node's marker). A protected value must end with
    ``[signature:<base64>]``, an Ed25519 signature over (key, subkey, value, expiration_time),
    so a record with a modified value or expiration, or one copied to another key or subkey,
    fails validation. :meth:`sign_value` signs only records protected by the local key; a
    record naming another owner is left unsigned and then rejected by every validating node.

    Without ``private_key`` it signs with the process's default key, one per process as in
    hivemind (a forked child makes its own): validators made that way in one process are one
    owner. Pass ``generate_private_key()`` for a distinct identity (swarmtrain's own
    components, e.g. each ``ProgressTracker``, do).
    """

    def __init__(self, private_key: Ed25519PrivateKey | None = None):
        self._node_default = False  # see verifier()
        if private_key is None:
            private_key = _process_wide_private_key()
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError(f"expected an Ed25519PrivateKey, got {type(private_key).__name__}")
        self._private_key = private_key
        self._local_marker = _owner_marker(private_key.public_key())

    @classmethod
    def verifier(cls) -> Ed25519SignatureValidator:
        """The validator every DHT node starts with, to verify (and strip) the signatures of
        records it stores for others. A signature validator added later merges into it and
        its key becomes the one records are signed with."""
        validator = cls(Ed25519PrivateKey.generate())
        validator._node_default = True
        return validator

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (to hand a validator to another process): the private key travels raw."""
        raw = self._private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return {"private_key": raw, "node_default": self._node_default}

    def __setstate__(self, state: dict[str, Any]) -> None:
        Ed25519SignatureValidator.__init__(
            self, Ed25519PrivateKey.from_private_bytes(state["private_key"])
        )
        self._node_default = state["node_default"]

    @property
    def local_public_key(self) -> bytes:
        """``b"[owner:<base58 public key>]"``: put it in a key or subkey to protect the record."""
        return self._local_marker

    @staticmethod
    def _payload(record: DHTRecord, stripped_value: bytes) -> bytes:
        fields = [_SIGNING_DOMAIN, record.key, record.subkey, stripped_value]
        return serialize([*fields, float(record.expiration_time)], max_size=None)

    def validate(self, record: DHTRecord) -> bool:
        owners = set(_OWNER_RE.findall(record.key)) | set(_OWNER_RE.findall(record.subkey))
        if not owners:
            return True  # not protected
        if len(owners) > 1:
            return False  # key and subkey name different owners
        match = _SIGNATURE_RE.search(record.value)
        if match is None:
            return False
        try:
            public_key = Ed25519PublicKey.from_public_bytes(base58.b58decode(owners.pop()))
            signature = base64.b64decode(match.group(1), validate=True)
            public_key.verify(signature, self._payload(record, record.value[: match.start()]))
        except (ValueError, InvalidSignature):
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._local_marker not in record.key and self._local_marker not in record.subkey:
            return record.value
        signature = self._private_key.sign(self._payload(record, record.value))
        return record.value + _SIGNATURE_PREFIX + base64.b64encode(signature) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        match = _SIGNATURE_RE.search(record.value)
        return record.value if match is None else record.value[: match.start()]

    @property
    def priority(self) -> int:
        return 10  # sign after, and validate before, validators that read the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Another signature validator is redundant: keep this one and its key, unless this is
        a node's :meth:`verifier` (then sign with the other's key from now on)."""
        if not isinstance(other, Ed25519SignatureValidator):
            return False
        if self._node_default and not other._node_default:
            self._private_key, self._local_marker = other._private_key, other._local_marker
            self._node_default = False
        return True


def _require_owner_marker(value: bytes) -> bytes:
    if _OWNER_RE.search(value) is None:
        raise ValueError(
            "value must contain an [owner:<base58 Ed25519 public key>] marker, as in "
            "Ed25519SignatureValidator().local_public_key (hivemind's RSA keys do not apply)"
        )
    return value


def _strict_bytes(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    return value


def _is_pydantic_v1_model(schema: Any) -> bool:
    v1 = sys.modules.get("pydantic.v1")  # a v1 model's module imported it
    return v1 is not None and isinstance(schema, type) and issubclass(schema, v1.BaseModel)


class BytesWithPublicKey(bytes):
    """A schema field type: bytes that contain an ``[owner:...]`` marker (e.g. protected
    subkeys). Works in pydantic v2 models and in ``pydantic.v1`` ones (hivemind's schemas)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(
            _require_owner_marker, core_schema.bytes_schema()
        )

    @classmethod
    def __get_validators__(cls):  # pydantic.v1
        yield _strict_bytes
        yield _require_owner_marker


class SchemaValidator(RecordValidatorBase):
    """Checks values of known keys against a pydantic model: each field name is a DHT key.

    A record whose key is ``field_name`` (or ``f"{prefix}_{field_name}"``) must hold a value the
    field's type accepts in pydantic's strict mode (no coercion: ``3.0`` is not an ``int``;
    msgpack returns tuples as lists, so declare ``list`` fields). For a dictionary value the
    field must be a ``dict`` type and each record ``{subkey: value}`` is checked against it.
    Unknown keys pass only if ``allow_extra_keys``. Merged schema validators accept a record
    if any schema defining its key does.

    A regular (subkey-less) value that is a ``dict`` is rejected under every schema key, as in
    hivemind: dictionaries travel one subkey per record. A plain dict would replace all the
    key's subkeys at once, signed ones included, and put unsigned values under other peers'
    ``[owner:...]`` subkeys. So a ``dict[BytesWithPublicKey, ...]`` field is owned per subkey
    with no further validator.

    A ``pydantic.v1`` model (hivemind's schemas) works too: pydantic.v1 has no strict mode, so a
    value passes if its field accepts it unchanged (declare numbers as ``StrictInt`` or
    ``confloat(strict=True)``, as hivemind asks).
    """

    def __init__(
        self,
        schema: type[pydantic.BaseModel],
        prefix: str | None = None,
        allow_extra_keys: bool = True,
    ):
        if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
            names = {name: field.alias or name for name, field in schema.model_fields.items()}
        elif _is_pydantic_v1_model(schema):
            names = {name: name for name in schema.__fields__}
        else:
            raise TypeError(
                f"schema must be a pydantic.BaseModel (or pydantic.v1.BaseModel) subclass, "
                f"got {schema!r}"
            )
        self._fields: dict[bytes, list[tuple[type, str]]] = {}
        for name, lookup_name in names.items():
            raw_key = f"{prefix}_{name}" if prefix is not None else name
            self._fields.setdefault(serialize(raw_key), []).append((schema, lookup_name))
        self._allow_extra_keys = allow_extra_keys

    def validate(self, record: DHTRecord) -> bool:
        fields = self._fields.get(record.key)
        if fields is None:
            return self._allow_extra_keys
        try:
            value: Any = deserialize(record.value)
            if record.subkey != NO_SUBKEY:
                value = {deserialize(record.subkey): value}
            elif isinstance(value, dict):
                return False  # a whole dictionary in one unsigned record (class docstring)
        except (DHTValueError, TypeError):  # TypeError: a subkey that is a list or a dict
            return False
        return any(self._matches(schema, name, value) for schema, name in fields)

    @staticmethod
    def _matches(schema: Any, name: str, value: Any) -> bool:
        if _is_pydantic_v1_model(schema):
            # pydantic.v1 has no strict mode: a value passes if the field accepts it unchanged
            # (declare numbers as StrictInt / confloat(strict=True): 3.0 == 3 in Python)
            parsed, error = schema.__fields__[name].validate(value, {}, loc=name, cls=schema)
            return error is None and parsed == value
        try:
            schema.model_validate({name: value}, strict=True)
        except pydantic.ValidationError as e:
            # other fields are absent by design: only errors about this field count
            return all(
                err["type"] == "missing" and len(err["loc"]) == 1 and err["loc"][0] != name
                for err in e.errors()
            )
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SchemaValidator):
            return False
        for key, fields in other._fields.items():
            known = self._fields.setdefault(key, [])
            known.extend(field for field in fields if field not in known)  # re-adding is a no-op
        self._allow_extra_keys = self._allow_extra_keys or other._allow_extra_keys
        return True
