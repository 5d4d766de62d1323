"""The warnings of a progress core (``ProgressWarnings``): each condition once, pure."""

from swarmtrain.optim.progress_types import (
    ClockSkewDetected,
    GlobalProgress,
    ImplausibleProgress,
    LocalProgress,
    LonePeer,
    ProgressConfig,
    TargetNotReached,
)
from swarmtrain.optim.progress_warnings import ProgressWarnings

T0 = 1_000.0
CONFIG = ProgressConfig(
    target_batch_size=100, lone_peer_timeout=10.0, stall_factor=3.0, min_stall_time=5.0
)


def progress(epoch: int = 0, samples: int = 0) -> GlobalProgress:
    return GlobalProgress(epoch, samples, 100, 1, 0, T0 + 10, T0 + 1)


def record(time: float, peer: bytes = b"peer") -> LocalProgress:
    return LocalProgress(peer, 0, 0, 1.0, time, False)


def test_an_implausible_record_is_reported_once_per_key():
    warnings = ProgressWarnings(CONFIG)
    first = ImplausibleProgress(b"liar", b"liar", 10**9, 5, 0)
    warnings.implausible(b"liar", first)
    warnings.implausible(b"liar", ImplausibleProgress(b"liar", b"liar", 0, 10**9, 0, 50))
    assert warnings.take(T0, progress(), T0, None) == [first]
    warnings.implausible(b"liar", first)
    assert warnings.take(T0, progress(), T0, None) == []


def test_clock_skew_counts_the_future_and_gossip_from_the_past_once_per_peer():
    warnings = ProgressWarnings(CONFIG)
    warnings.check_clock(record(T0 - 3600), T0, gossiped=False)  # an old DHT record: fine
    warnings.check_clock(record(T0 + CONFIG.max_clock_skew), T0, gossiped=False)  # at the edge
    assert warnings.take(T0, progress(), T0, None) == []
    warnings.check_clock(record(T0 - 60, b"late"), T0, gossiped=True)  # gossip is fresh
    warnings.check_clock(record(T0 + 60), T0, gossiped=False)
    warnings.check_clock(record(T0 + 90), T0, gossiped=False)  # the same peer again
    late_offset = -60 + CONFIG.gossip_period
    assert warnings.take(T0, progress(), T0, None) == [
        ClockSkewDetected(b"late", late_offset),
        ClockSkewDetected(b"peer", 60.0),
    ]


def test_a_lone_peer_is_reported_once_per_stretch_alone():
    warnings = ProgressWarnings(CONFIG)
    warnings.on_nobody_seen(T0)
    warnings.on_nobody_seen(T0 + 5)  # still alone since T0
    assert warnings.take(T0 + 9.9, progress(), T0, None) == []
    assert warnings.take(T0 + 10, progress(epoch=2), T0, None) == [LonePeer(2, 10.0)]
    assert warnings.take(T0 + 20, progress(), T0, None) == []
    warnings.on_others_seen()
    warnings.on_nobody_seen(T0 + 30)
    assert warnings.take(T0 + 40, progress(), T0, None) == [LonePeer(0, 10.0)]


def test_an_epoch_that_overruns_its_first_eta_is_reported_once():
    warnings = ProgressWarnings(CONFIG)
    stuck = progress(epoch=4, samples=40)
    assert warnings.take(T0 + 6, stuck, T0, 2.0) == []  # 6 s: not 3 x 2 s yet
    assert warnings.take(T0 + 6.5, stuck, T0, 2.0) == [TargetNotReached(4, 40, 100, 6.5, 2.0)]
    assert warnings.take(T0 + 60, stuck, T0, 2.0) == []
    assert warnings.take(T0 + 60, progress(epoch=4, samples=100), T0, 1.0) == []  # reached
    assert warnings.take(T0 + 4, progress(epoch=5), T0, 1.0) == []  # under min_stall_time
    assert warnings.take(T0 + 60, progress(epoch=6), T0, None) == []  # no ETA: nothing to hold
