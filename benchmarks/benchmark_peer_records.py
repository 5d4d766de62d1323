"""CPU cost of per-peer records (issue 17.3): signing and verifying one matchmaking declaration.

    python benchmarks/benchmark_peer_records.py [--repeats 7] [--number 2000]

Times, per record, the node's whole validator chain (``CompositeValidator``: the owner-marker
verifier, which every node ran before, plus ``PeerRecordValidator``) on a matchmaking-sized
declaration: a store's ``sign_value``, a storing node's ``validate`` + ``strip_value`` of a
record it has not seen (an Ed25519 verification) and of one it verified before (a read of
unchanged declarations), against the same chain on an unregistered key (the baseline: what a
declaration cost before). Prints the median of ``--repeats`` runs of ``--number`` records each,
in microseconds, and ratios against the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import timeit

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking import encode_declaration
from swarmtrain.averaging.matchmaking_types import GROUP_KEY_PATTERN, Declaration
from swarmtrain.dht import (
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    PeerRecordValidator,
    serialize,
)
from swarmtrain.p2p import PeerSigner, verify_peer_signature
from swarmtrain.p2p.identity import generate_identity


def node_validator(signer: PeerSigner) -> CompositeValidator:
    """A node's validators as ``DHTNode.create`` builds them, with the matchmaking keys added."""
    validator = CompositeValidator(
        [Ed25519SignatureValidator.verifier(), PeerRecordValidator(signer=signer)]
    )
    validator.extend([PeerRecordValidator([GROUP_KEY_PATTERN])])
    return validator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()

    signer = PeerSigner(generate_identity())
    ours, theirs = node_validator(signer), node_validator(PeerSigner(generate_identity()))
    declaration = Declaration(signer.peer_id, 0.0, True, b"h" * 32, AveragingMode.NODE, 1e8)
    value = serialize(encode_declaration(declaration))

    def record(key: str, expiration: float) -> DHTRecord:
        return DHTRecord(serialize(key), serialize(signer.peer_id), value, expiration)

    counter = iter(range(10**9))  # fresh expirations: records no node has seen

    def sign(key: str) -> None:
        ours.sign_value(record(key, 1e9 + next(counter)))

    def verify_fresh(key: str) -> None:
        r = record(key, 1e9 + next(counter))
        r = dataclasses.replace(r, value=ours.sign_value(r))
        assert theirs.validate(r)
        theirs.strip_value(r)

    seen = dataclasses.replace(record("run.0b", 1.0), value=ours.sign_value(record("run.0b", 1.0)))
    assert theirs.validate(seen)

    def verify_seen(key: str) -> None:
        r = seen if key == "run.0b" else record(key, 1.0)
        assert theirs.validate(r)
        theirs.strip_value(r)

    def median_us(fn, key: str) -> float:
        times = timeit.repeat(lambda: fn(key), number=args.number, repeat=args.repeats)
        return statistics.median(times) / args.number * 1e6

    print(f"load average: {os.getloadavg()}")
    print(f"{'operation':<40} {'baseline us':>12} {'signed us':>10} {'ratio':>7}")
    for name, fn in [
        ("sign (a store)", sign),
        ("sign + verify a new record", verify_fresh),
        ("verify a record seen before (a read)", verify_seen),
    ]:
        base, owned = median_us(fn, "unregistered"), median_us(fn, "run.0b")
        print(f"{name:<40} {base:>12.1f} {owned:>10.1f} {owned / base:>7.1f}x")
    payload = b"p" * 120  # a declaration's signed payload is ~120 bytes
    signature = signer.sign(payload)
    raw_sign = median_us(lambda _: signer.sign(payload), "")
    raw_verify = median_us(lambda _: verify_peer_signature(signer.peer_id, payload, signature), "")
    print(f"raw Ed25519 over the identity key: sign {raw_sign:.1f} us, verify {raw_verify:.1f} us")


if __name__ == "__main__":
    main()
