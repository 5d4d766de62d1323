"""Run the NAT training scenario of ``tests/test_netlab_training.py`` once, with logs (root).

``PYTHONPATH=tests python -m netlab.nat_training MODE SECONDS LOG_DIR ['<json train options>']``
(MODE ``optimizer`` or ``diloco``): a and b behind cone NATs, c behind a symmetric NAT, public
relay and boot peers; every NAT peer trains for SECONDS, then all agree on a last epoch. Each
peer's matchmaking, averaging and optimizer logs go to ``LOG_DIR/peer<index>.log`` (a = 0,
b = 1, c = 2) with wall-clock stamps; printed per peer: epochs (outer steps), rounds averaged
and alone, the group size of every round, partial all-reduces, eval loss, and the connection
path to every other peer. Used for the runs in docs/reliability.md ("The matchmaking race over
relays").
"""

from __future__ import annotations

import json
import os
import sys
import time

from .nat_swarm import TRAIN_SCRIPT, NatSwarm
from .topology import Lab

HOMES = {"a": "cone", "b": "cone", "c": "symmetric"}
LOG = (
    "swarmtrain.averaging.matchmaking",
    "swarmtrain.averaging.async_averager",
    "swarmtrain.optim",
    "swarmtrain.utils.loop_stalls",  # with SWARMTRAIN_LOOP_STALLS=0.1 in the environment
)


def main(mode: str, seconds: float, log_dir: str, extra: dict) -> None:
    os.makedirs(log_dir, exist_ok=True)
    started = time.time()
    with Lab() as lab:
        swarm = NatSwarm(
            lab,
            HOMES,
            runner=TRAIN_SCRIPT,
            log=LOG,
            runner_options={"mode": mode, "peers": len(HOMES), "log_dir": log_dir},
        )
        ids = {name: swarm.peer_id(name) for name in HOMES}
        print("startup", round(swarm.startup_seconds, 1), ids, flush=True)
        swarm.ask_all({name: {"op": "wait_circuit", "timeout": 60} for name in HOMES}, 90)
        train = {"op": "train", "seconds": seconds, "peers": len(HOMES), "run_id": f"nat{mode}"}
        trained = swarm.ask_all({name: {**train, **extra} for name in HOMES}, seconds + 120)
        finish = {"op": "finish", "epoch": max(t["epoch"] for t in trained.values()) + 1}
        done = swarm.ask_all({name: finish for name in HOMES}, 180)
        for name, result in done.items():
            paths = {swarm.name_of(p): kinds for p, kinds in result.pop("paths").items()}
            result.pop("params")
            print(name, json.dumps({**result, "paths": paths}), flush=True)
    print("seconds", round(time.time() - started), "load", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main(
        sys.argv[1],
        float(sys.argv[2]),
        sys.argv[3],
        json.loads(sys.argv[4]) if len(sys.argv) > 4 else {},
    )
