"""A blocking ``DHT`` used in a process forked after it started fails at once with a clear
message (its background loop thread does not exist there); it used to hang."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from swarmtrain.dht import DHT

CALLS = {
    "peer_id": lambda dht: dht.peer_id,
    "get": lambda dht: dht.get("key"),
    "get_future": lambda dht: dht.get("key", return_future=True),
    "store": lambda dht: dht.store("key", 1, 1e12),
    "get_visible_maddrs": lambda dht: dht.get_visible_maddrs(),
}


def _use_in_child(dht: DHT, results) -> None:
    for name, call in CALLS.items():
        try:
            call(dht)
            results.put((name, "no error"))
        except RuntimeError as e:
            results.put((name, str(e)))
    results.put(("is_alive", dht.is_alive()))
    dht.shutdown()  # must not touch the parent's loop (nor hang)
    results.put(("shutdown", "returned"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_dht_created_before_fork_fails_clearly_in_the_child():
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(target=_use_in_child, args=(dht, results))
        child.start()
        child.join(timeout=30)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        assert not alive, "the child hung using the parent's DHT"
        assert child.exitcode == 0
        got = dict(results.get(timeout=5) for _ in range(len(CALLS) + 2))
        for name in CALLS:
            assert f"created in process {os.getpid()}" in got[name], (name, got[name])
            assert "after the fork" in got[name], got[name]
        assert got["is_alive"] is False
        assert got["shutdown"] == "returned"
        # the parent's DHT is untouched by the child's calls and shutdown
        assert dht.is_alive()
        assert dht.store("key", 1, 1e12) and dht.get("key").value == 1
    finally:
        dht.shutdown()
