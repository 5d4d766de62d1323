"""Direct data lanes: bulk RPCs over a plain TCP connection, encrypted, beside libp2p.

py-libp2p's Noise + yamux path costs Python work per 64 KiB (see benchmarks/RESULTS.md), which
caps a stream at ~10-20% of raw TCP. A lane moves one RPC stream's bytes over its own TCP
connection in 1 MiB AES-256-GCM records (``lane_records``) instead:

1. the caller asks the callee for a ticket over their libp2p connection (Noise authenticates
   both peers and encrypts the ticket: a random id and one fresh key per direction);
2. it dials ``port`` on the IP its direct libp2p connection to the callee comes from and sends
   the ticket id; the callee answers with an encrypted "ok" record, which proves it holds the
   keys, and then serves RPC calls on the lane exactly as on a libp2p stream, attributed to
   the peer the ticket was issued to.

On a long path (the first connection's kernel RTT >= ``stripe_min_rtt``) a lane spreads
over several connections of one ticket (``stripe_core``, ``lane_stripes.StripedLane``): the
caller asks for ``stripes``, the callee grants what its lane limits leave, and each
connection shows the ticket id with its stripe index and count.

A ticket is single-use (one connection per granted stripe) and expires after ``TICKET_TTL``.
Only ``bulk=True`` calls use lanes, and every failure to get one (no direct connection,
relayed peers, callees behind NAT or in client mode, a firewall, an old peer without the
ticket method) falls back to the libp2p stream. A peer whose lane failed is not tried again
for a while: ``RETRY_FIRST`` seconds after a first failure, doubling up to ``RETRY_AFTER``
while they go on (a success forgets them); a callee that offers no lanes is asked again
after ``RETRY_AFTER``.

Limits (``ResourceLimits``): a peer holds at most ``max_lanes_per_peer`` lanes and tickets
at once (more: the ticket call fails with ``ResourceLimitError`` and its bulk calls use
libp2p) and ``max_tickets_per_peer`` unredeemed tickets (its oldest is dropped); the book
of all tickets drops from the peer holding the most when full, so nobody's flood of
tickets stops others from getting one. The host holds at most ``max_lanes_total`` lanes (one
file descriptor each; at most half the soft ``ulimit -n``): when all are open, a new lane
takes the place of a stale idle one (``lane_books.LaneBook``: idle longer than the gaps in a
round, past its caller's reuse window first, else idle the longest; a caller that reused it
meanwhile is told nothing was served, ``NOT_SERVED``, and sends the call again), else it is
refused and its caller goes over libp2p, asking again after ``RETRY_BUSY``. Idle lanes wait
for their caller's next call for minutes (``LANE_IDLE_TIMEOUT``, granted in the ticket; older
peers: a libp2p stream's 30 s), so a lane outlives the gaps between slow rounds. Connections
that have not shown a ticket are capped per source IP and in all (the oldest is closed for a
new one), and closed after ``HANDSHAKE_TIMEOUT``, so silent sockets cannot keep an honest
caller out.

``DataLanes`` holds a host's lane state and socket options; its callee's methods are in
``lane_callee`` (tickets, accepting, serving) and its caller's in ``lane_caller`` (opening a
lane for a call, how long it waits and reuses it).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Sequence

import trio

from swarmtrain.p2p.errors import AddressInUseError
from swarmtrain.p2p.lane_books import HANDSHAKE_TIMEOUT as HANDSHAKE_TIMEOUT
from swarmtrain.p2p.lane_books import (
    LANE_IDLE_TIMEOUT,
    MAX_PENDING_HANDSHAKES,
    TICKET_METHOD,
    LaneBook,
    PendingHandshakes,
    TicketBook,
)
from swarmtrain.p2p.lane_books import LANE_VERSION as LANE_VERSION
from swarmtrain.p2p.lane_callee import LaneCallee
from swarmtrain.p2p.lane_caller import KNOWN_PEER_WAIT as KNOWN_PEER_WAIT
from swarmtrain.p2p.lane_caller import OPEN_WAIT as OPEN_WAIT
from swarmtrain.p2p.lane_caller import LaneCaller
from swarmtrain.p2p.lane_connections import (
    AUTO_CONGESTION,
    StripeGroup,
    congestion_for_path,
    long_path_congestion,
    set_congestion,
)
from swarmtrain.p2p.lane_connections import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from swarmtrain.p2p.lane_stream import LaneStream as LaneStream
from swarmtrain.p2p.lane_stripes import StripedLane as StripedLane
from swarmtrain.p2p.limits import ResourceLimits, fd_soft_limit, lanes_within_fd_limit
from swarmtrain.p2p.rpc import CALLER_STREAM_REUSE_TIME
from swarmtrain.p2p.stripe_core import MAX_STRIPES
from swarmtrain.p2p.tcp_info import tcp_rtt as tcp_rtt
from swarmtrain.proto import p2p_pb2

logger = logging.getLogger(__name__)

#: the most connections per lane on a long path (P2PConfig.lane_stripes; how many: chosen per
#: path, ``stripe_core.stripes_for_path``); half the default ``max_lanes_per_peer``, so a peer
#: may hold two striped lanes to a callee at once
DEFAULT_STRIPES = 8
DEFAULT_STRIPE_MIN_RTT = 0.01  # s: stripe when the lane's TCP RTT is at least this
# on a full host, an idle lane may be taken for a newcomer once it sat idle this long (longer
# than the gaps between the calls of one round); its caller may still reuse it: a call sent
# on it meanwhile gets NOT_SERVED and goes again over another stream (``LaneBook``)
STALE_LANE_AFTER = CALLER_STREAM_REUSE_TIME + 1.0


class DataLanes(LaneCallee, LaneCaller):
    """Both ends of the lanes of one ``P2P`` host: the listener + ticket handler (unless the
    host is in client mode) and ``open(peer_id)`` for callers."""

    def __init__(
        self,
        p2p,
        listen_host: str | None,
        port: int = 0,
        limits: ResourceLimits | None = None,
        stripes: int = DEFAULT_STRIPES,
        stripe_min_rtt: float = DEFAULT_STRIPE_MIN_RTT,
        congestion: str | None = AUTO_CONGESTION,
        idle_timeout: float = LANE_IDLE_TIMEOUT,
    ):
        """``stripes``: the most connections one of our lanes spreads over (1: plain
        lanes), used when the first connection's TCP RTT is at least ``stripe_min_rtt``
        seconds; the callee may grant fewer (``stripe_core``). ``congestion``: the TCP
        congestion control of our lane sockets, the ones we dial and the ones we accept
        (None: the system's default; ``"auto"``: ``LONG_PATH_CONGESTION`` on a long path, RTT
        >= ``stripe_min_rtt``; where the kernel refuses it, logged once). ``idle_timeout``: how
        long a lane waits for its caller's next call, at most (each side's: the callee grants
        the smaller of both in the ticket; an older peer's lanes keep the server's stream idle
        timeout, 30 s)."""
        if not 1 <= stripes <= MAX_STRIPES:
            raise ValueError(f"lane stripes must be in 1..{MAX_STRIPES}, got {stripes}")
        limits = limits if limits is not None else ResourceLimits()
        self.stripes, self.stripe_min_rtt = stripes, stripe_min_rtt
        self.congestion = congestion
        self.idle_timeout = idle_timeout
        self._congestion_refused = False
        self._long_path_congestion = long_path_congestion(congestion)
        self._p2p = p2p
        self._listen_host = listen_host
        self._port = port
        self._listener: trio.socket.SocketType | None = None
        self.tickets = TicketBook(per_peer=limits.max_tickets_per_peer)
        total = lanes_within_fd_limit(limits.max_lanes_total, fd_soft_limit())
        if total < limits.max_lanes_total:
            logger.info(
                "data lanes capped at %d (half the soft limit on open files, ulimit -n; "
                "max_lanes_total=%d)",
                total,
                limits.max_lanes_total,
            )
        self.open_lanes = LaneBook(total, limits.max_lanes_per_peer, STALE_LANE_AFTER)
        self._failed_until: dict[object, float] = {}
        self._failures: dict[object, int] = {}  # failed lanes in a row, per peer
        # peers whose last lane attempt worked (most recent last): a call to them waits
        # for a new lane rather than go over libp2p, which on a long lossy path is far slower
        self._lanes_worked: OrderedDict[object, None] = OrderedDict()
        self._opening: set[object] = set()
        # the idle timeout the callee granted in its last ticket to each peer (popped by
        # _open_or_remember; absent: an older callee)
        self._idle_granted: dict[object, float] = {}
        self.pending_handshakes = PendingHandshakes(
            MAX_PENDING_HANDSHAKES, limits.max_pending_handshakes_per_ip
        )
        self._forming: dict[bytes, StripeGroup] = {}  # striped lanes waiting for stripes
        self.lanes_opened = 0
        self.lanes_accepted = 0
        self.striped_lanes_opened = 0
        self.striped_lanes_accepted = 0
        self.fallbacks = 0

    def _prepare_socket(self, raw: socket.socket) -> None:
        """Socket options of a lane socket (before it connects, or once accepted)."""
        if self.congestion in (None, AUTO_CONGESTION) or self._congestion_refused:
            return
        error = set_congestion(raw, self.congestion)
        if error is not None:
            self._congestion_refused = True  # once: the next sockets keep the default
            logger.warning(
                "lane congestion control %r refused (%s): lanes keep the system's default",
                self.congestion,
                error,
            )

    @property
    def long_path_congestion(self) -> str | None:
        """The congestion control our lane sockets use on a long path (None: the system's)."""
        return None if self._congestion_refused else self._long_path_congestion

    def _fit_to_path(self, raw: socket.socket, rtt: float | None) -> None:
        """Under ``lane_congestion="auto"``, a connected lane socket on a long path (``rtt`` >=
        ``stripe_min_rtt``) gets ``LONG_PATH_CONGESTION``; where the kernel refuses, that is
        logged once and lanes keep the system's default."""
        name = congestion_for_path(self.congestion, rtt, self.stripe_min_rtt)
        if name is None or self._congestion_refused:
            return
        error = set_congestion(raw, name)
        if error is not None:
            self._congestion_refused = True
            logger.info(
                "lanes on long paths would use %s congestion control, which random loss and "
                "idle gaps do not slow; the kernel refused it (%s), so they keep the system's "
                "default. To allow it: modprobe tcp_bbr and add %s to "
                "net.ipv4.tcp_allowed_congestion_control; lane_congestion=None silences this",
                name,
                error,
                name,
            )

    async def start(self, nursery: trio.Nursery) -> None:
        """Listen (when ``listen_host`` is set) and serve tickets; runs until the nursery ends."""
        if self._listen_host is None:
            return
        family = socket.AF_INET6 if ":" in self._listen_host else socket.AF_INET
        listener = trio.socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            await listener.bind((self._listen_host, self._port))
        except OSError as e:
            listener.close()
            if e.errno == errno.EADDRINUSE:
                where = f"{self._listen_host} port {self._port} (data lanes)"
                raise AddressInUseError(where) from None
            raise
        listener.listen(128)
        self._listener = listener
        self._p2p.add_protobuf_handler(TICKET_METHOD, self._issue_ticket, p2p_pb2.LaneTicketRequest)
        nursery.start_soon(self._accept_loop, listener)


def lanes_disabled_by_env() -> bool:
    """``SWARMTRAIN_DISABLE_DATA_LANES=1`` turns lanes off (benchmarks' A/B switch)."""
    return os.environ.get("SWARMTRAIN_DISABLE_DATA_LANES") == "1"


def lane_listen_host(host_maddrs: Sequence[str], client_mode: bool) -> str | None:
    """The IP lanes listen on: that of the first TCP listen address (None: no lanes)."""
    if client_mode:
        return None
    for addr in host_maddrs:
        parts = addr.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            return parts[2]
    return None
