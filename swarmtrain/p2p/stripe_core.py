"""Striped data lanes, sans-IO: one byte stream spread over several TCP connections.

On a long, lossy path one TCP flow is slow (about MSS / RTT x 1.22 / sqrt(loss): 0.5 Mbit/s
at 300 ms RTT and 1% loss), while K flows get K times that. A striped lane carries one RPC
stream over K lane connections ("stripes", ``lane_stripes.StripedLane``). Each stripe record's
plaintext is::

    u64 big-endian sequence number | payload (1 to ``record_size`` bytes)

Sequence numbers count the stream's records from 0 over all stripes. The sender hands each
record to whichever stripe can take it now (``StripeSender.choose``), so a stalled flow does
not hold the others; on each stripe the numbers increase. The receiver puts the records back
in order (``StripeReassembler``) in a buffer bounded before it is filled: it reads a stripe
only when that stripe may carry the next record (its last number is below it) or while the
buffer has room, so at most ``window + stripes`` records are ever held. Because each stripe's
numbers increase, a record that is on no stripe is detected as soon as every stripe is past
it. Any breach (a duplicate, a number far ahead, an empty or oversized record, data after a
stripe's end) raises ``LaneStripeError``; the stream fails as a whole, like a reset stream.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator

from swarmtrain.p2p.errors import LaneStripeError

SEQ_SIZE = 8
#: payload bytes per striped record: small, so a record waits on a slow flow for less time
STRIPE_RECORD_SIZE = 128 * 1024
#: the most stripes one lane may have (the stripe index travels in one byte)
MAX_STRIPES = 16
#: a record numbered this far past the next expected one is refused (an honest sender is
#: never more ahead than what K connections' kernel buffers hold: far below this)
MAX_SEQ_LEAD = 1 << 20
#: the rate one lane's stripes together aim for, Mbit/s: a peer's uplink shared by a few
#: partners (20-100 Mbit/s homes and clouds)
STRIPE_TARGET_MBIT = 25.0
MSS_BYTES = 1448  # a segment's payload at MTU 1500 with TCP timestamps


def mathis_mbit(rtt: float, loss: float) -> float:
    """One loss-based TCP flow's steady-state rate, ``MSS / RTT x 1.22 / sqrt(loss)`` (Mathis,
    Semke, Mahdavi, Ott 1997), Mbit/s: 0.47 at 300 ms RTT and 1% loss."""
    return MSS_BYTES * 8 / rtt * 1.22 / math.sqrt(loss) / 1e6


def stripes_for_path(rtt: float | None, loss: float | None, cap: int) -> int:
    """How many stripes to ask for on a path of ``rtt`` seconds losing a ``loss`` share of its
    segments (the libp2p connection's ``TCP_INFO``; None: unknown): enough flows for
    ``STRIPE_TARGET_MBIT`` at the Mathis rate of one flow, at most ``cap``
    (``P2PConfig.lane_stripes``); the cap where either is unknown (a first contact: the lane is
    then reused for long, ``lane_books.lane_reuse_time``). Whether the lane stripes at all is
    decided later, by its first connection's RTT (``lane_stripe_min_rtt``); the callee may
    grant fewer."""
    if cap < 1:
        raise ValueError("the stripe cap is at least 1")
    if rtt is None or rtt <= 0 or loss is None or loss <= 0:
        return cap
    wanted = math.ceil(STRIPE_TARGET_MBIT / mathis_mbit(rtt, min(loss, 1.0)))
    return max(1, min(cap, wanted))


def default_window(stripes: int) -> int:
    """Records the reorder buffer takes from stripes that are ahead (``StripeReassembler``)."""
    return 2 * stripes


class StripeSender:
    """The sending half: cuts data into numbered records and picks a stripe for each."""

    def __init__(self, stripes: int, record_size: int = STRIPE_RECORD_SIZE):
        if not 1 <= stripes <= MAX_STRIPES:
            raise ValueError(f"a striped lane has 1 to {MAX_STRIPES} stripes, got {stripes}")
        if record_size <= 0:
            raise ValueError("record_size must be positive")
        self.stripes, self.record_size = stripes, record_size
        self.next_seq = 0
        self._last_chosen = stripes - 1
        self.records_per_stripe = [0] * stripes

    def frames(self, data) -> Iterator[bytearray]:
        """The records carrying ``data``: sequence number + payload, numbered in order."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.record_size):
            chunk = view[start : start + self.record_size]
            frame = bytearray(SEQ_SIZE + len(chunk))
            frame[:SEQ_SIZE] = self.next_seq.to_bytes(SEQ_SIZE, "big")
            frame[SEQ_SIZE:] = chunk
            self.next_seq += 1
            yield frame

    def choose(self, writable: Collection[int]) -> int | None:
        """The stripe for the next record among those that can take it now (round robin from
        the last one used, so the flows share the work), or None: wait until one can."""
        for step in range(1, self.stripes + 1):
            stripe = (self._last_chosen + step) % self.stripes
            if stripe in writable:
                self._last_chosen = stripe
                self.records_per_stripe[stripe] += 1
                return stripe
        return None


class StripeReassembler:
    """The receiving half: takes each stripe's records, returns the payloads in order.

    ``wanted()`` says which stripes to read next; ``on_record`` / ``on_end`` take what they
    delivered; ``pop()`` returns the next payload in order. Holds at most ``max_buffered``
    records (``window + stripes``), each at most ``max_payload`` bytes."""

    def __init__(
        self,
        stripes: int,
        window: int | None = None,
        max_payload: int = STRIPE_RECORD_SIZE,
        max_lead: int = MAX_SEQ_LEAD,
    ):
        if not 1 <= stripes <= MAX_STRIPES:
            raise ValueError(f"a striped lane has 1 to {MAX_STRIPES} stripes, got {stripes}")
        self.stripes = stripes
        self.window = default_window(stripes) if window is None else window
        if self.window < 0:
            raise ValueError("window must be non-negative")
        self.max_payload, self.max_lead = max_payload, max_lead
        self.max_buffered = self.window + stripes
        self.next_seq = 0
        self._buffer: dict[int, bytes | memoryview] = {}
        self._last: list[int] = [-1] * stripes  # the last number each stripe delivered
        self._ended = [False] * stripes
        self.buffered_bytes = 0
        self.peak_buffered = 0  # records

    @property
    def buffered(self) -> int:
        """Records held out of order."""
        return len(self._buffer)

    def _check_stripe(self, stripe: int) -> None:
        if not 0 <= stripe < self.stripes:
            raise ValueError(f"no stripe {stripe} (of {self.stripes})")
        if self._ended[stripe]:
            raise LaneStripeError(f"stripe {stripe} delivered data after its end")

    def on_record(self, stripe: int, plaintext) -> None:
        """Take one record's plaintext (sequence number + payload) from ``stripe``."""
        self._check_stripe(stripe)
        size = len(plaintext) - SEQ_SIZE
        if size <= 0:
            raise LaneStripeError("a striped record without payload")
        if size > self.max_payload:
            raise LaneStripeError(f"a striped record of {size} bytes (limit {self.max_payload})")
        seq = int.from_bytes(plaintext[:SEQ_SIZE], "big")
        if seq <= self._last[stripe]:
            raise LaneStripeError(
                f"stripe {stripe} went back from record {self._last[stripe]} to {seq}"
            )
        if seq < self.next_seq or seq in self._buffer:
            raise LaneStripeError(f"record {seq} arrived twice")
        if seq - self.next_seq >= self.max_lead:
            raise LaneStripeError(
                f"record {seq} is {seq - self.next_seq} records ahead of the next one "
                f"(limit {self.max_lead})"
            )
        if len(self._buffer) >= self.max_buffered:
            # unreachable while the caller reads only wanted() stripes: a bug, not the peer
            raise RuntimeError("the reorder buffer is full: a stripe was read unasked")
        self._last[stripe] = seq
        self._buffer[seq] = memoryview(plaintext)[SEQ_SIZE:]
        self.buffered_bytes += size
        self.peak_buffered = max(self.peak_buffered, len(self._buffer))

    def on_end(self, stripe: int) -> None:
        """``stripe`` ended cleanly (its end record arrived)."""
        self._check_stripe(stripe)
        self._ended[stripe] = True

    def pop(self):
        """The next payload in order, or None if it has not arrived."""
        payload = self._buffer.pop(self.next_seq, None)
        if payload is not None:
            self.next_seq += 1
            self.buffered_bytes -= len(payload)
        return payload

    @property
    def finished(self) -> bool:
        """Every stripe ended and every record was taken: the clean end of the stream."""
        return all(self._ended) and not self._buffer

    def wanted(self) -> list[int]:
        """Stripes to read now (call when ``pop()`` returned None): those that may carry the
        next record, always; those past it, while the buffer has room. Empty when
        ``finished``. Raises ``LaneStripeError`` when the next record can come from no
        stripe (every stripe is past it or ended)."""
        if self.next_seq in self._buffer:
            return []  # pop() first
        open_stripes = [s for s in range(self.stripes) if not self._ended[s]]
        candidates = [s for s in open_stripes if self._last[s] < self.next_seq]
        if not candidates:
            if not open_stripes and not self._buffer:
                return []  # finished
            raise LaneStripeError(
                f"record {self.next_seq} is missing: every stripe is past it or ended"
            )
        room = self.max_buffered - len(self._buffer) - len(candidates)
        ahead = [s for s in open_stripes if self._last[s] > self.next_seq]
        return candidates + ahead[: max(0, room)]
