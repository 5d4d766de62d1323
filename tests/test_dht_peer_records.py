"""PeerRecordValidator without a network: per-peer subkeys signed by the peer's identity key."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair as create_secp256k1_key_pair

from swarmtrain.dht import (
    NO_SUBKEY,
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    PeerRecordValidator,
    deserialize,
    serialize,
)
from swarmtrain.p2p import PeerSigner, verify_peer_signature
from swarmtrain.p2p.identity import generate_identity

KEY = serialize("run.0b01")
PATTERN = re.compile(r"[^.]+\.0b[01]*")


@pytest.fixture(scope="module")
def alice() -> PeerRecordValidator:
    return PeerRecordValidator([PATTERN], signer=PeerSigner(generate_identity()))


@pytest.fixture(scope="module")
def mallory() -> PeerRecordValidator:
    return PeerRecordValidator([PATTERN], signer=PeerSigner(generate_identity()))


def record_of(peer: PeerRecordValidator, value=1.0, expiration=100.0, key=KEY) -> DHTRecord:
    return DHTRecord(key, serialize(peer.peer_id), serialize(value), expiration)


def signed(validator: PeerRecordValidator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_owner_signs_and_everyone_verifies(alice, mallory):
    record = signed(alice, record_of(alice))
    assert record.value != serialize(1.0)
    verifier = PeerRecordValidator([PATTERN])  # no signer: a node that only checks
    for validator in (alice, mallory, verifier):
        assert validator.validate(record)
        assert deserialize(validator.strip_value(record)) == 1.0


def test_wrong_signer_is_rejected(alice, mallory):
    # mallory cannot sign alice's subkey: her validator leaves it unsigned...
    forged = record_of(alice, value=None)
    assert mallory.sign_value(forged) == forged.value
    assert not alice.validate(forged)
    # ... and her own signature appended by hand does not pass either
    own = signed(mallory, record_of(mallory, value=None))
    trailer = own.value[len(serialize(None)) :]
    assert not alice.validate(dataclasses.replace(forged, value=forged.value + trailer))


def test_replay_under_another_subkey_or_key_is_rejected(alice, mallory):
    original = signed(alice, record_of(alice, value=1e308))
    assert alice.validate(original)
    moved_subkey = dataclasses.replace(original, subkey=serialize(mallory.peer_id))
    moved_key = dataclasses.replace(original, key=serialize("run.0b1"))
    extended = dataclasses.replace(original, expiration_time=1e9)
    for record in (moved_subkey, moved_key, extended):
        assert not mallory.validate(record)


def test_plain_value_over_the_dictionary_is_rejected(alice):
    plain = DHTRecord(KEY, NO_SUBKEY, serialize({alice.peer_id: 1.0}), 1e9)
    assert not alice.validate(plain)
    assert alice.sign_value(plain) == plain.value  # nothing to sign: no owner
    assert not alice.validate(dataclasses.replace(plain, value=alice.sign_value(plain)))


def test_tampered_value_or_subkey_that_is_no_peer_id_is_rejected(alice):
    record = signed(alice, record_of(alice, value=1.0))
    head = serialize(1.0)
    tampered = serialize(2.0) + record.value[len(head) :]
    assert len(tampered) == len(record.value)
    assert not alice.validate(dataclasses.replace(record, value=tampered))
    flipped = bytearray(record.value)
    flipped[len(head) + 3] ^= 1  # a bit of the signature
    assert not alice.validate(dataclasses.replace(record, value=bytes(flipped)))
    for value in (b"", serialize(1.0), record.value[:-1], b"\x00" * 80):
        assert not alice.validate(dataclasses.replace(record, value=value))
    for subkey in (serialize("text"), serialize(b""), b"\xc1"):
        assert not alice.validate(dataclasses.replace(record, subkey=subkey))


def test_unregistered_keys_are_untouched(alice):
    record = DHTRecord(serialize("other"), NO_SUBKEY, serialize("x"), 100.0)
    assert alice.validate(record) and alice.sign_value(record) == record.value
    ours = DHTRecord(serialize("other"), serialize(alice.peer_id), serialize("x"), 100.0)
    assert alice.sign_value(ours) == ours.value and alice.strip_value(ours) == ours.value


def test_exact_keys_of_any_type_and_merging(alice):
    exact = PeerRecordValidator([("a", 1)])
    assert exact.is_registered(serialize(("a", 1))) and not exact.is_registered(serialize("a"))
    node_default = PeerRecordValidator(signer=alice._signer)
    assert not node_default.is_registered(KEY)
    assert node_default.merge_with(PeerRecordValidator([PATTERN])) and node_default.merge_with(
        exact
    )
    assert node_default.is_registered(KEY) and node_default.is_registered(serialize(("a", 1)))
    assert node_default.peer_id == alice.peer_id
    assert not node_default.merge_with(Ed25519SignatureValidator())
    with pytest.raises(TypeError):
        PeerRecordValidator([re.compile(rb"bytes")])


def test_composite_with_owner_signatures(alice):
    composite = CompositeValidator(
        [Ed25519SignatureValidator.verifier(), PeerRecordValidator(signer=alice._signer)]
    )
    composite.extend([PeerRecordValidator([PATTERN])])
    assert len(composite.validators) == 2
    record = signed(composite, record_of(alice, value=[1, 2]))
    assert composite.validate(record)
    assert deserialize(composite.strip_value(record)) == [1, 2]


def test_other_key_types_carry_their_public_key():
    signer = PeerSigner(create_secp256k1_key_pair())
    assert signer.public_key  # a hashed peer id: the key travels with the signature
    validator = PeerRecordValidator([PATTERN], signer=signer)
    record = DHTRecord(KEY, serialize(signer.peer_id), serialize("hi"), 100.0)
    good = signed(validator, record)
    assert PeerRecordValidator([PATTERN]).validate(good)
    # another secp256k1 key's public key does not hash to this peer id
    other = PeerSigner(create_secp256k1_key_pair())
    data = b"payload"
    assert verify_peer_signature(signer.peer_id, data, signer.sign(data), signer.public_key)
    assert not verify_peer_signature(signer.peer_id, data, other.sign(data), other.public_key)
    assert not verify_peer_signature(signer.peer_id, data, signer.sign(data))  # key missing
    ed = PeerSigner(generate_identity())
    assert ed.public_key == b""
    assert not verify_peer_signature(ed.peer_id, data, ed.sign(data), signer.public_key)


def test_pickled_validator_verifies_without_the_signer(alice):
    copy = pickle.loads(pickle.dumps(alice))
    assert copy.peer_id is None and copy.is_registered(KEY)
    assert copy.validate(signed(alice, record_of(alice)))


def test_signed_records_are_checked_under_keys_a_node_does_not_know(alice, mallory):
    record = signed(alice, record_of(alice, value="x"))
    unaware = PeerRecordValidator()  # a node that never registered the key
    assert unaware.validate(record) and deserialize(unaware.strip_value(record)) == "x"
    # a forged or moved signature is refused there too; unsigned values pass (key unknown)
    moved = dataclasses.replace(record, subkey=serialize(mallory.peer_id))
    no_peer = dataclasses.replace(record, subkey=NO_SUBKEY)
    assert not unaware.validate(moved) and not unaware.validate(no_peer)
    assert unaware.validate(record_of(mallory, value=None))
