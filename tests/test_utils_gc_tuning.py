"""``freeze_startup_objects``: startup objects leave the collector's walks, later cycles
are still collected."""

from __future__ import annotations

import gc

from swarmtrain.utils import freeze_startup_objects


class _Node:
    def __init__(self):
        self.other = self


def test_frozen_objects_are_not_walked_and_new_cycles_are_still_collected():
    long_lived = [_Node() for _ in range(100)]
    try:
        frozen = freeze_startup_objects()
        # not compared with a later get_freeze_count(): other threads of this test process
        # (earlier tests' background loops) free frozen objects at any moment
        assert frozen >= 100 and gc.get_freeze_count() >= 100
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(node) in tracked for node in long_lived)  # out of every generation

        for _ in range(50):  # cycles made after the freeze are garbage the collector finds
            _Node()
        assert gc.collect() >= 50
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert any(id(node) == id(o) for node in long_lived[:1] for o in gc.get_objects())
