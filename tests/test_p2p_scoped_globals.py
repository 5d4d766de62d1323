"""``override_method_globals``: one instance's method reads chosen module globals from an
overlay; the class, the module and other instances stay as they are."""

from __future__ import annotations

import sys

import pytest
import trio

from swarmtrain.p2p._scoped_globals import override_method_globals

DELAY = 0.25


class Dialer:
    async def dial(self, n: int = 2, *, scale: int = 1) -> list[float]:
        def one(i: int) -> float:  # a nested function inherits the method's globals
            return DELAY * i * scale

        await trio.lowlevel.checkpoint()
        return [one(i) for i in range(n)] + [len(sys.argv) * 0.0]

    def other(self) -> float:
        return DELAY


def test_one_instance_reads_the_override_others_and_the_class_do_not(monkeypatch):
    ours, theirs = Dialer(), Dialer()
    override_method_globals(ours, "dial", DELAY=0.0)
    assert trio.run(ours.dial) == [0.0, 0.0, 0.0]
    assert trio.run(theirs.dial) == [0.0, 0.25, 0.0]
    assert "dial" in vars(ours) and "dial" not in vars(theirs)
    assert Dialer.dial is ours.dial.__wrapped__  # the class keeps its function
    assert trio.run(lambda: ours.dial(3, scale=2)) == [0.0, 0.0, 0.0, 0.0]  # defaults kept
    assert ours.other() == 0.25  # only the named method
    # every other global is read live from the module
    monkeypatch.setattr(sys.modules[__name__], "DELAY", 1.0)
    assert trio.run(theirs.dial) == [0.0, 1.0, 0.0]
    assert trio.run(ours.dial) == [0.0, 0.0, 0.0]


def test_a_name_the_method_does_not_read_is_refused():
    with pytest.raises(RuntimeError, match="no longer reads"):
        override_method_globals(Dialer(), "dial", NOT_A_GLOBAL=1)
    with pytest.raises(RuntimeError, match="no longer reads"):
        override_method_globals(Dialer(), "other", len=1)  # a builtin, not a module global
    with pytest.raises(RuntimeError, match="not a function"):
        override_method_globals(Dialer(), "missing", DELAY=0.0)
