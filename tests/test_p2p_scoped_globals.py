"""``override_method_globals``: one instance's method reads chosen module globals from an
overlay; the class, the module and other instances stay as they are. ``subclass_with_globals``
and ``override_method_imports``: the same for a whole class and a function-local import."""

from __future__ import annotations

import sys

import pytest
import trio

from swarmtrain.p2p._scoped_globals import (
    override_method_globals,
    override_method_imports,
    subclass_with_globals,
)

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


# -- subclass_with_globals / override_method_imports


class Conn:
    def __init__(self, name: str):
        self.name = name
        self.said = DELAY  # the constructor reads the global too

    def close(self) -> float:
        def later() -> float:
            return DELAY

        return later()

    @property
    def delay(self) -> float:
        return DELAY

    def plain(self) -> str:
        return self.name


class Pool:
    def add(self, name: str) -> Conn:
        from test_p2p_scoped_globals import Conn  # a function-local import, as in py-libp2p

        return Conn(name)


def test_a_subclass_reads_the_override_in_every_method_and_the_class_stays():
    scoped = subclass_with_globals(Conn, DELAY=0.0)
    conn = scoped("a")
    assert issubclass(scoped, Conn) and scoped.__name__ == "ScopedConn"
    assert (conn.said, conn.close(), conn.delay, conn.plain()) == (0.0, 0.0, 0.0, "a")
    assert "plain" not in vars(scoped)  # methods that do not read the name are inherited
    original = Conn("b")
    assert (original.said, original.close(), original.delay) == (0.25, 0.25, 0.25)
    with pytest.raises(RuntimeError, match="no method of Conn reads"):
        subclass_with_globals(Conn, NOT_A_GLOBAL=1)


def test_one_instance_imports_the_replacement_others_the_original():
    ours, theirs = Pool(), Pool()
    scoped = subclass_with_globals(Conn, DELAY=0.0)
    override_method_imports(ours, "add", __name__, Conn=scoped)
    assert type(ours.add("x")) is scoped and ours.add("x").said == 0.0
    assert type(theirs.add("y")) is Conn and theirs.add("y").said == 0.25
    assert type(Pool().add("z")) is Conn
    with pytest.raises(RuntimeError, match="no longer imports"):
        override_method_imports(Pool(), "add", __name__, Missing=scoped)
