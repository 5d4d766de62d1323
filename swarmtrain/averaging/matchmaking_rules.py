"""Pure rules of matchmaking: leader choice, group ids, member order, Moshpit group bits."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Iterable, Sequence

from swarmtrain.averaging.allreduce_core import AveragingMode
from swarmtrain.averaging.matchmaking_types import (
    _GROUP_ID_DOMAIN,
    _MOSHPIT_DOMAIN,
    _ORDER_DOMAIN,
    Declaration,
    GroupMember,
    PeerId,
)

# ---------------------------------------------------------------------------------- pure helpers


def _hash(domain: bytes, *parts: bytes) -> bytes:
    h = hashlib.sha256(domain)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def derive_group_id(
    group_key: str,
    leader: PeerId,
    leader_expiration: float,
    peer_ids: Iterable[PeerId],
    nonce: bytes = b"",
) -> bytes:
    """The id of a group (32 bytes): a hash of where, who led, when and with whom.

    Two groups differ in at least one input (a leader assembles once per declaration), so their
    ids differ; the shell passes a random ``nonce`` so that ids stay unique even if a clock
    repeats itself. Members take the id from their leader's BeginAllReduce.
    """
    return _hash(
        _GROUP_ID_DOMAIN,
        group_key.encode(),
        leader,
        struct.pack(">d", leader_expiration),
        nonce,
        *sorted(peer_ids),
    )


def order_members(group_id: bytes, members: Iterable[GroupMember]) -> tuple[GroupMember, ...]:
    """Group order: by a hash of the group id and the peer id (fixed by the id, not chosen by
    the leader, and not the order in which peers joined)."""
    return tuple(
        sorted(members, key=lambda m: (_hash(_ORDER_DOMAIN, group_id, m.peer_id), m.peer_id))
    )


def _next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def next_group_bits(
    group_bits: str,
    group_id: bytes,
    index: int,
    group_size: int,
    target_group_size: int | None = None,
) -> str:
    """Moshpit: the group bits of member ``index`` of a group for the next round.

    The members of a group are sent to distinct *buckets* ``0 .. B-1`` (``B`` is
    ``target_group_size``, or the group size rounded up to a power of two when there is no
    target), picked by a hash of the group id, so every member computes the same assignment.
    The bucket's ``ceil(log2 B)`` bits are shifted in at the end of the group bits and as many
    leading bits drop out. With ``d`` bits and full groups of ``B = 2^b`` peers the swarm is a
    ``2^(d+b)`` grid averaged one axis per round: after ``ceil(d / b) + 1`` rounds every peer
    holds the global mean (groups of 2 with 2 bits: 8 peers in 3 rounds; groups of 4 with 2
    bits: 16 peers in 2 rounds). Without bits there is nothing to rotate.
    """
    if not isinstance(group_bits, str) or any(bit not in "01" for bit in group_bits):
        raise ValueError(f"group_bits must be a string of 0 and 1, got {group_bits!r}")
    if not 0 <= index < group_size:
        raise ValueError(f"index {index} is outside a group of {group_size}")
    num_buckets = _next_power_of_two(group_size) if target_group_size is None else target_group_size
    if num_buckets < group_size:
        raise ValueError(f"a group of {group_size} exceeds target_group_size {num_buckets}")
    nbits = (num_buckets - 1).bit_length()
    if not group_bits or nbits == 0:
        return group_bits
    buckets = sorted(
        range(num_buckets),
        key=lambda b: _hash(_MOSHPIT_DOMAIN, group_id, b.to_bytes(8, "big")),
    )[:group_size]
    new_bits = format(buckets[index], f"0{nbits}b")
    return (group_bits + new_bits)[-len(group_bits) :]


def may_lead(
    leader: PeerId,
    leader_expiration: float,
    joiner: PeerId,
    joiner_expiration: float,
    joiner_mode: AveragingMode = AveragingMode.NODE,
) -> bool:
    """Whether ``leader`` may lead ``joiner``: it has higher priority, a lower
    ``(expiration, peer_id)``. A client never leads, so for a client joiner an expiration no
    later than its own is enough."""
    if joiner_mode == AveragingMode.CLIENT:
        return leader != joiner and leader_expiration <= joiner_expiration
    return (leader_expiration, leader) < (joiner_expiration, joiner)


def leader_candidates(
    declarations: Iterable[Declaration],
    peer_id: PeerId,
    expiration: float,
    schema_hash: bytes,
    now: float,
    exclude: Collection[tuple[PeerId, float]] = (),
    mode: AveragingMode = AveragingMode.NODE,
    legacy_expiration: float | None = None,
) -> list[Declaration]:
    """The peers we may ask to lead us, best first.

    A candidate is looking for a group, still readable (``readable_until > now``), not a client,
    averages our schema (or did not say which: the leader checks), was not tried at this
    expiration (``exclude``) and :func:`may_lead` us. Current declarations (``expiration >
    now``) come first, then late ones (their expiration passed while the DHT read was under
    way: their peers have declared again, if still looking); each by the lowest
    ``(expiration, peer_id)``: the leader everyone converges on. An older peer's (legacy) record
    is compared with ``legacy_expiration`` (our DHT expiration, which it takes for our
    expiration; default ``expiration``).
    """
    as_seen_by_old = expiration if legacy_expiration is None else legacy_expiration
    found = [
        d
        for d in declarations
        if d.peer_id != peer_id
        and d.looking_for_group
        and d.readable_until > now
        and d.mode != AveragingMode.CLIENT
        and d.schema_hash in (schema_hash, b"")
        and may_lead(
            d.peer_id, d.expiration, peer_id, as_seen_by_old if d.legacy else expiration, mode
        )
        and (d.peer_id, d.expiration) not in exclude
    ]
    return sorted(found, key=lambda d: (d.expiration <= now, d.priority))


def _is_viable(members: Sequence[GroupMember]) -> bool:
    """At least one sender (not AUX) and one possible reducer (not CLIENT, bandwidth not 0)."""
    has_sender = any(m.mode != AveragingMode.AUX for m in members)
    has_reducer = any(
        m.mode != AveragingMode.CLIENT and (m.bandwidth is None or m.bandwidth > 0) for m in members
    )
    return has_sender and has_reducer
