"""All-reduce round time next to a busy pure-Python main thread: in-process vs helper process.

    python benchmarks/benchmark_process_mode.py [--numel 8M] [--rounds 6] [--repeats 1]
        [--modes thread,thread-1ms,thread-0.1ms,process] [--pin off|on|both]

Two peers, one process each (started by this script, ``--worker``; the parent sends commands
over stdin and reads JSON replies), average ``--numel`` float32 values per round. Modes:

- ``thread``: the blocking ``DHT`` + ``DecentralizedAverager``: the swarm runs on the trio loop
  in a background thread of the trainer's process (the default), switch interval 5 ms;
- ``thread-1ms``, ``thread-0.1ms``: the same with ``sys.setswitchinterval`` lowered in both
  peers (the cheapest in-process mitigation: the loop thread gets the GIL more often);
- ``process``: ``ProcessAverager``: the swarm (host, DHT, averager) in a helper process, the
  tensors in shared memory;
- ``spin-elsewhere`` (a control): ``thread``, but a busy round spins in a separate process
  (the same CPU load, no shared GIL): what a busy trainer costs on this machine without the
  GIL, i.e. the best any mode can do here.

A round: both peers start ``step(wait=False, require_trigger=True, expected_group_size=2)``
and wait until their group is assembled (``AWAITING_TRIGGER``); then the parent tells both to
go, and each measures from ``allow_allreduce()`` to the step's result. In a *busy* round peer 0's
main thread spins in pure Python (holding the GIL, as a Python-heavy trainer does) until its
step is done; in an *idle* round it waits in ``result()``. Round time = the slower peer's.
Idle and busy rounds alternate; medians over the rounds after the first (warm-up) of each
kind. Every round checks that both peers hold the mean. Printed ratios (speed, higher is
better): busy vs idle in the same mode, and each mode's idle speed vs the first mode's (the
overhead of the mode); also the median time to start a peer's averager (and DHT) and the
helper process's resident memory. With ``spin-elsewhere`` among the modes, each mode's busy
speed vs that control's: the same CPU load, so what is left is what the shared GIL costs (on
a machine without a free core the busy loop also slows every mode, control included).

``--pin on`` gives the busy and the idle rounds the same CPU placement (``sched_setaffinity``,
Linux, 2 cores or more): peer 0's main thread alone on core 0 (the ``spin-elsewhere`` spinner
too); everything else on core 1: peer 0's other threads (the ``thread`` modes' trio loop and
its worker threads, ``process``'s pipe reader), its helper process, and peer 1 (all of its
threads and its helper). Busy and idle rounds then differ only in whether core 0 spins, never
in the cores the swarm has, so busy/idle shows what the spin costs through the GIL alone
(``spin-elsewhere`` pinned: ~1x if the placement holds). It says nothing about a machine with
fewer cores than busy threads (the unpinned rows show that), and the swarm of both peers has
one core, so pinned idle rounds are slower than unpinned ones. Only the workers (and the
processes and threads they start) are pinned, each placement checked from
``/proc/<pid>/task/*/status``; they exit after each block, the parent is never pinned.
``--pin both`` runs each mode unpinned, then pinned, then the next mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark_averaging import MARK, Worker, load_text, parse_config

PREFIX = "benchproc"
HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
AVERAGER = {
    "target_group_size": 2,
    "min_group_size": 2,
    "min_matchmaking_time": 1.0,
    "request_timeout": 0.5,
}
#: with ``--pin on``: peer 0's main thread (the "trainer") / everything else (the swarm)
TRAINER_CORE, SWARM_CORE = 0, 1
SWITCH_INTERVALS = {
    "thread": None,
    "thread-1ms": 1e-3,
    "thread-0.1ms": 1e-4,
    "process": None,
    "spin-elsewhere": None,
}


# --------------------------------------------------------------------------- worker


def spin_until(done) -> int:
    """Pure-Python work until ``done()``: the GIL stays with this thread but for the switches."""
    spins = 0
    while not done():
        total = 0
        for i in range(2000):
            total += i * i
        spins += 1
    return spins


def thread_cpus(pid: int) -> dict[str, str]:
    """``{thread id: allowed CPUs}`` of every thread of process ``pid`` (Linux)."""
    cpus = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        except (OSError, StopIteration):
            continue  # the thread ended meanwhile
        cpus[tid] = line.split(":", 1)[1].strip()
    return cpus


def placement(main_pid: int, other_pids: list[int]) -> dict[str, list[str]]:
    """Where this worker's threads may run: its main thread, its other threads, and every
    thread of ``other_pids`` (its helper process, its spinner)."""
    own = thread_cpus(main_pid)
    main = own.pop(str(main_pid))
    others = sorted(set(own.values()))
    helpers = sorted({c for pid in other_pids for c in thread_cpus(pid).values()})
    return {"main": [main], "threads": others, "helpers": helpers}


def spinner(conn) -> None:
    """``spin-elsewhere``: spin (as ``spin_until``) between a "spin" and a "stop" message."""
    while conn.recv() == "spin":
        spin_until(conn.poll)
        conn.recv()  # "stop"
        conn.send("stopped")


def worker(args) -> None:
    if args.pinned:  # this thread, and every thread and process it starts from now on
        os.sched_setaffinity(0, {SWARM_CORE})
    import torch

    interval = SWITCH_INTERVALS[args.mode]
    if interval is not None:
        sys.setswitchinterval(interval)

    def reply(message) -> None:
        print(MARK + json.dumps(message), flush=True)

    tensors = [torch.zeros(args.numel)]
    dht = None
    started = time.perf_counter()
    if args.mode == "process":
        from swarmtrain.averaging.process_averager import ProcessAverager

        averager = ProcessAverager(
            tensors,
            prefix=PREFIX,
            initial_peers=args.initial_peer,
            dht_kwargs=HOST,
            **AVERAGER,
        )
        maddrs = averager.get_visible_maddrs()
    else:
        from swarmtrain.averaging import DecentralizedAverager
        from swarmtrain.dht import DHT

        dht = DHT(args.initial_peer, **HOST)
        averager = DecentralizedAverager(tensors, dht, prefix=PREFIX, **AVERAGER)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
    if args.pinned and args.index == 0:  # the trainer's main thread alone (Linux: per thread)
        os.sched_setaffinity(0, {TRAINER_CORE})
    spin_conn = None
    other_pids = [averager.pid] if args.mode == "process" else []
    if args.mode == "spin-elsewhere":  # the same busy loop, in a process of its own
        import multiprocessing

        spin_conn, child_conn = multiprocessing.get_context("spawn").Pipe()
        spin_process = multiprocessing.get_context("spawn").Process(
            target=spinner, args=(child_conn,), daemon=True
        )
        spin_process.start()
        other_pids.append(spin_process.pid)
    start_s = time.perf_counter() - started
    helper_rss_mb = None
    if args.mode == "process":
        with open(f"/proc/{averager.pid}/status") as f:
            rss = next(line for line in f if line.startswith("VmRSS:"))
        helper_rss_mb = int(rss.split()[1]) / 1024
    reply(
        {
            "maddrs": maddrs,
            "start_s": start_s,
            "helper_rss_mb": helper_rss_mb,
            "placement": placement(os.getpid(), other_pids),
        }
    )
    control = None
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "placement":  # after the rounds: the threads started meanwhile too
                reply({"placement": placement(os.getpid(), other_pids)})
            if cmd["op"] == "prepare":
                with averager.get_tensors() as local:
                    local[0].fill_(args.index + cmd["round"])
                control = averager.step(
                    wait=False, require_trigger=True, expected_group_size=2, timeout=60
                )
                deadline = time.monotonic() + 60
                while control.stage.name != "AWAITING_TRIGGER" and not control.done():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                reply({"stage": control.stage.name})
            elif cmd["op"] == "go":
                started = time.perf_counter()
                control.allow_allreduce()
                if cmd["busy"] and spin_conn is not None:
                    spin_conn.send("spin")
                    wait([control], 120)  # errors are read below
                    spin_conn.send("stop")
                    spin_conn.recv()
                    spins = -1
                else:
                    spins = spin_until(control.done) if cmd["busy"] else 0
                error = None
                try:
                    control.result(120)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                elapsed = time.perf_counter() - started
                with averager.get_tensors() as local:
                    max_err = (local[0] - (0.5 + cmd["round"])).abs().max().item()
                reply({"s": elapsed, "error": error, "max_err": max_err, "spins": spins})
        if spin_conn is not None:
            spin_conn.send("exit")
        reply({"bye": True})
    finally:
        averager.shutdown()
        if dht is not None:
            dht.shutdown()


# --------------------------------------------------------------------------- parent


def expected_placement(index: int, mode: str, pinned: bool) -> dict[str, str]:
    """The CPUs each part of worker ``index`` may use (``--pin``; else the parent's)."""
    if not pinned:
        everywhere = thread_cpus(os.getpid())[str(os.getpid())]
        return {"main": everywhere, "threads": everywhere, "helpers": everywhere}
    trainer, swarm = str(TRAINER_CORE), str(SWARM_CORE)
    spinner_core = trainer if index == 0 else swarm
    return {
        "main": trainer if index == 0 else swarm,
        "threads": swarm,
        "helpers": spinner_core if mode == "spin-elsewhere" else swarm,
    }


def check_placement(label: str, index: int, mode: str, pinned: bool, found: dict) -> None:
    expected = expected_placement(index, mode, pinned)
    wrong = {k: v for k, v in found.items() if any(c != expected[k] for c in v)}
    if wrong:
        raise RuntimeError(f"{label}: peer {index} runs on {found}, expected {expected}")


def run_mode(mode: str, args, tmpdir: str, block: int, pinned: bool) -> dict:
    label = f"{mode} pinned" if pinned else mode
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode]
    base += ["--numel", str(args.numel_value)] + (["--pinned"] if pinned else [])
    workers: list[Worker] = []
    times: dict[str, list[float]] = {"idle": [], "busy": []}
    failed = 0
    try:
        tag = f"{mode}_{'pinned' if pinned else 'free'}_{block}"
        log = os.path.join(tmpdir, f"{tag}_0.log")
        workers.append(Worker([*base, "--index", "0"], log))
        first = workers[0].receive(args.start_timeout)
        extra = [x for m in first["maddrs"] for x in ("--initial-peer", m)]
        log = os.path.join(tmpdir, f"{tag}_1.log")
        workers.append(Worker([*base, "--index", "1", *extra], log))
        second = workers[1].receive(args.start_timeout)
        for index, reply in enumerate((first, second)):
            check_placement(label, index, mode, pinned, reply["placement"])
        starts = [first["start_s"], second["start_s"]]
        rss = [first["helper_rss_mb"], second["helper_rss_mb"]]
        for r in range(2 * args.rounds):
            kind = "busy" if r % 2 else "idle"
            for w in workers:
                w.send(op="prepare", round=r)
            stages = [w.receive(120)["stage"] for w in workers]
            for i, w in enumerate(workers):
                w.send(op="go", round=r, busy=kind == "busy" and i == 0)
            replies = [w.receive(180) for w in workers]
            errors = [x["error"] for x in replies if x["error"]]
            ok = not errors and all(x["max_err"] < 1e-5 for x in replies)
            round_s = max(x["s"] for x in replies)
            if args.verbose:
                print(
                    f"    {label} round {r} {kind}: {round_s:.3f} s, stages {stages}, "
                    f"spins {replies[0]['spins']}" + ("" if ok else f" FAILED {errors}"),
                    flush=True,
                )
            if not ok:
                failed += 1
            elif r >= 2:  # the first round of each kind is warm-up
                times[kind].append(round_s)
        for index, w in enumerate(workers):
            w.send(op="placement")
            found = w.receive(30)["placement"]
            check_placement(label, index, mode, pinned, found)
            if args.verbose:
                print(f"    {label} peer {index} CPUs after the rounds: {found}", flush=True)
    finally:
        for w in workers:
            w.close()
    return {**times, "failed": failed, "start_s": starts, "helper_rss_mb": rss}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def parent(args) -> None:
    args.numel_value = parse_config(f"1x{args.numel}")[1]
    modes = args.modes.split(",")
    placements = {"off": [False], "on": [True], "both": [False, True]}[args.pin]
    if True in placements and not {TRAINER_CORE, SWARM_CORE} <= os.sched_getaffinity(0):
        raise SystemExit(f"--pin needs cores {TRAINER_CORE} and {SWARM_CORE}")
    runs = [(m, p) for m in modes for p in placements]  # each mode both ways in turn
    labels = {run: f"{run[0]} pinned" if run[1] else run[0] for run in runs}
    own_cpus = os.sched_getaffinity(0)
    print(f"# {args.numel} float32 per peer, 2 peers, {args.rounds} idle + {args.rounds} busy")
    print(f"# load before: {load_text()}  (os.getloadavg, 1/5/15 min)")
    results = {run: {"idle": [], "busy": [], "failed": 0, "start_s": [], "rss": []} for run in runs}
    with tempfile.TemporaryDirectory() as tmpdir:
        for block in range(args.repeats):
            for mode, pinned in runs:
                result = run_mode(mode, args, tmpdir, block, pinned)
                totals = results[mode, pinned]
                for key in ("idle", "busy"):
                    totals[key] += result[key]
                totals["failed"] += result["failed"]
                totals["start_s"] += result["start_s"]
                totals["rss"] += [x for x in result["helper_rss_mb"] if x is not None]
    print(f"# load after: {load_text()}")
    if os.sched_getaffinity(0) != own_cpus:  # never expected: only the workers pin themselves
        raise RuntimeError(f"the parent's CPUs changed: {own_cpus} -> {os.sched_getaffinity(0)}")
    control = "spin-elsewhere"
    width = max(len(label) for label in labels.values()) + 2
    print(
        f"{'mode':<{width}}{'idle s':>9}{'busy s':>9}{'busy/idle speed':>17}"
        f"{'  idle speed vs ' + modes[0]:>28}{'busy vs ' + control:>24}"
        f"{'failed':>8}{'start s':>9}{'helper MiB':>12}"
    )
    for mode, pinned in runs:  # the baselines: the same placement's first mode and control
        totals = results[mode, pinned]
        base_idle = median(results[modes[0], pinned]["idle"])
        control_run = results.get((control, pinned))
        control_busy = median(control_run["busy"]) if control_run else float("nan")
        idle, busy = median(totals["idle"]), median(totals["busy"])
        print(
            f"{labels[mode, pinned]:<{width}}{idle:>9.3f}{busy:>9.3f}{idle / busy:>16.2f}x"
            f"{base_idle / idle:>27.2f}x{control_busy / busy:>23.2f}x{totals['failed']:>8}"
            f"{median(totals['start_s']):>9.1f}"
            + (f"{median(totals['rss']):>12.0f}" if totals["rss"] else f"{'':>12}")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({labels[run]: totals for run, totals in results.items()}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", default="8M", help="float32 values per peer (M = 2**20)")
    parser.add_argument("--rounds", type=int, default=6, help="idle and busy rounds, each")
    parser.add_argument("--repeats", type=int, default=1, help="alternating blocks of modes")
    parser.add_argument("--modes", default="thread,thread-1ms,thread-0.1ms,process")
    parser.add_argument(
        "--pin",
        choices=("off", "on", "both"),
        default="off",
        help="the same CPU placement for busy and idle rounds (see the docstring)",
    )
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="thread", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.numel = int(args.numel)
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
