"""How long does a rerun of a SIGKILLed run take to train? (issue 16.6)

    python benchmarks/benchmark_rerun.py [--peers 2] [--dead_hosts refuse|drop] [--repeats 1]

A bootstrap DHT node in this process outlives everything, as a ``swarmtrain node`` would. A run
of ``--peers`` Optimizer processes (one ``run_id``) trains until every peer passed epoch 3, and
is SIGKILLed (no goodbye: its progress records and state offers stay in the DHT). At once, a
rerun of the same number of peers starts with the same ``run_id`` on the same bootstrap node
and trains one epoch. ``--dead_hosts drop`` makes the dead peers' ports drop every SYN (a
listener that never accepts, its backlog full), as hosts gone from the network do: each dial
to them hangs until a timeout. The baseline in the same run: the same rerun under a fresh
``run_id`` (no stale records).

Prints, per rerun peer: the swarm epoch it saw at start, the Optimizer's construction time and
the time from construction to its first epoch; the medians, and their ratio to the baseline.
Run it from a checkout (or with ``PYTHONPATH``) to measure that checkout's ``swarmtrain``.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dead_hosts import silent_port

HOST_KWARGS = dict(use_relay=False, relay_service=False, use_autonat=False)

PEER = """
    import logging, os, sys, time, torch
    import swarmtrain
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    host = {"use_relay": False, "relay_service": False, "use_autonat": False}
    dht = swarmtrain.DHT([sys.argv[1]], **host)
    print("ADDRS", *dht.get_visible_maddrs(), flush=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    built = time.monotonic()
    opt = swarmtrain.Optimizer(
        dht=dht, run_id=sys.argv[3], target_batch_size=32, batch_size_per_step=16,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        matchmaking_time=0.5, averaging_timeout=2.0,
    )
    started = time.monotonic()
    print("START", opt.local_epoch, opt.global_epoch, round(started - built, 3), flush=True)
    epoch = opt.local_epoch
    while opt.local_epoch < int(sys.argv[2]) and time.monotonic() < started + 120:
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if opt.local_epoch != epoch:
            epoch = opt.local_epoch
            print("EPOCH", epoch, round(time.monotonic() - started, 3), flush=True)
    os._exit(0)
"""


def spawn(bootstrap: str, epochs: int, run_id: str, lines: queue.Queue, tag: str):
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PEER), bootstrap, str(epochs), run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def read() -> None:
        for line in process.stdout:
            lines.put((tag, line.rstrip("\n")))
        lines.put((tag, None))

    threading.Thread(target=read, daemon=True).start()
    return process


def rerun(bootstrap: str, peers: int, run_id: str, timeout: float = 200.0) -> list[dict]:
    """Start ``peers`` peers of ``run_id``, each training one epoch; what each one reported."""
    lines: queue.Queue = queue.Queue()
    processes = [spawn(bootstrap, 1, run_id, lines, f"B{i}") for i in range(peers)]
    results = {f"B{i}": {"log": []} for i in range(peers)}
    ended = 0
    deadline = time.monotonic() + timeout
    try:
        while ended < peers:
            tag, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                ended += 1
                continue
            results[tag]["log"].append(line)
            if line.startswith("START"):
                _, _local, swarm, construct = line.split()
                results[tag].update(swarm_epoch=int(swarm), construct_s=float(construct))
            elif line.startswith("EPOCH") and "first_epoch_s" not in results[tag]:
                results[tag]["first_epoch_s"] = float(line.split()[2])
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return list(results.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--dead_hosts", choices=["refuse", "drop"], default="refuse")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    from swarmtrain.dht import DHT

    bootstrap = DHT(**HOST_KWARGS)
    address = str(bootstrap.get_visible_maddrs()[0])
    stale, fresh = [], []
    try:
        for repeat in range(args.repeats):
            run_id = f"rerun{os.getpid() % 10000}x{repeat}"
            lines: queue.Queue = queue.Queue()
            killed = [spawn(address, 10**6, run_id, lines, f"A{i}") for i in range(args.peers)]
            ports, epochs = [], {}
            while len(epochs) < args.peers or min(epochs.values()) < 3:
                tag, line = lines.get(timeout=120)
                if line is None:
                    raise RuntimeError(f"peer {tag} of the first run exited")
                if line.startswith("ADDRS"):
                    ports += [int(p) for p in re.findall(r"/ip4/127\.0\.0\.1/tcp/(\d+)", line)]
                elif line.startswith("EPOCH"):
                    epochs[tag] = int(line.split()[1])
            for process in killed:
                process.send_signal(signal.SIGKILL)
                process.wait()
            traps = []
            if args.dead_hosts == "drop":
                for port in ports:
                    traps += silent_port(port)
            try:
                results = rerun(address, args.peers, run_id)
            finally:
                for sock in traps:
                    sock.close()
            print(f"killed at epochs {sorted(epochs.values())}; rerun:")
            for r in results:
                print(
                    f"  swarm epoch at start {r.get('swarm_epoch')}, Optimizer built in "
                    f"{r.get('construct_s')} s, first epoch after {r.get('first_epoch_s')} s"
                )
                for line in r["log"]:
                    if "WARNING" in line:
                        print("    " + line[:160])
            stale += results
            fresh += rerun(address, args.peers, run_id + "_fresh")
    finally:
        bootstrap.shutdown()

    def median(rows: list[dict], field: str) -> float:
        return statistics.median(r.get(field, float("nan")) for r in rows)

    print(f"\n{args.peers} peers killed, dead hosts {args.dead_hosts}, {args.repeats} repeat(s)")
    for field in ("construct_s", "first_epoch_s"):
        s, f = median(stale, field), median(fresh, field)
        print(f"  {field}: rerun {s:.2f} s, fresh run_id {f:.2f} s, ratio {s / f:.1f}x")
    print("  rerun swarm epochs at start:", [r.get("swarm_epoch") for r in stale])


if __name__ == "__main__":
    main()
