"""ProgressCore under random event orders: local reports, DHT fetches and gossip carrying any
valid records (honest, stale, from the future, lying about epochs and samples, departures), and
a clock that jumps forward (and a little back), rounds with partners. Whatever happens, the
global progress stays sane: never behind our own epoch, moved only by a quorum (of the partners
while we have any), finite numbers, each warning once."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from swarmtrain.optim.progress_core import ProgressCore
from swarmtrain.optim.progress_records import _INVALID, _parse_progress
from swarmtrain.optim.progress_types import (
    ClockSkewDetected,
    ImplausibleProgress,
    LocalProgress,
    ProgressConfig,
)

KEYS = [f"peer{i}".encode() for i in range(5)]  # peer ids: the verified subkeys
LOCAL_KEY = b"local"
TARGET = 256
# what a DHT record's value may decode to: dicts with the right keys and any values, or not
field_values = (
    st.none()
    | st.booleans()
    | st.integers(-5, 2**64 - 1)
    | st.floats()
    | st.binary(max_size=8)
    | st.text(max_size=4)
)
FIELDS = ["peer_id", "epoch", "samples_accumulated", "samples_per_second", "time", "client_mode"]
values = st.none() | field_values | st.dictionaries(st.sampled_from([*FIELDS, "x"]), field_values)


class ProgressSwarm(RuleBasedStateMachine):
    @initialize(client_mode=st.booleans(), quorum=st.sampled_from([0.0, 0.5, 0.75]))
    def setup(self, client_mode, quorum):
        self.now = 1000.0
        self.config = ProgressConfig(target_batch_size=TARGET, quorum_fraction=quorum)
        self.core = ProgressCore(
            self.config, peer_id=LOCAL_KEY, client_mode=client_mode, now=1000.0
        )
        self.at = self.now  # the time of the core's last recompute (its snapshot's time)
        self.implausible: set[bytes] = set()
        self.skewed: set[bytes] = set()
        self.partners: dict[bytes, int] = {}  # what the core was told: key -> round epoch

    @st.composite
    def records(draw):
        key = draw(st.sampled_from([*KEYS, LOCAL_KEY]))
        if draw(st.integers(0, 9)) == 0:
            return key, None  # the peer left
        progress = LocalProgress(
            peer_id=key if draw(st.integers(0, 9)) else draw(st.sampled_from(KEYS)),  # or a lie
            epoch=draw(st.sampled_from([0, 1, 2, 3, 10**9])),
            samples_accumulated=draw(st.sampled_from([0, 1, 50, TARGET, 10**12])),
            samples_per_second=draw(st.sampled_from([0.0, 1e-30, 5.0, 1e12])),
            time=draw(st.floats(-100.0, 100.0)),  # relative to now
            client_mode=draw(st.booleans()),
        )
        return key, progress

    def shifted(self, progress: LocalProgress | None) -> LocalProgress | None:
        if progress is None:
            return None
        return LocalProgress(
            progress.peer_id,
            progress.epoch,
            progress.samples_accumulated,
            progress.samples_per_second,
            self.now + progress.time,
            progress.client_mode,
        )

    @rule(
        entries=st.lists(st.tuples(records(), st.floats(-5.0, 120.0)), max_size=6),
    )
    def fetch(self, entries):
        fetched = {
            key: (self.shifted(progress), self.now + ttl) for (key, progress), ttl in entries
        }
        self.core.on_fetch(fetched, self.now)
        self.at = self.now

    @rule(record=records(), ttl=st.floats(-5.0, 120.0) | st.just(math.inf))
    def gossip(self, record, ttl):
        key, progress = record
        if self.core.on_gossip(key, self.shifted(progress), self.now + ttl, self.now):
            self.at = self.now  # (gossip that changed nothing leaves the snapshot as it was)

    @rule()
    def fetch_failed(self):
        self.core.on_fetch_failed(self.now)
        self.at = self.now

    @rule(extra=st.integers(0, 100), step=st.booleans())
    def report(self, extra, step):
        self.at = self.now
        local = self.core.local_progress
        if step:
            self.core.update_epoch(None, self.now)
        else:
            self.core.report_local_progress(
                local.epoch, local.samples_accumulated + extra, self.now
            )

    @rule(to_global=st.booleans())
    def catch_up(self, to_global):
        """The optimizer moves to the swarm's epoch (after loading state), or just announces."""
        self.at = self.now
        if to_global and self.core.global_progress.epoch > self.core.local_progress.epoch:
            self.core.update_epoch(self.core.global_progress.epoch, self.now)
        else:
            self.core.announce(self.now)

    @rule(keys=st.sets(st.sampled_from([*KEYS, LOCAL_KEY]), max_size=3), back=st.integers(-1, 6))
    def round_partners(self, keys, back):
        """A round with ``keys`` ended, in our epoch or ``back`` epochs before it."""
        epoch = max(0, self.core.local_progress.epoch - back)
        self.core.on_round_partners(keys, epoch, self.now)
        for key in keys - {LOCAL_KEY}:
            self.partners[key] = max(epoch, self.partners.get(key, -1))
        self.at = self.now

    @rule(pause=st.booleans())
    def pause_or_resume(self, pause):
        (self.core.pause if pause else self.core.resume)(self.now)

    @rule(dt=st.sampled_from([-1.0, 0.0, 0.4, 3.0, 31.0, 200.0]))
    def advance_clock(self, dt):
        self.now += dt
        self.core.take_store(self.now)
        self.core.take_gossip(self.now)

    @invariant()
    def global_progress_is_sane(self):
        if not hasattr(self, "core"):
            return
        core, now = self.core, self.at
        local, progress = core.local_progress, core.global_progress
        assert progress.epoch >= local.epoch
        # moved only by a quorum of the voters: our live partners if we have any, else every
        # live non-client peer; with two or more voters besides us, the global epoch is at most
        # the second highest of their epochs and ours
        oldest = local.epoch - self.config.partner_window
        live = {k: p for k, p in core.peers(now).items() if not p.client_mode}
        partners = [p.epoch for k, p in live.items() if self.partners.get(k, -math.inf) >= oldest]
        assert core.num_live_partners == len(partners)
        voters = partners or [p.epoch for p in live.values()]
        if len(voters) >= 2:
            assert progress.epoch <= max(local.epoch, sorted([*voters, local.epoch])[-2])
        if voters:  # nobody else moves us
            assert progress.epoch <= max(local.epoch, *voters)
        assert isinstance(progress.samples_accumulated, int) and progress.samples_accumulated >= 0
        assert math.isfinite(progress.samples_per_second) and progress.samples_per_second >= 0
        assert not math.isnan(progress.eta_next_epoch)
        assert not math.isnan(progress.next_fetch_time)
        assert 0 <= progress.num_clients <= progress.num_peers <= len(core.peers(now)) + 1
        assert progress.target_batch_size == TARGET
        core.ready_to_update_epoch(now)
        assert not math.isnan(core.estimated_next_update_time(now))
        assert math.isfinite(core.performance_ema.samples_per_second)
        for warning in core.warnings(now):
            if isinstance(warning, ImplausibleProgress):
                assert warning.key not in self.implausible, "warned twice"
                self.implausible.add(warning.key)
            elif isinstance(warning, ClockSkewDetected):
                assert warning.peer_id not in self.skewed, "warned twice"
                self.skewed.add(warning.peer_id)
            str(warning)  # every warning reads


TestProgressSwarm = ProgressSwarm.TestCase


@given(values)
def test_progress_records_from_the_dht_parse_or_are_invalid(value):
    parsed = _parse_progress(value)
    assert parsed is None or parsed is _INVALID or isinstance(parsed, LocalProgress)
    if isinstance(parsed, LocalProgress):
        assert parsed.to_dict() == {**value, "time": float(value["time"])}
