"""A lane's connections: dialling one and showing the ticket (caller side), and the callee's
group of a striped lane's connections until all came (a connection's RTT: ``tcp_info``).
How lanes use them is ``lane.py``'s job."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

import trio

from swarmtrain.p2p.lane_records import RecordOpener, RecordSealer
from swarmtrain.p2p.lane_stream import LaneStream

CONNECT_TIMEOUT = 2.0
TCP_CA_NAME_MAX = 16  # bytes of a congestion control's name with its NUL (Linux)
#: ``P2PConfig.lane_congestion``'s default: lane sockets on a long path use
#: ``LONG_PATH_CONGESTION`` where the kernel lets this process set it, others the system's
AUTO_CONGESTION = "auto"
#: random loss does not slow it, and the kernel does not send it back to slow start after an
#: idle gap (``tcp_slow_start_after_idle`` skips congestion controls with their own model)
LONG_PATH_CONGESTION = "bbr"


#: stripes per lane when both ends' sockets on the path use ``LONG_PATH_CONGESTION``: it is
#: not loss-bound, so two flows fill a lossy path, and each further flow adds a tail whose
#: losses cost whole RTTs to recover (benchmarks/RESULTS.md)
LONG_PATH_STRIPES = 2


def long_path_congestion(setting: str | None) -> str | None:
    """The congestion control our lane sockets will use on a long path under the
    ``lane_congestion`` ``setting``: the name it gives; under ``"auto"``
    ``LONG_PATH_CONGESTION`` where this process may set it (probed on a fresh socket), else
    None (the system's)."""
    if setting is None:
        return None
    if setting != AUTO_CONGESTION:
        return setting
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        refused = set_congestion(probe, LONG_PATH_CONGESTION)
    finally:
        probe.close()
    return LONG_PATH_CONGESTION if refused is None else None


def stripes_to_dial(granted: int, ours: str | None, theirs: str | None) -> int:
    """How many of the ``granted`` stripes a caller dials on a long path: fewer
    (``LONG_PATH_STRIPES``) when both ends' sockets there use ``LONG_PATH_CONGESTION``
    (``ours``: ``long_path_congestion``, ``theirs``: the ticket's), all of them otherwise (a
    loss-based control needs many flows: ``stripe_core.stripes_for_path``)."""
    if ours == theirs == LONG_PATH_CONGESTION:
        return max(1, min(granted, LONG_PATH_STRIPES))
    return granted


class LaneSocketOptions:
    """What both ends' methods of ``DataLanes`` (``LaneCallee``, ``LaneCaller``) call to set
    up a lane socket; ``DataLanes`` implements it."""

    @property
    def long_path_congestion(self) -> str | None:
        """The congestion control our lane sockets use on a long path (None: the system's)."""
        raise NotImplementedError

    def _prepare_socket(self, raw: socket.socket) -> None:
        """Socket options of a lane socket (before it connects, or once accepted)."""
        raise NotImplementedError

    def _fit_to_path(self, raw: socket.socket, rtt: float | None) -> None:
        """Options that depend on the connected socket's RTT."""
        raise NotImplementedError


def congestion_for_path(setting: str | None, rtt: float | None, long_path_rtt: float) -> str | None:
    """The congestion control to give a connected lane socket whose RTT is ``rtt`` seconds
    under the ``lane_congestion`` ``setting``: ``LONG_PATH_CONGESTION`` under ``"auto"`` when
    the RTT is known and at least ``long_path_rtt``, else None (leave it as it is; an explicit
    name is set before the socket connects)."""
    if setting != AUTO_CONGESTION or rtt is None or rtt < long_path_rtt:
        return None
    return LONG_PATH_CONGESTION


def stripe_timeout(rtt: float) -> float:
    """The time a striped lane's connection gets for its dial and for its handshake, on a
    path of ``rtt`` seconds: a lost packet costs a one-second retransmission, and with K
    connections over a lossy path one of them often loses one."""
    return CONNECT_TIMEOUT + 4.0 * rtt


def set_congestion(raw: socket.socket, name: str) -> OSError | None:
    """Make ``raw`` use the TCP congestion control ``name`` (Linux ``TCP_CONGESTION``); the
    error where the kernel refuses (not loaded: ENOENT; not in
    ``net.ipv4.tcp_allowed_congestion_control`` for an unprivileged process: EPERM;
    unsupported: the option is missing), else None."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return OSError(f"TCP_CONGESTION is not supported on {sys.platform}")
    try:
        raw.setsockopt(socket.IPPROTO_TCP, option, name.encode())
    except OSError as e:
        return e
    return None


def congestion_of(raw: socket.socket) -> str | None:
    """The TCP congestion control ``raw`` uses (None where the kernel does not say)."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return None
    try:
        name = raw.getsockopt(socket.IPPROTO_TCP, option, TCP_CA_NAME_MAX)
    except OSError:
        return None
    return name.split(b"\0", 1)[0].decode(errors="replace")


async def dial(
    remote_ip: str,
    port: int,
    time_limit: float = CONNECT_TIMEOUT,
    prepare: Callable[[socket.socket], None] | None = None,
) -> tuple[socket.socket, Any]:
    """A TCP connection to ``remote_ip``:``port`` within ``time_limit``: (raw, trio);
    ``prepare(raw)`` runs before the connection opens (socket options)."""
    family = socket.AF_INET6 if ":" in remote_ip else socket.AF_INET
    raw = socket.socket(family, socket.SOCK_STREAM)
    raw.setblocking(False)
    if prepare is not None:
        prepare(raw)
    sock = trio.socket.from_stdlib_socket(raw)
    try:
        with trio.fail_after(time_limit):
            await sock.connect((remote_ip, port))
    except BaseException:
        sock.close()
        raise
    return raw, sock


async def show_ticket(
    connection,
    ticket,
    lanes: list[LaneStream],
    stripe: int = 0,
    count: int | None = None,
    time_limit: float = CONNECT_TIMEOUT,
) -> LaneStream:
    """Show the ticket on ``connection`` (as stripe ``stripe`` of ``count``; None: a plain
    lane) and wait for the callee's accept record; the lane is appended to ``lanes`` as
    soon as it exists (the caller resets them all if any fails)."""
    raw, sock = connection
    lane = LaneStream(
        raw,
        sock,
        RecordSealer(bytes(ticket.caller_key), stripe),
        RecordOpener(bytes(ticket.callee_key), stripe),
    )
    lane.stripe = stripe
    lanes.append(lane)
    hello = bytes(ticket.ticket_id) + (b"" if count is None else bytes([stripe, count]))
    with trio.fail_after(time_limit):
        await lane._send_all(hello)
        await lane.receive_accept()
    return lane


async def dial_stripe(
    remote_ip: str,
    ticket,
    stripe: int,
    count: int,
    lanes,
    time_limit: float = CONNECT_TIMEOUT,
    prepare: Callable[[socket.socket], None] | None = None,
) -> None:
    connection = await dial(remote_ip, ticket.port, time_limit, prepare)
    try:
        await show_ticket(connection, ticket, lanes, stripe, count, time_limit)
    except BaseException:
        connection[1].close()
        raise


class StripeGroup:
    """The connections of one striped lane on the callee, until all ``count`` joined."""

    def __init__(self, count: int):
        self.count = count
        self.lanes: dict[int, LaneStream] = {}
        self.tokens: list[StripeToken] = []
        self.scope = trio.CancelScope()  # the owner's: cancelled when a stripe is taken
        self.complete = trio.Event()
        self.closed = False

    def add(self, stripe: int, lane: LaneStream, token: StripeToken) -> bool:
        """Hand over a connected stripe; False if the group is gone (the caller closes it)."""
        if self.closed or stripe in self.lanes:
            return False
        self.lanes[stripe] = lane
        self.tokens.append(token)
        if len(self.lanes) == self.count:
            self.complete.set()
        return True


class StripeToken:
    """A stripe's entry in the ``LaneBook``: taking it for a newcomer ends the whole lane."""

    __slots__ = ("group",)

    def __init__(self, group: StripeGroup):
        self.group = group

    def cancel(self) -> None:
        self.group.scope.cancel()
