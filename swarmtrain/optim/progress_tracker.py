"""``ProgressTracker``: the swarm's training progress, measured in epochs (DHT + gossip).

An epoch ends when the swarm has accumulated ``target_batch_size`` samples. Each peer reports
how many samples it accumulated; the tracker publishes that and keeps a view of everyone's
progress (the math is in :mod:`swarmtrain.optim.progress_core`)::

    async with DHT.create(initial_peers=[...]) as dht:
        async with ProgressTracker.create(dht, "my_run", target_batch_size=4096) as tracker:
            while True:
                samples += train_step()
                tracker.report_local_progress(epoch, samples)
                if tracker.ready_to_update_epoch:
                    with tracker.pause_updates():
                        ...  # average gradients, step the optimizer
                    epoch, samples = tracker.update_epoch(epoch + 1), 0

Plain (blocking) code uses ``ProgressTracker(dht, "my_run", 4096)`` over a blocking
:class:`~swarmtrain.dht.DHT`; it runs the same object on swarmtrain's background trio loop.

Two channels (see ``proto/progress.proto``):

- DHT (the record): each peer stores its progress under ``{prefix}_progress`` with subkey = its
  peer id, signed with its host's libp2p identity key (a per-peer record,
  :class:`~swarmtrain.dht.PeerRecordValidator`: only the peer behind an id can write, blank or
  extend the record under it; every node that runs a tracker refuses unsigned records under any
  run's progress key) and checked against a pydantic schema; a record whose ``peer_id`` field is
  not its subkey is refused. So one identity is one record and one vote. It re-stores it after
  every report (coalesced) and every ``metadata_expiration / 2``. The tracker fetches all records on
  hivemind's adaptive schedule (``min/max/default_refresh_period``, ``expected_drift_*``).
- gossipsub (the push): the same signed record, on topic ``{prefix}_progress``, at most every
  ``gossip_period`` for progress and at once for a new epoch, so other peers see an epoch end
  in milliseconds. Receivers check it with the DHT's validators (the same signature). A lost
  message costs only latency: the next DHT fetch brings the record.

Dead peers: the owner of every record ahead of this peer (the peer id it is bound to) is dialled
(within ``probe_timeout``, at most 16 at once); records of owners that cannot be reached (a run
killed without saying goodbye) are ignored until they store again
(:mod:`swarmtrain.optim.progress_liveness`).

Resource handling: ``create`` adds the progress validators to the DHT node (they stay
registered: validators cannot be removed; a DHT runs at most one tracker per prefix, since its
peer id is its record), opens a ``PubSub`` on the DHT's host unless one is
passed in (or ``use_pubsub=False``), fetches the swarm's progress once
(and dials the owners of the records ahead of it), then runs five tasks in a task group owned
by the tracker (DHT reporter, gossip publisher, DHT fetcher, owner prober, gossip receiver;
the DHT and gossip tasks are in ``_progress_tracker_dht`` and ``_progress_tracker_gossip``)
and yields. Leaving the ``async with`` publishes a departure record (``None``) when this peer has
published anything, bounded by ``shutdown_timeout`` even when cancelled, then stops the tasks
and closes the ``PubSub`` it opened. The DHT, and a ``PubSub`` passed in, stay open.

Error handling: a failed DHT store or fetch is logged and retried on schedule; invalid gossip is
dropped and counted (``statistics().gossip_rejected``); warnings (clock skew, a lone peer, an
epoch that never reaches its target, a peer whose implausible progress is ignored) are logged
once each. The global epoch is what a quorum of peers vouches for (see the core); once this peer
has averaged with others (:meth:`AsyncProgressTracker.on_round_partners`, which the
``Optimizer`` calls after each round), only those partners vote for an epoch ahead of ours.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Annotated, TypeVar

import pydantic
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmtrain.dht import (
    AsyncDHT,
    CompositeValidator,
    RecordValidatorBase,
    SchemaValidator,
    get_dht_time,
    serialize,
)
from swarmtrain.p2p import PeerID
from swarmtrain.p2p.pubsub import PubSub
from swarmtrain.proto.progress_pb2 import ProgressRecord
from swarmtrain.utils.change_signal import ChangeSignal

from ._owner_probe import dial_owner
from ._progress_tracker_arrivals import _short_peer_id
from ._progress_tracker_dht import ProgressDHTChannel
from ._progress_tracker_gossip import ProgressGossipChannel
from .progress_core import ProgressCore
from .progress_liveness import Probe, ProbeOutcome
from .progress_records import (
    LocalProgressSchema,
    ProgressTrackerStatistics,
    TrainingProgressSchema,
    progress_key,
    progress_record_validator,
)
from .progress_types import (
    GlobalProgress,
    LocalProgress,
    PerformanceEMA,
    ProgressConfig,
)

__all__ = [
    "AsyncProgressTracker",
    "LocalProgressSchema",
    "ProgressTrackerStatistics",
    "TrainingProgressSchema",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_CONCURRENT_PROBES = 16
_PROBE_MESSAGES = {
    ProbeOutcome.UNREACHABLE: "%s: ignoring the progress record of peer %s: it cannot be dialled "
    "(it left without saying goodbye?)",
    ProbeOutcome.UNKNOWN: "%s: no known address for peer %s: its progress record counts only "
    "while another peer of the run answers",
    ProbeOutcome.REACHABLE: "%s: peer %s answered: its progress record counts again",
}
#: (peer id, prefix) of the trackers open in this process: a peer id holds one record per run
_OPEN_TRACKERS: set[tuple[bytes, str]] = set()


_NonNegativeInt = Annotated[int, pydantic.Field(ge=0)]


def _peer_id_bytes(peer_ids: Iterable[PeerID | bytes | str]) -> frozenset[bytes]:
    """``trusted_peers`` as bytes; raises ``TypeError``/``ValueError`` on anything else."""
    if isinstance(peer_ids, (str, bytes, PeerID)):
        raise TypeError("trusted_peers must be a collection of peer ids, not one")
    found: set[bytes] = set()
    for peer_id in peer_ids:
        if isinstance(peer_id, PeerID):
            found.add(peer_id.to_bytes())
        elif isinstance(peer_id, bytes) and peer_id:
            found.add(peer_id)
        elif isinstance(peer_id, str):
            try:
                found.add(PeerID.from_base58(peer_id).to_bytes())
            except Exception as error:
                raise ValueError(f"not a peer id: {peer_id!r}") from error
        else:
            raise TypeError(f"trusted_peers must be peer ids, got {peer_id!r}")
    return frozenset(found)


class AsyncProgressTracker(ProgressDHTChannel, ProgressGossipChannel):
    """The trio tracker; build it with ``async with ProgressTracker.create(dht, ...)``.

    Methods that cannot block are plain functions; ``wait_*`` and :meth:`refresh` are async.
    The plain ones may also be called from other threads (the blocking facade calls them from
    the trainer's thread, so a training step never waits for a busy loop): a lock guards the
    core, and a change made outside the loop wakes the loop's tasks without waiting for it.
    """

    def __init__(
        self,
        dht: AsyncDHT,
        prefix: str,
        core: ProgressCore,
        validator: RecordValidatorBase,
        pubsub: PubSub | None,
        *,
        status_loglevel: int,
        shutdown_timeout: float,
    ):
        self.dht, self.prefix, self._core = dht, prefix, core
        self.config = core.config
        self.client_mode = core.local_progress.client_mode
        self.training_progress_key = progress_key(prefix)
        self._key_bytes = serialize(self.training_progress_key)
        self._subkey = core.local_key
        self._subkey_bytes = serialize(self._subkey)
        self._validator = validator
        self._pubsub = pubsub
        self._status_loglevel = status_loglevel
        self._last_status: tuple[int, int] | None = None  # (epoch, peers) last logged at it
        self._shutdown_timeout = shutdown_timeout
        self._changed = ChangeSignal()
        self._lock = threading.Lock()  # the core: the loop's tasks and the trainer's thread
        self._fetch_failures = self._stores = self._store_failures = 0
        self._gossip_sent = self._gossip_received = self._gossip_rejected = 0
        #: per channel (gossip, fetch), the newest epoch heard of each peer (for logs)
        self._epochs_seen: dict[str, dict[bytes, int]] = {}
        self._fetch_scopes: dict[int, trio.CancelScope] = {}  # running fetches, by number

    # ---------------------------------------------------------------- lifetime

    @classmethod
    @asynccontextmanager
    async def create(
        cls,
        dht: AsyncDHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool | None = None,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10.0,
        default_refresh_period: float = 3.0,
        expected_drift_peers: float = 3.0,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        gossip_period: float = 0.5,
        max_clock_skew: float = 10.0,
        stall_factor: float = 3.0,
        min_stall_time: float = 30.0,
        lone_peer_timeout: float = 30.0,
        quorum_fraction: float = 0.5,
        max_rate_factor: float = 8.0,
        probe_timeout: float = 3.0,
        probe_retry_period: float = 10.0,
        partner_window: int = 4,
        trusted_peers: Iterable[PeerID | bytes | str] = (),
        status_loglevel: int = logging.DEBUG,
        private_key: Ed25519PrivateKey | None = None,
        pubsub: PubSub | None = None,
        use_pubsub: bool = True,
        shutdown_timeout: float = 3.0,
    ) -> AsyncIterator[AsyncProgressTracker]:
        """Start tracking ``prefix``'s progress on ``dht`` (see the module docstring).

        The settings are those of :class:`~swarmtrain.optim.progress_core.ProgressConfig`.
        ``client_mode`` defaults to the DHT's. Records are signed with the DHT host's libp2p
        identity key under its peer id (one record per peer and run: a second tracker of
        ``prefix`` on the same DHT raises ``ValueError``). ``private_key`` (hivemind's owner
        key) is no longer used and warns: records are bound to the peer id instead.
        ``pubsub``: share the host's ``PubSub`` (a host runs at most one); without it the
        tracker opens its own, unless ``use_pubsub=False`` (then the DHT alone carries progress).
        ``trusted_peers``: peer ids (``PeerID``, its bytes or its base58 string) whose records
        vote on the epoch and vouch for samples also before this peer has round partners (the
        organisers' peers; see ``docs/security.md``).
        """
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty string")
        if not shutdown_timeout > 0:
            raise ValueError("shutdown_timeout must be positive")
        config = ProgressConfig(
            target_batch_size=target_batch_size,
            min_refresh_period=min_refresh_period,
            max_refresh_period=max_refresh_period,
            default_refresh_period=default_refresh_period,
            expected_drift_peers=expected_drift_peers,
            expected_drift_rate=expected_drift_rate,
            performance_ema_alpha=performance_ema_alpha,
            metadata_expiration=metadata_expiration,
            gossip_period=gossip_period,
            max_clock_skew=max_clock_skew,
            stall_factor=stall_factor,
            min_stall_time=min_stall_time,
            lone_peer_timeout=lone_peer_timeout,
            quorum_fraction=quorum_fraction,
            max_rate_factor=max_rate_factor,
            probe_timeout=probe_timeout,
            probe_retry_period=probe_retry_period,
            partner_window=partner_window,
            trusted_peers=_peer_id_bytes(trusted_peers),
        )
        if private_key is not None:
            warnings.warn(
                "ProgressTracker(private_key=...) is ignored: progress records are signed with "
                "the DHT host's identity key, under its peer id",
                DeprecationWarning,
                stacklevel=3,
            )
        validator = dht.node.record_validator
        if not isinstance(validator, CompositeValidator):
            raise TypeError("the DHT node's record_validator must be a CompositeValidator")
        key = progress_key(prefix)
        peer_id = dht.peer_id.to_bytes()
        if (peer_id, prefix) in _OPEN_TRACKERS:
            raise ValueError(
                f"this DHT already runs a ProgressTracker for {prefix!r}: a peer id holds one "
                "progress record per run (use one DHT per peer)"
            )
        # the node refuses unsigned or foreign records under every run's progress key, and
        # signs ours (subkey = our peer id) with the host's identity key
        dht.node.add_validators(
            [SchemaValidator(TrainingProgressSchema, prefix=prefix), progress_record_validator()]
        )
        core = ProgressCore(
            config,
            peer_id=peer_id,
            client_mode=dht.client_mode if client_mode is None else bool(client_mode),
            now=get_dht_time(),
        )
        _OPEN_TRACKERS.add((peer_id, prefix))
        async with AsyncExitStack() as stack:
            stack.callback(_OPEN_TRACKERS.discard, (peer_id, prefix))
            if pubsub is None and use_pubsub:
                pubsub = await stack.enter_async_context(PubSub.create(dht.p2p))
            self = cls(
                dht,
                prefix,
                core,
                validator,
                pubsub if use_pubsub else None,
                status_loglevel=status_loglevel,
                shutdown_timeout=shutdown_timeout,
            )
            subscription = None
            if self._pubsub is not None:
                subscription = await self._pubsub.subscribe(key, protobuf_type=ProgressRecord)
                stack.push_async_callback(subscription.aclose)
            await self._fetch()
            await self._probe_owners()  # records of peers that are gone must not steer us
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._store_loop)
                nursery.start_soon(self._fetch_loop)
                nursery.start_soon(self._probe_loop)
                if subscription is not None:
                    nursery.start_soon(self._gossip_loop)
                    nursery.start_soon(self._receive_loop, subscription)
                try:
                    yield self
                finally:
                    # Stop storing and gossiping first: a record stored after the departure
                    # (a report just before shutdown) would outlive it and announce this peer
                    # at its last epoch for metadata_expiration seconds after it left.
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(self._shutdown_timeout):
                            await self._say_goodbye()

    async def _say_goodbye(self) -> None:
        """Tell the swarm this peer left (hivemind stores None under its subkey)."""
        with self._lock:
            published = self._core.has_published
        if not published:
            return
        expiration = get_dht_time() + self.config.metadata_expiration
        if self._pubsub is not None:
            await self._publish(None, expiration)
        try:
            await self.dht.store(self.training_progress_key, None, expiration, subkey=self._subkey)
        except Exception:
            logger.warning("could not store the departure of %s", self.prefix, exc_info=True)

    # ----------------------------------------------------------------- state

    @property
    def local_public_key(self) -> bytes:
        """The subkey of this peer's progress record: its peer id (``PeerID.to_bytes()``; in
        hivemind, the ``[owner:...]`` marker of its signing key)."""
        return self._subkey

    @property
    def pubsub(self) -> PubSub | None:
        """The ``PubSub`` progress is gossiped on (None with ``use_pubsub=False``)."""
        return self._pubsub

    @property
    def local_progress(self) -> LocalProgress:
        return self._core.local_progress

    @property
    def performance_ema(self) -> PerformanceEMA:
        """This peer's samples/s, as reported (``.samples_per_second``; hivemind's name)."""
        return self._core.performance_ema

    @property
    def global_progress(self) -> GlobalProgress:
        """The swarm's progress as last computed (a frozen snapshot)."""
        return self._core.global_progress

    @property
    def global_epoch(self) -> int:
        return self._core.global_progress.epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """The swarm is ahead of us, reached ``target_batch_size``, or its ETA passed."""
        with self._lock:
            return self._core.ready_to_update_epoch(get_dht_time())

    async def wait_for_fetch(self) -> GlobalProgress:
        """Wait for a DHT fetch that ends after this call (a fetch due at once, such as the
        one a peer alone at the target asks for, ``GlobalProgress.confirming_alone``; bound the
        wait with a cancel scope); returns the progress then."""
        asked_at = get_dht_time()
        while True:
            with self._lock:
                last = self._core.last_fetch_time
            if last is not None and last >= asked_at:
                return self.global_progress
            await self._changed.wait()

    @property
    def estimated_next_update_time(self) -> float:
        """DHT time at which this peer should move to the next epoch (now if ready)."""
        with self._lock:
            return self._core.estimated_next_update_time(get_dht_time())

    @property
    def fetched_global_progress_this_epoch(self) -> bool:
        """Whether the DHT was fetched since the last :meth:`update_epoch`."""
        return self._core.fetched_this_epoch

    def peers(self) -> dict[bytes, LocalProgress]:
        """Live progress records of the other peers, by peer id (``PeerID.to_bytes()``)."""
        with self._lock:
            return self._core.peers(get_dht_time())

    def statistics(self) -> ProgressTrackerStatistics:
        core = self._core
        with self._lock:
            global_progress, local_progress = core.global_progress, core.local_progress
            num_peers_seen, fetches = len(core.peers(get_dht_time())), core.num_fetches
            unreachable_ignored = core.num_unreachable_ignored
            unbound_refused = core.num_unbound_refused
            live_partners, unvouched_ahead = core.num_live_partners, core.num_unvouched_ahead
            unvouched_peers = core.num_unvouched_peers
            followed = core.num_followed_seconded, core.num_followed_stalled
        return ProgressTrackerStatistics(
            global_progress=global_progress,
            local_progress=local_progress,
            num_peers_seen=num_peers_seen,
            fetches=fetches,
            fetch_failures=self._fetch_failures,
            stores=self._stores,
            store_failures=self._store_failures,
            gossip_sent=self._gossip_sent,
            gossip_received=self._gossip_received,
            gossip_rejected=self._gossip_rejected,
            unreachable_ignored=unreachable_ignored,
            unbound_refused=unbound_refused,
            live_partners=live_partners,
            unvouched_ahead=unvouched_ahead,
            unvouched_peers=unvouched_peers,
            followed_seconded=followed[0],
            followed_stalled=followed[1],
        )

    # --------------------------------------------------------- local events

    def report_local_progress(self, local_epoch: int, samples_accumulated: int) -> None:
        """This peer is at ``local_epoch`` with ``samples_accumulated`` samples toward the
        target; published in the background."""
        with self._lock:
            self._core.report_local_progress(local_epoch, samples_accumulated, get_dht_time())
        self._changed.notify_threadsafe()

    def announce(self) -> None:
        """Publish this peer's record (zero samples) now, so that the others count it before it
        reports samples, e.g. while the trainers wait for each other at start-up."""
        with self._lock:
            self._core.announce(get_dht_time())
        self._changed.notify_threadsafe()

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """Move to ``new_epoch`` (default: the next one) with no samples; return it. The new
        epoch is gossiped at once."""
        with self._lock:
            epoch = self._core.update_epoch(new_epoch, get_dht_time())
        self._changed.notify_threadsafe()
        logger.debug("%s: entered epoch %d", self.prefix, epoch)
        return epoch

    def on_round_partners(self, peer_ids: Iterable[PeerID | bytes], epoch: int) -> None:
        """This peer averaged with ``peer_ids`` in a round of ``epoch``: only such partners
        vote for epochs ahead of ours (see :meth:`ProgressCore.on_round_partners`)."""
        ids = [p.to_bytes() if isinstance(p, PeerID) else p for p in peer_ids]
        with self._lock:
            self._core.on_round_partners(ids, epoch, get_dht_time())
        self._changed.notify_threadsafe()

    @contextmanager
    def pause_updates(self) -> Iterator[None]:
        """Do not count the time spent inside (averaging, an optimizer step) against this
        peer's samples/s."""
        with self._lock:
            self._core.pause(get_dht_time())
        try:
            yield
        finally:
            with self._lock:
                self._core.resume(get_dht_time())

    # ---------------------------------------------------------------- waits

    async def wait_global_epoch(self, epoch: int) -> GlobalProgress:
        """Wait until the swarm's epoch is at least ``epoch``; return the progress then."""
        while self.global_epoch < epoch:
            await self._changed.wait()
        await trio.lowlevel.checkpoint()
        return self.global_progress

    async def wait_ready_to_update_epoch(self) -> GlobalProgress:
        """Wait until :attr:`ready_to_update_epoch` (the swarm is ahead, reached the target,
        or the ETA passed); return the progress then."""
        while not self.ready_to_update_epoch:
            delay = max(0.0, self.global_progress.eta_next_epoch - get_dht_time())
            with trio.move_on_after(delay if math.isfinite(delay) else math.inf):
                await self._changed.wait()
        await trio.lowlevel.checkpoint()
        return self.global_progress

    async def wait_num_peers(self, num_peers: int, refresh_every: float = 1.0) -> GlobalProgress:
        """Wait until the swarm's progress counts at least ``num_peers`` peers; return it.

        Woken by each change (gossip brings announcements at once); when ``refresh_every``
        seconds pass without enough peers, it fetches from the DHT (the fallback)."""
        while self.global_progress.num_peers < num_peers:
            with trio.move_on_after(refresh_every) as waited:
                await self._changed.wait()
            if waited.cancelled_caught:
                await self._fetch()  # a failed fetch is logged; the next one comes later
        await trio.lowlevel.checkpoint()
        return self.global_progress

    async def refresh(self) -> GlobalProgress:
        """Fetch the swarm's progress from the DHT now; return the result."""
        await self._fetch()
        return self.global_progress

    # ------------------------------------------------------- liveness probes

    async def _probe_loop(self) -> None:
        while True:
            if not await self._probe_owners():
                with trio.move_on_after(self.config.probe_retry_period):
                    await self._changed.wait()

    async def _probe_owners(self) -> bool:
        """Dial the owners of records ahead of us that were not confirmed yet (see
        ``progress_liveness``); returns whether any probe ran."""
        with self._lock:
            probes = self._core.probes_due(get_dht_time())
        if not probes:
            return False
        limiter = trio.CapacityLimiter(_MAX_CONCURRENT_PROBES)
        async with trio.open_nursery() as nursery:
            for probe in probes:
                nursery.start_soon(self._probe_owner, probe, limiter)
        return True

    async def _probe_owner(self, probe: Probe, limiter: trio.CapacityLimiter) -> None:
        outcome = ProbeOutcome.UNREACHABLE  # no answer within probe_timeout
        async with limiter:
            with trio.move_on_after(self.config.probe_timeout):
                outcome = await dial_owner(self.dht.p2p, probe.peer_id)
        now = get_dht_time()
        with self._lock:
            changed = self._core.on_probe_result(probe, outcome, now)
        if changed:
            logger.info(_PROBE_MESSAGES[outcome], self.prefix, _short_peer_id(probe.peer_id))
            self._changed.notify()
