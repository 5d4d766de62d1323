"""Property tests of DiLoCo's pure schedule and fragments: every fragment's round starts once
and is applied exactly ``delay`` steps later, before its next round; ``in_flight`` and
``rounds_completed`` agree with the actions; fragments cover every parameter once, balanced."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.optim.diloco_core import ApplyOuter, Fragments, StartSync, StreamingSchedule


@st.composite
def schedules(draw):
    fragments = draw(st.integers(1, 6))
    inner_steps = fragments * draw(st.integers(1, 8))
    delay = draw(st.integers(0, inner_steps - 1))
    alpha = draw(st.sampled_from([0.0, 0.5, 0.9]))
    return StreamingSchedule(inner_steps, fragments, delay, alpha)


@given(schedules())
def test_schedule_starts_and_applies_every_round_once_in_order(schedule):
    horizon = 4 * schedule.inner_steps + schedule.delay
    starts: dict[tuple[int, int], int] = {}
    applies: dict[tuple[int, int], int] = {}
    for step in range(horizon + 1):
        actions = schedule.actions(step)
        kinds = [type(a) for a in actions]
        assert kinds in ([], [StartSync], [ApplyOuter], [StartSync, ApplyOuter])
        for action in actions:
            key = (action.fragment, action.round)
            book = starts if isinstance(action, StartSync) else applies
            assert key not in book, f"{action} twice"
            book[key] = step
            assert action.step == step
            if isinstance(action, ApplyOuter):
                assert action.alpha == schedule.alpha
        in_flight = {(s.fragment, s.round): s.step for s in schedule.in_flight(step)}
        assert in_flight == {
            key: start for key, start in starts.items() if start <= step < start + schedule.delay
        }
        for fragment in range(schedule.num_fragments):
            done = sum(1 for (f, _), at in applies.items() if f == fragment and at <= step)
            assert schedule.rounds_completed(fragment, step) == done
    for (fragment, round_), start in starts.items():
        assert start == schedule.start_step(fragment, round_)
        if (fragment, round_) in applies:
            assert applies[(fragment, round_)] == start + schedule.delay
            following = starts.get((fragment, round_ + 1))
            assert following is None or applies[(fragment, round_)] < following
    for fragment in range(schedule.num_fragments):  # every fragment syncs every inner_steps
        rounds = sorted(start for (f, _), start in starts.items() if f == fragment)
        assert all(b - a == schedule.inner_steps for a, b in itertools.pairwise(rounds))
    assert set(applies) <= set(starts)


def best_contiguous(numels: tuple[int, ...], k: int) -> int:
    """The smallest possible largest run over all splits into k contiguous runs."""
    best = None
    for cuts in itertools.combinations(range(1, len(numels)), k - 1):
        bounds = [0, *cuts, len(numels)]
        largest = max(sum(numels[a:b]) for a, b in itertools.pairwise(bounds))
        best = largest if best is None else min(best, largest)
    return best


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=7), st.data())
def test_fragments_cover_every_parameter_once_and_balance(numels, data):
    numels = tuple(numels)
    k = data.draw(st.integers(1, len(numels)))
    contiguous = Fragments.split(numels, k, strategy="contiguous")
    greedy = Fragments.split(numels, k, strategy="greedy")
    for fragments in (contiguous, greedy):
        assert len(fragments) == k
        assert sorted(i for group in fragments.groups for i in group) == list(range(len(numels)))
        for i in range(len(numels)):
            assert i in fragments[fragments.fragment_of(i)]
        assert sum(fragments.fragment_numel(f) for f in range(k)) == sum(numels)
    # contiguous: runs of consecutive parameters, the largest as small as possible
    assert [i for group in contiguous.groups for i in group] == list(range(len(numels)))
    largest = max(contiguous.fragment_numel(f) for f in range(k))
    assert largest == best_contiguous(numels, k)
    # greedy: the documented bound
    assert max(greedy.fragment_numel(f) for f in range(k)) <= sum(numels) / k + max(numels)
