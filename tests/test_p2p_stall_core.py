"""``stall_core``: a slow path is told from a stalled one (sans-IO, the clock is a number)."""

from __future__ import annotations

import pytest

from swarmtrain.p2p.stall_core import (
    DEFAULT_MIN_RATE,
    MIN_FRAME_SIZE,
    FrameSizer,
    ProgressDeadline,
)

MIB = 1 << 20


def test_a_peer_that_sends_nothing_misses_the_first_deadline():
    guard = ProgressDeadline(first_deadline=10.0, patience=10.0)
    assert not guard.expired(9.99)
    assert guard.expired(10.0)
    assert guard.on_bytes(0, 5.0) == 10.0  # an empty read is no progress


def test_bytes_that_keep_arriving_keep_the_wait_alive():
    """A 1 MiB part at 40 KB/s (a 300 ms, 1% loss path) takes ~26 s: far past a 10 s
    ``sender_timeout``, yet never stalled; once the bytes stop, 10 s later it is."""
    guard = ProgressDeadline(first_deadline=10.0, patience=10.0)
    now, received = 0.0, 0
    while received < MIB:
        now += 0.4
        received += 16_000
        guard.on_bytes(16_000, now)
        assert not guard.expired(now)
    assert now > 25
    assert guard.deadline == pytest.approx(now + 10.0)
    assert guard.expired(now + 10.0)


def test_a_burst_then_silence_expires_one_patience_after_the_last_bytes():
    guard = ProgressDeadline(first_deadline=5.0, patience=5.0)
    guard.on_bytes(MIB, 4.0)
    assert guard.deadline == 9.0
    assert not guard.expired(8.9)
    assert guard.expired(9.0)


def test_a_trickle_buys_one_second_per_min_rate_bytes_and_no_more():
    """A peer sending 100 bytes every 9 s (under a 10 s patience) to hold a wait open: the
    deadline may move only ``received / min_rate`` past the first one, so it still ends."""
    guard = ProgressDeadline(first_deadline=10.0, patience=10.0)
    now = 0.0
    while not guard.expired(now):
        now += 9.0
        if not guard.expired(now):
            guard.on_bytes(100, now)
    assert now <= 10.0 + guard.received / DEFAULT_MIN_RATE + 9.0
    assert now < 30  # bounded: a few hundred bytes bought well under a second


def test_the_deadline_never_moves_back():
    guard = ProgressDeadline(first_deadline=20.0, patience=1.0)
    assert guard.on_bytes(MIB, 1.0) == 20.0  # now + patience is earlier: unchanged


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        ProgressDeadline(1.0, patience=0)
    with pytest.raises(ValueError):
        ProgressDeadline(1.0, patience=1.0, min_rate=0)
    with pytest.raises(ValueError):
        FrameSizer(max_size=1024, min_size=4096)


def test_fast_paths_keep_the_largest_frames():
    sizer = FrameSizer(max_size=MIB)
    for _ in range(10):
        assert sizer.on_write(MIB, 0.001) == MIB  # went straight into the socket
    assert sizer.on_write(MIB, 0.02) == MIB  # waited, but 50 MB/s: 0.25 s of it is > 1 MiB


def test_a_slow_lossy_path_gets_small_frames():
    """~40 KB/s: a 1 MiB frame held the connection's write lock ~26 s."""
    sizer = FrameSizer(max_size=MIB)
    assert sizer.on_write(MIB, MIB / 40_000) == MIN_FRAME_SIZE  # 0.25 s of 40 KB/s < 16 KiB
    assert sizer.rate == pytest.approx(40_000)
    assert sizer.on_write(MIN_FRAME_SIZE, MIN_FRAME_SIZE / 40_000) == MIN_FRAME_SIZE


def test_a_20_mbit_path_gets_frames_of_a_quarter_second():
    sizer = FrameSizer(max_size=MIB)
    assert sizer.on_write(MIB, MIB / 2.5e6) == 512 * 1024  # 625 KB in 0.25 s: 512 KiB


def test_small_writes_that_waited_measure_nothing():
    """A 12-byte window update that waited for room behind others' frames says nothing of
    the path's rate."""
    sizer = FrameSizer(max_size=MIB)
    assert sizer.on_write(12, 2.0) == MIB
    assert sizer.rate is None


def test_frames_grow_back_when_the_path_frees_up():
    sizer = FrameSizer(max_size=MIB)
    sizer.on_write(MIB, MIB / 40_000)
    sizes = [sizer.on_write(sizer.frame_size, 0.0001) for _ in range(8)]
    assert sizes == [32 * 1024, 64 * 1024, 128 * 1024, 256 * 1024, 512 * 1024, MIB, MIB, MIB]
    assert sizer.on_write(100, 0.0001) == MIB  # a small write that did not wait: no change
