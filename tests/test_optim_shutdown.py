"""``Optimizer.shutdown(timeout=...)`` returns when the other peer stops answering, and
``wait_for_peers`` is woken by the tracker (a peer in another process, frozen with SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from swarmtrain.dht import DHT
from swarmtrain.optim import Optimizer
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
OPTIONS = {
    "run_id": "shutdown_timeout",
    "target_batch_size": 64,
    "batch_size_per_step": 4,
    "matchmaking_time": 1.0,
    "averaging_timeout": 30.0,
    "tracker_opts": {"gossip_period": 0.1, "min_refresh_period": 0.2},
}
PEER = f"""
import sys, torch
from swarmtrain.dht import DHT
from swarmtrain.optim import Optimizer
dht = DHT(**{HOST!r})
opt = Optimizer(dht=dht, params=torch.nn.Linear(4, 1).parameters(),
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **{OPTIONS!r})
opt.tracker.announce()
print(dht.get_visible_maddrs()[0], flush=True)
sys.stdin.read()
"""


def test_shutdown_returns_within_its_timeout_when_the_other_peer_is_frozen():
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    dht = opt = None
    try:
        maddr = peer.stdout.readline().strip()
        assert maddr, "the peer process did not start"
        dht = DHT([maddr], **HOST)
        opt = Optimizer(
            dht=dht,
            params=torch.nn.Linear(4, 1).parameters(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            **OPTIONS,
        )
        assert opt.wait_for_peers(2, timeout=30) == 2  # woken by the tracker's gossip
        os.kill(peer.pid, signal.SIGSTOP)  # its network is gone: nothing answers any more
        started = time.monotonic()
        opt.shutdown(timeout=1.0)
        # 1 s, plus at most 2 s per component (3) for cancelled closes to unwind
        assert time.monotonic() - started < 1.0 + 3 * 2.0 + 2.0
        started = time.monotonic()
        dht.shutdown(timeout=1.0)
        assert time.monotonic() - started < 1.0 + 2.0 + 2.0
    finally:
        if opt is not None:
            opt.shutdown(timeout=1.0)
        if dht is not None:
            dht.shutdown(timeout=1.0)
        peer.kill()
        peer.wait(10)
        peer.stdin.close()
        peer.stdout.close()
    assert BackgroundRuntime.active_references() == 0
