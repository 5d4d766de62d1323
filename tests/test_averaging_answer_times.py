"""AnswerTimes: per-leader answer timeouts learned from the answers (no clock, no sockets)."""

from __future__ import annotations

import math

import pytest

from swarmtrain.averaging.answer_times import AnswerTimes


def test_unknown_peers_get_request_timeout_direct_and_more_when_not_direct():
    times = AnswerTimes(2.5, 5.0)
    assert times.timeout(b"a", 0.0, direct=True) == 2.5
    assert times.timeout(b"a", 0.0, direct=False) == 5.0  # relayed (or not connected yet)
    assert times.slowest(b"a", 0.0) == 0.0 and len(times) == 0


def test_slow_answers_lengthen_the_timeout_up_to_the_cap():
    times = AnswerTimes(2.5, 5.0)
    times.observe(b"a", 0.3, now=10.0)
    assert times.timeout(b"a", 10.0, direct=True) == 2.5  # fast path: the configured one
    times.observe(b"a", 1.9, now=11.0)  # a relayed answer on a loaded machine
    assert times.timeout(b"a", 11.0, direct=True) == pytest.approx(3.8)
    times.observe(b"a", 3.9, now=12.0)
    assert times.timeout(b"a", 12.0, direct=True) == 5.0  # never beyond a matchmaking window
    assert times.timeout(b"b", 12.0, direct=True) == 2.5  # per peer


def test_a_wait_without_an_answer_doubles_the_next_one():
    times = AnswerTimes(1.0, 10.0)
    times.observe(b"a", 1.0, now=0.0)  # we gave up after 1 s: it answers slower than that
    assert times.timeout(b"a", 0.0, direct=True) == 2.0
    times.observe(b"a", 2.0, now=2.0)
    assert times.timeout(b"a", 2.0, direct=True) == pytest.approx(4.0, rel=0.05)


def test_a_slow_spell_is_forgotten():
    times = AnswerTimes(1.0, 10.0, half_life=60.0)
    times.observe(b"a", 4.0, now=0.0)
    assert times.slowest(b"a", 60.0) == pytest.approx(2.0)
    assert times.timeout(b"a", 600.0, direct=True) == 1.0
    times.observe(b"a", 0.2, now=60.0)  # a fast answer does not erase a recent slow one
    assert times.slowest(b"a", 60.0) == pytest.approx(2.0)


def test_memory_is_bounded_and_bad_samples_are_ignored():
    times = AnswerTimes(1.0, 10.0, max_peers=3)
    for i in range(10):
        times.observe(i, 1.5, now=float(i))
    assert len(times) == 3 and times.peers() == [7, 8, 9]
    for bad in (-1.0, math.nan, math.inf, "2"):
        times.observe(b"x", bad, now=0.0)
    assert b"x" not in times.peers()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_timeout": 0},
        {"request_timeout": math.nan},
        {"max_timeout": -1},
        {"factor": math.inf},
        {"half_life": 0},
        {"max_peers": 0},
        {"max_peers": True},
    ],
)
def test_invalid_settings_raise(kwargs):
    args = {"request_timeout": 1.0, "max_timeout": 5.0, **kwargs}
    with pytest.raises(ValueError):
        AnswerTimes(**args)
