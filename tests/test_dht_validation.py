import dataclasses
import multiprocessing
import os
from typing import Any

import pydantic
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmtrain.dht import (
    NO_SUBKEY,
    BytesWithPublicKey,
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    RecordValidatorBase,
    SchemaValidator,
    serialize,
)


def signed(validator: RecordValidatorBase, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


@pytest.fixture(scope="module")
def owner() -> Ed25519SignatureValidator:
    return Ed25519SignatureValidator(Ed25519PrivateKey.from_private_bytes(b"\x01" * 32))


@pytest.fixture(scope="module")
def mallory() -> Ed25519SignatureValidator:
    return Ed25519SignatureValidator(Ed25519PrivateKey.generate())


def protected_records(owner: Ed25519SignatureValidator) -> list[DHTRecord]:
    marker = owner.local_public_key
    return [
        DHTRecord(serialize(b"key" + marker), NO_SUBKEY, serialize("value"), 100.0),
        DHTRecord(serialize("key"), serialize(b"peer" + marker), serialize([1, 2]), 100.0),
        DHTRecord(serialize("key" + marker.decode()), serialize(marker), serialize(None), 100),
    ]


def test_record_types_are_checked():
    with pytest.raises(TypeError, match="key"):
        DHTRecord("key", NO_SUBKEY, b"v", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expiration_time"):
        DHTRecord(b"k", NO_SUBKEY, b"v", "soon")  # type: ignore[arg-type]


def test_unprotected_records_are_untouched(owner, mallory):
    record = DHTRecord(serialize("key"), serialize("subkey"), serialize("value"), 100.0)
    assert owner.sign_value(record) == record.value
    assert mallory.validate(record) and owner.strip_value(record) == record.value


def test_owner_can_write(owner, mallory):
    assert owner.local_public_key.startswith(b"[owner:") and owner.local_public_key.endswith(b"]")
    for record in protected_records(owner):
        signed_record = signed(owner, record)
        assert signed_record.value != record.value
        assert owner.validate(signed_record) and mallory.validate(signed_record)
        assert mallory.strip_value(signed_record) == record.value
        assert not owner.validate(record)  # unsigned


def test_third_party_cannot_overwrite(owner, mallory):
    for record in protected_records(owner):
        forged = dataclasses.replace(record, value=serialize("mallory's value"))
        assert mallory.sign_value(forged) == forged.value  # cannot sign for another owner
        assert not owner.validate(forged)
        # a signature made with another key does not pass either
        mallory_signed = signed(
            mallory, dataclasses.replace(forged, subkey=mallory.local_public_key)
        )
        assert not owner.validate(dataclasses.replace(mallory_signed, subkey=forged.subkey))


def test_tampered_or_replayed_records_are_rejected(owner):
    for record in protected_records(owner):
        good = signed(owner, record)
        stripped = owner.strip_value(good)
        tampered = [
            dataclasses.replace(good, value=serialize("other") + good.value[len(stripped) :]),
            dataclasses.replace(good, expiration_time=good.expiration_time + 1),  # replay, later
            # copied to another protected subkey of the same owner
            dataclasses.replace(good, subkey=serialize(b"other" + owner.local_public_key)),
            dataclasses.replace(good, value=good.value[:-3] + b"AA]"),  # corrupt signature
            dataclasses.replace(good, value=good.value + b" "),  # signature no longer last
        ]
        for bad in tampered:
            assert not owner.validate(bad), bad
    # protected key and subkey naming two different owners
    other = Ed25519SignatureValidator(Ed25519PrivateKey.generate()).local_public_key
    mixed = DHTRecord(serialize(owner.local_public_key), serialize(other), b"\xc0", 100.0)
    assert not owner.validate(signed(owner, mixed))


def test_int_and_float_expirations_sign_alike(owner):
    record = protected_records(owner)[0]
    as_int = dataclasses.replace(record, expiration_time=100)
    assert owner.validate(dataclasses.replace(signed(owner, as_int), expiration_time=100.0))


class PeerSchema(pydantic.BaseModel):
    epoch: pydantic.StrictInt
    peers: dict[BytesWithPublicKey, pydantic.confloat(ge=0)]  # type: ignore[valid-type]
    names: list[str] = []


def schema_record(key, value, subkey=None) -> DHTRecord:
    subkey_bytes = NO_SUBKEY if subkey is None else serialize(subkey)
    return DHTRecord(serialize(key), subkey_bytes, serialize(value), 100.0)


def test_schema_accepts_and_rejects_types(owner):
    validator = SchemaValidator(PeerSchema, allow_extra_keys=False)
    assert validator.validate(schema_record("epoch", 5))
    assert validator.validate(schema_record("names", ["a", "b"]))
    assert validator.validate(schema_record("peers", 1.5, subkey=owner.local_public_key))
    bad = [
        # a whole dictionary as one regular value (hivemind refuses it too): it would replace
        # every signed subkey and plant an unsigned value under the owner's marker
        schema_record("peers", {owner.local_public_key: 2.0}),
        schema_record("peers", {}),
        schema_record("epoch", "5"),
        schema_record("epoch", 5.0),  # no coercion
        schema_record("epoch", True),
        schema_record("names", [1]),
        schema_record("peers", -1.0, subkey=owner.local_public_key),  # constraint
        schema_record("peers", 1.0, subkey=b"no marker"),
        schema_record("peers", 1.0, subkey="str subkey"),
        schema_record("epoch", 5, subkey=b"x"),  # a subkey on a non-dict field
        schema_record("unknown", 1),  # extra keys not allowed
        DHTRecord(serialize("epoch"), NO_SUBKEY, b"\xc1", 100.0),  # malformed
    ]
    for record in bad:
        assert not validator.validate(record), record


def test_schema_prefix_and_extra_keys():
    validator = SchemaValidator(PeerSchema, prefix="run1")
    assert validator.validate(schema_record("run1_epoch", 1))
    assert not validator.validate(schema_record("run1_epoch", "x"))
    assert validator.validate(schema_record("epoch", "x"))  # not a schema key: extra, allowed
    with pytest.raises(TypeError, match="BaseModel"):
        SchemaValidator(dict)  # type: ignore[arg-type]


def test_merged_schemas_accept_either():
    class A(pydantic.BaseModel):
        shared: pydantic.StrictInt
        only_a: str

    class B(pydantic.BaseModel):
        shared: str

    composite = CompositeValidator(
        [SchemaValidator(A, allow_extra_keys=False), SchemaValidator(B, allow_extra_keys=False)]
    )
    assert len(composite.validators) == 1
    for value in (1, "one"):
        assert composite.validate(schema_record("shared", value))
    assert not composite.validate(schema_record("shared", 1.5))
    assert composite.validate(schema_record("only_a", "x"))
    assert not composite.validate(schema_record("unknown", "x"))


class LoggingValidator(RecordValidatorBase):
    def __init__(self, name: str, priority: int, log: list):
        self.name, self._priority, self.log = name, priority, log

    @property
    def priority(self) -> int:
        return self._priority

    def validate(self, record):
        self.log.append(("validate", self.name, record.value))
        return record.value.endswith(f"<{self.name}>".encode())

    def sign_value(self, record):
        self.log.append(("sign", self.name, record.value))
        return record.value + f"<{self.name}>".encode()

    def strip_value(self, record):
        self.log.append(("strip", self.name, record.value))
        return record.value.removesuffix(f"<{self.name}>".encode())


def test_composite_ordering():
    log: list = []
    composite = CompositeValidator([LoggingValidator("high", 10, log)])
    composite.extend([LoggingValidator("low", -5, log), LoggingValidator("mid", 0, log)])
    assert [v.name for v in composite.validators] == ["low", "mid", "high"]
    record = DHTRecord(b"k", NO_SUBKEY, b"v", 1.0)

    signed_record = signed(composite, record)
    assert signed_record.value == b"v<low><mid><high>"
    assert log == [
        ("sign", "low", b"v"),
        ("sign", "mid", b"v<low>"),
        ("sign", "high", b"v<low><mid>"),
    ]

    log.clear()
    assert composite.validate(signed_record)
    assert [(op, name) for op, name, _ in log] == [
        ("validate", "high"),
        ("strip", "high"),
        ("validate", "mid"),
        ("strip", "mid"),
        ("validate", "low"),
    ]
    assert composite.strip_value(signed_record) == b"v"

    log.clear()
    assert not composite.validate(dataclasses.replace(signed_record, value=b"v<low><high>"))
    assert [(op, name) for op, name, _ in log] == [
        ("validate", "high"),
        ("strip", "high"),
        ("validate", "mid"),
    ]


def test_composite_with_signature_and_schema(owner):
    composite = CompositeValidator([SchemaValidator(PeerSchema), owner])
    composite.extend([Ed25519SignatureValidator()])  # merged into the first signature validator
    assert [type(v) for v in composite.validators] == [SchemaValidator, Ed25519SignatureValidator]

    record = schema_record("peers", 3.0, subkey=owner.local_public_key)
    signed_record = signed(composite, record)
    assert composite.validate(signed_record)
    assert composite.strip_value(signed_record) == record.value
    # the schema sees the value without the signature; a bad value fails even when signed
    bad = signed(composite, schema_record("peers", "x", subkey=owner.local_public_key))
    assert owner.validate(bad) and not composite.validate(bad)
    assert not composite.validate(record)  # unsigned protected record


def test_plain_dict_values_are_refused_under_schema_keys(owner):
    """As hivemind's SchemaValidator: a dictionary field takes one record per subkey, and no
    schema key takes a whole dict as one regular value (it would replace every subkey)."""

    class Schema(pydantic.BaseModel):
        n_batches: dict[bytes, pydantic.StrictInt]
        anything: Any = None

    validator = SchemaValidator(Schema)
    assert validator.validate(schema_record("n_batches", 777, subkey=b"uid1"))
    assert not validator.validate(schema_record("n_batches", {b"uid3": 779}))
    assert not validator.validate(schema_record("n_batches", 666))
    assert validator.validate(schema_record("anything", [1, {"nested": 2}]))
    assert not validator.validate(schema_record("anything", {"a": 1}))
    assert validator.validate(schema_record("other", {"a": 1}))  # not a schema key


def test_progress_schema_alone_protects_the_progress_key(owner):
    from swarmtrain.optim.progress_records import TrainingProgressSchema

    validator = CompositeValidator([SchemaValidator(TrainingProgressSchema, prefix="run"), owner])
    record = {
        "peer_id": b"p",
        "epoch": 1,
        "samples_accumulated": 2,
        "samples_per_second": 1.0,
        "time": 5.0,
        "client_mode": False,
    }
    honest = DHTRecord(
        serialize("run_progress"), serialize(owner.local_public_key), serialize(record), 100.0
    )
    assert validator.validate(signed(validator, honest))
    for plain in ({owner.local_public_key: record}, {owner.local_public_key: None}, "wiped"):
        forged = DHTRecord(serialize("run_progress"), NO_SUBKEY, serialize(plain), 100.0)
        assert not validator.validate(signed(validator, forged)), plain


def test_validators_made_without_a_key_sign_as_one_owner_per_process():
    first, second = Ed25519SignatureValidator(), Ed25519SignatureValidator()
    assert first.local_public_key == second.local_public_key  # hivemind's cached key
    record = DHTRecord(serialize(b"k"), serialize(b"s" + first.local_public_key), b"\xc0", 100.0)
    assert second.validate(signed(first, record))
    assert first.sign_value(record) == second.sign_value(record)
    # a key of one's own: a distinct owner, whose records the default key cannot sign
    own = Ed25519SignatureValidator(Ed25519PrivateKey.generate())
    assert own.local_public_key != first.local_public_key
    theirs = dataclasses.replace(record, subkey=serialize(b"s" + own.local_public_key))
    assert first.sign_value(theirs) == theirs.value
    assert not own.validate(dataclasses.replace(theirs, value=signed(first, record).value))
    # a DHT node's own verifier is not the process's default owner
    assert Ed25519SignatureValidator.verifier().local_public_key != first.local_public_key


def _default_marker_in_child(connection) -> None:
    connection.send(Ed25519SignatureValidator().local_public_key)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_has_a_default_key_of_its_own():
    parent_marker = Ed25519SignatureValidator().local_public_key  # made before the fork
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_default_marker_in_child, args=(sender,))
    child.start()
    try:
        assert receiver.poll(30)
        child_marker = receiver.recv()
    finally:
        child.join(30)
        receiver.close()
        sender.close()
    assert child.exitcode == 0
    assert child_marker != parent_marker
    assert Ed25519SignatureValidator().local_public_key == parent_marker
