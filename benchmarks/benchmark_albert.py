"""Samples/s of the tiny ALBERT recipe (``examples/albert/run_trainer.py``) with 1, 2 and 3 peers.

Each peer is its own process on this machine (as in a real run), started with the recipe's
own flags; the first prints its address, the others join it, every peer waits until all are
seen, then trains ``--steps`` local Trainer steps. A peer reports its samples and seconds of
``trainer.train()``; the swarm's samples/s is the sum over peers. Repetitions alternate the
peer counts. Prints the medians and the ratio to one peer::

    PYTHONPATH=. python benchmarks/benchmark_albert.py --steps 120 --repeats 3

On a machine with fewer cores than peers the peers share the cores: the ratio then shows what
averaging costs, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--max_files", "6",
    "--vocab_size", "400",
    "--seq_len", "32",
    "--per_device_train_batch_size", "8",
    "--matchmaking_time", "1.0",
    "--averaging_timeout", "15",
    "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
    "--progress_bars", "off",
]  # fmt: skip
PEER = """
import json, sys
sys.path.insert(0, "examples/albert")
import run_trainer
result = run_trainer.main(sys.argv[1:])
print("RESULT " + json.dumps({k: result[k] for k in ("samples", "seconds", "epoch")}), flush=True)
"""


def run_swarm(peers: int, steps: int, run: int, out: Path, target: int) -> list[dict]:
    common = [*TINY, "--max_steps", str(steps), "--wait_for_peers", str(peers)]
    common += ["--target_batch_size", str(target)]
    common += ["--run_id", f"bench_albert_{os.getpid()}_{run}_{peers}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        first = subprocess.Popen(
            [sys.executable, "-c", PEER, *common, "--output_dir", str(out / f"{run}_{peers}_0")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(first)
        assert first.stdout is not None
        join = ""
        for line in first.stdout:
            if line.startswith("join this run with: --initial_peers "):
                join = line.split("--initial_peers ", 1)[1].split()[0]
                break
        if not join:
            raise RuntimeError("the first peer printed no address")
        for i in range(1, peers):
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-c", PEER, *common, "--initial_peers", join),
                        *("--output_dir", str(out / f"{run}_{peers}_{i}")),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        results = []
        for proc in procs:
            stdout, _ = proc.communicate(timeout=900)
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"a peer failed (exit {proc.returncode})")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="local Trainer steps per peer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target_batch_size", type=int, default=512, help="samples per epoch")
    parser.add_argument("--peers", default="1,2,3")
    parser.add_argument("--output_dir", default="/tmp/benchmark_albert")
    args = parser.parse_args()
    counts = [int(n) for n in args.peers.split(",")]
    rates: dict[int, list[float]] = {n: [] for n in counts}
    print(f"# load before: {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores", flush=True)
    for run in range(args.repeats):
        for peers in counts:
            results = run_swarm(
                peers, args.steps, run, Path(args.output_dir), args.target_batch_size
            )
            rate = sum(r["samples"] / r["seconds"] for r in results)
            rates[peers].append(rate)
            epochs = [r["epoch"] for r in results]
            print(f"run {run}: {peers} peer(s) {rate:.1f} samples/s, epochs {epochs}", flush=True)
    print(f"# load after: {os.getloadavg()[0]:.1f}")
    base = statistics.median(rates[counts[0]])
    for peers in counts:
        median = statistics.median(rates[peers])
        print(f"{peers} peer(s): median {median:.1f} samples/s, {median / base:.2f}x {counts[0]}")


if __name__ == "__main__":
    main()
