"""``staggered_connect``: dead peers cost a short delay each, not a dial timeout each.

No sockets: ``connect`` is a coroutine that succeeds, fails or hangs after a given time, on
trio's jumping mock clock (so the timings below are exact).
"""

from __future__ import annotations

import pytest
import trio

from swarmtrain.averaging.staggered import staggered_connect

pytestmark = pytest.mark.trio

DIAL_TIMEOUT = 5.0


def network(behaviour: dict[str, tuple[str, float]], log: list[tuple[float, str]]):
    """``connect(peer)``: after the peer's delay, returns ("ok"), raises ("refuse") or times out
    after DIAL_TIMEOUT ("drop", the delay is ignored)."""

    async def connect(peer: str) -> None:
        kind, after = behaviour[peer]
        log.append((trio.current_time(), peer))
        if kind == "drop":
            await trio.sleep(DIAL_TIMEOUT)
            raise TimeoutError(f"{peer}: timed out")
        await trio.sleep(after)
        if kind == "refuse":
            raise ConnectionRefusedError(peer)

    return connect


async def collect(peers, connect, delay, use_for=0.0):
    """(time, peer, error or None) for every attempt, using each connected peer for
    ``use_for`` seconds before asking for the next."""
    start = trio.current_time()
    got = []
    async with staggered_connect(peers, connect, delay) as attempts:
        while (result := await attempts.next()) is not None:
            peer, error = result
            got.append((trio.current_time() - start, peer, error))
            if error is None:
                await trio.sleep(use_for)
    return got


async def test_dead_donors_before_a_live_one_cost_the_delay_each(autojump_clock):
    log: list[tuple[float, str]] = []
    connect = network({"dead1": ("drop", 0), "dead2": ("drop", 0), "live": ("ok", 0.1)}, log)
    start = trio.current_time()
    async with staggered_connect(["dead1", "dead2", "live"], connect, 0.5) as attempts:
        peer, error = await attempts.next()
        assert (peer, error) == ("live", None)
        assert trio.current_time() - start == pytest.approx(1.1)  # one after the other: 10.1 s
    assert [(t - start, p) for t, p in log] == [(0.0, "dead1"), (0.5, "dead2"), (1.0, "live")]


async def test_a_refused_dial_starts_the_next_attempt_at_once(autojump_clock):
    log: list[tuple[float, str]] = []
    connect = network({"gone": ("refuse", 0.01), "live": ("ok", 0.05)}, log)
    got = await collect(["gone", "live"], connect, 0.5)
    assert [(round(t, 2), p) for t, p, _ in got] == [(0.01, "gone"), (0.06, "live")]
    assert isinstance(got[0][2], ConnectionRefusedError) and got[1][2] is None


async def test_no_new_dials_while_a_connected_peer_is_in_use(autojump_clock):
    log: list[tuple[float, str]] = []
    connect = network({"a": ("ok", 0.1), "b": ("ok", 0.1), "c": ("ok", 0.1)}, log)
    start = trio.current_time()
    async with staggered_connect(["a", "b", "c"], connect, 0.5) as attempts:
        assert (await attempts.next())[0] == "a"
        await trio.sleep(30)  # a long download from a
        assert [p for _, p in log] == ["a"]
        assert attempts.started == 1
        assert (await attempts.next())[0] == "b"  # a failed mid-transfer: the next one
    assert [(round(t - start, 2), p) for t, p in log] == [(0.0, "a"), (30.1, "b")]


async def test_every_attempt_is_reported_once_then_none(autojump_clock):
    log: list[tuple[float, str]] = []
    connect = network({"x": ("drop", 0), "y": ("refuse", 0.2), "z": ("ok", 0.3)}, log)
    got = await collect(["x", "y", "z"], connect, 0.5)
    assert sorted(p for _, p, _ in got) == ["x", "y", "z"]
    assert got[-1][0] == pytest.approx(DIAL_TIMEOUT)  # all dead ones together: one timeout


async def test_no_peers_and_unexpected_errors():
    async def connect(peer):
        raise KeyError(peer)

    async with staggered_connect([], connect, 0.5) as attempts:
        assert await attempts.next() is None
    with pytest.raises(KeyError):  # only `errors` are attempt failures
        async with staggered_connect(["a"], connect, 0.5, errors=(OSError,)) as attempts:
            await attempts.next()


@pytest.mark.parametrize("delay", [-1.0, float("inf"), float("nan")])
async def test_delay_is_validated(delay):
    async def connect(peer):
        return None

    with pytest.raises(ValueError, match="delay"):
        async with staggered_connect(["a"], connect, delay):
            pass
