"""CPU cost of progress records bound to peer ids (issue 17.3/17.4) against owner-marker records.

    python benchmarks/benchmark_progress_records.py [--repeats 7] [--number 1000]

Times, per progress record, a node's whole validator chain with the run's progress validators:
before, a ``[owner:...]`` marker subkey signed by an ``Ed25519SignatureValidator`` key (the
baseline); now, the peer id subkey signed with the host's identity key (``PeerRecordValidator``
over ``PROGRESS_KEY_PATTERN``). Both chains carry the run's ``SchemaValidator``. Measured: a
store's ``sign_value``, and a storing node's or reader's ``validate`` + ``strip_value`` of a
record it has not seen (an Ed25519 verification and the schema check). Prints the median of
``--repeats`` runs of ``--number`` records each, in microseconds, and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import timeit

import pydantic

from swarmtrain.dht import (
    BytesWithPublicKey,
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    PeerRecordValidator,
    SchemaValidator,
    generate_private_key,
    serialize,
)
from swarmtrain.optim import LocalProgress
from swarmtrain.optim.progress_records import (
    LocalProgressSchema,
    TrainingProgressSchema,
    progress_record_validator,
)
from swarmtrain.p2p import PeerSigner
from swarmtrain.p2p.identity import generate_identity

PREFIX = "bench"


class _OldSchema(pydantic.BaseModel):
    """The schema as it was: owner markers as subkeys."""

    progress: dict[BytesWithPublicKey, LocalProgressSchema | None]


def _node(signer: PeerSigner, *validators) -> CompositeValidator:
    """A node's chain as ``DHTNode.create`` builds it, plus ``validators``."""
    chain = CompositeValidator(
        [Ed25519SignatureValidator.verifier(), PeerRecordValidator(signer=signer)]
    )
    chain.extend(validators)
    return chain


def chains() -> dict[str, tuple[CompositeValidator, CompositeValidator, bytes]]:
    """name -> (the writer's chain, a reader's chain, the writer's subkey)."""
    result = {}
    old_writer, old_reader = (
        _node(
            PeerSigner(generate_identity()),
            SchemaValidator(_OldSchema, prefix=PREFIX),
            Ed25519SignatureValidator(generate_private_key()),
        )
        for _ in range(2)
    )
    result["owner marker (before)"] = (old_writer, old_reader, old_writer.local_public_key)
    signer = PeerSigner(generate_identity())
    new_writer, new_reader = (
        _node(
            node_signer,
            SchemaValidator(TrainingProgressSchema, prefix=PREFIX),
            progress_record_validator(),
        )
        for node_signer in (signer, PeerSigner(generate_identity()))
    )
    result["peer id (now)"] = (new_writer, new_reader, signer.peer_id)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=1000)
    args = parser.parse_args()
    counter = iter(range(10**9))  # fresh expirations: records no node has seen

    def median_us(fn) -> float:
        times = timeit.repeat(fn, number=args.number, repeat=args.repeats)
        return statistics.median(times) / args.number * 1e6

    print(f"load average: {os.getloadavg()}")
    results: dict[str, tuple[float, float]] = {}
    for name, (writer, reader, subkey) in chains().items():
        value = serialize(LocalProgress(subkey, 3, 120, 55.5, 1e9, False).to_dict())
        key = serialize(f"{PREFIX}_progress")

        def record() -> DHTRecord:
            return DHTRecord(key, serialize(subkey), value, 1e9 + next(counter))  # noqa: B023

        def sign() -> None:
            writer.sign_value(record())  # noqa: B023

        def sign_and_verify() -> None:
            r = record()
            r = dataclasses.replace(r, value=writer.sign_value(r))  # noqa: B023
            assert reader.validate(r)  # noqa: B023
            reader.strip_value(r)  # noqa: B023

        sign_and_verify()
        results[name] = (median_us(sign), median_us(sign_and_verify))
    (base_sign, base_full), (new_sign, new_full) = results.values()
    print(f"{'per progress record':<32} {'sign us':>9} {'sign + verify us':>17}")
    for name, (sign_us, full_us) in results.items():
        print(f"{name:<32} {sign_us:>9.1f} {full_us:>17.1f}")
    sign_ratio, full_ratio = new_sign / base_sign, new_full / base_full
    print(f"{'ratio (now / before)':<32} {sign_ratio:>8.2f}x {full_ratio:>16.2f}x")


if __name__ == "__main__":
    main()
