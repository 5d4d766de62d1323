"""swarmtrain.Optimizer: epochs per minute against hivemind 1.1.12, and compute utilization.

    python benchmarks/benchmark_optimizer.py epochs --impl both --python /tmp/hm/bin/python
    python benchmarks/benchmark_optimizer.py epochs --config plain --impl both --python ...
    python benchmarks/benchmark_optimizer.py utilization --peers 4 [--delay]

``epochs``: 3 peers (one process each) train a small MLP with Adam, target_batch_size 256,
batch 32, matchmaking_time 2, for ``--duration`` seconds; reports epochs per minute, the
samples per epoch, and the evaluation loss (at the end, and at the last epoch both
implementations reached). hivemind runs the same worker code under ``--python`` (a venv with
hivemind 1.1.12); swarmtrain is never imported there, nor hivemind here. Workers import the
swarmtrain of this checkout (``PYTHONPATH``), not an installed one.

``epochs --config plain``: the same 3 peers, but each runs what a hivemind user writes: the
DHT with its default host settings, ``Optimizer(dht=, run_id=, target_batch_size=256,
batch_size_per_step=32, optimizer=torch.optim.Adam(model.parameters()), matchmaking_time=2.0,
averaging_timeout=10.0)`` (``--optimizer-form factory``: ``optimizer=lambda p: Adam(p),
params=...``), no wait for peers, no evaluation per epoch; it counts the epochs reached in
``--duration`` seconds. ``--verbose`` shows, per peer, the time spent in the Optimizer's phases
(gradient round, state averager steps, waits for delayed state rounds).

``utilization``: N peers (one process each) train a wider MLP; compute utilization is the time
a peer spends in forward + backward over the wall time of its training loop (the evaluation at
each epoch's end, a benchmark artefact, is not counted). The baseline is one process training
alone with plain ``torch.optim.Adam`` on the same model and batch, measured in the same run.
``--delay`` passes ``delay_optimizer_step`` and ``delay_grad_averaging`` (background averaging
and optimizer step) when this swarmtrain's ``Optimizer`` has them. ``--accelerator-ms X`` adds a
GIL-free wait of X ms to every forward + backward (in both arms): a stand-in for an accelerator,
which computes while the host CPU is free for the network and the background step. Without it,
on a box with fewer cores than peers, every peer's averaging and optimizer work competes with
the others' forward + backward for the same cores.

Every arm runs ``--repeats`` times; the tables show medians. Workers use one torch thread each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
CLASSES = 10


# ---------------------------------------------------------------------------------- worker


def make_workload(features: int, hidden: int, layers: int, seed: int = 0):
    """Data and initial weights from numpy's PCG64 (identical under both venvs' torch)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(CLASSES, features)) * 0.6
    labels = rng.integers(0, CLASSES, size=12000)
    points = centres[labels] + rng.normal(size=(len(labels), features))
    x = torch.tensor(points, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.int64)
    sizes = [features] + [hidden] * layers + [CLASSES]
    modules: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        linear = torch.nn.Linear(fan_in, fan_out)
        bound = 1 / fan_in**0.5
        with torch.no_grad():
            linear.weight.copy_(torch.tensor(rng.uniform(-bound, bound, (fan_out, fan_in))))
            linear.bias.copy_(torch.tensor(rng.uniform(-bound, bound, fan_out)))
        modules += [linear, torch.nn.ReLU()]
    model = torch.nn.Sequential(*modules[:-1])
    return model, (x[:10000], y[:10000]), (x[10000:], y[10000:])


def _emit(message: dict) -> None:
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def _wait_line() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the orchestrator is gone
    return json.loads(line)


def _make_plain_optimizer(args, model, initial_peers):
    """``--config plain``: the Optimizer as a hivemind user's script builds it: default DHT
    host settings, an optimizer instance (``--optimizer-form factory``: a factory + params),
    hivemind's keywords only."""
    import torch

    if args.impl == "hivemind":
        import hivemind as library
    else:
        import swarmtrain as library
    dht = library.DHT(initial_peers=initial_peers, start=True)
    if args.optimizer_form == "factory":
        form = dict(
            optimizer=lambda params: torch.optim.Adam(params, lr=args.lr),
            params=model.parameters(),
        )
    else:
        form = dict(optimizer=torch.optim.Adam(model.parameters(), lr=args.lr))
    opt = library.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target,
        batch_size_per_step=args.batch,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        **form,
        **json.loads(args.opts),
    )
    return opt, dht, [str(a) for a in dht.get_visible_maddrs()]


def _make_optimizer(args, model, initial_peers):
    """(optimizer, dht, maddrs) for the chosen implementation; plain Adam for "local"."""
    import torch

    if args.config == "plain":
        return _make_plain_optimizer(args, model, initial_peers)

    adam = lambda params: torch.optim.Adam(params, lr=args.lr)  # noqa: E731
    extra = json.loads(args.opts)
    common = dict(
        run_id=args.run_id,
        target_batch_size=args.target,
        batch_size_per_step=args.batch,
        optimizer=adam,
        params=model.parameters(),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        **extra,
    )
    if args.impl == "local":
        return adam(model.parameters()), None, []
    if args.impl == "hivemind":
        import hivemind

        dht = hivemind.DHT(
            initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
        )
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        return hivemind.Optimizer(dht=dht, **common), dht, maddrs
    import swarmtrain

    host = {"use_relay": False, "relay_service": False, "use_autonat": False}
    dht = swarmtrain.DHT(initial_peers, **host)
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    return swarmtrain.Optimizer(dht=dht, **common), dht, maddrs


def _evaluate(model, eval_set) -> float:
    import torch

    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(eval_set[0]), eval_set[1]).item()


def _timed_methods(opt) -> dict[str, list[float]]:
    """Wrap swarmtrain internals (when present) to time where ``step`` spends its time."""
    timings: dict[str, list[float]] = {}
    tracker = getattr(opt, "tracker", None)
    targets = [
        # the facade's step: the batch part in this thread, the loop entered for loop work
        ("AsyncOptimizer.on_batch (trainer thread)", getattr(opt, "_opt", None), "on_batch"),
        ("Optimizer._call (on the loop: epoch ends, rounds, loads)", opt, "_call"),
        ("tracker.update_epoch", tracker, "update_epoch"),
        ("load_state_from_peers", opt, "load_state_from_peers"),
    ]
    for name, owner, attr in targets:
        method = getattr(owner, attr, None) if owner is not None else None
        if method is None:
            continue
        times = timings.setdefault(name, [])

        def timed(*a, _method=method, _times=times, **kw):
            started = time.perf_counter()
            try:
                return _method(*a, **kw)
            finally:
                _times.append(time.perf_counter() - started)

        setattr(owner, attr, timed)
    return timings


def _wait_for_peers(opt, model, batch, peers: int, timeout: float = 60.0) -> float:
    """Report a little progress (one sample per step, 20 steps/s) until this peer's tracker
    sees every peer, so that no peer trains alone at the start: a lone peer steps without
    averaging, and its fast, meaningless epochs would count. Trackers only announce peers
    that report progress, hence the slow steps."""
    import torch

    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if opt.tracker.global_progress.num_peers >= peers:
            break
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step(batch_size=1)
        opt.zero_grad()
        time.sleep(0.05)
    return time.perf_counter() - started


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    sys.stdout = sys.stderr  # stdout carries the protocol only
    # worker logs (shown with --verbose) carry the time and the peer; BENCH_DEBUG=a,b logs
    # the loggers a and b (e.g. swarmtrain.optim,swarmtrain.averaging) at DEBUG level
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s.%(msecs)03d p{args.index} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for name in filter(None, os.environ.get("BENCH_DEBUG", "").split(",")):
        logging.getLogger(name).setLevel(logging.DEBUG)
    model, (x, y), eval_set = make_workload(args.features, args.hidden, args.layers)
    shard = torch.arange(args.index, len(x), max(1, args.peers))
    x, y = x[shard], y[shard]
    initial = [] if args.index == 0 or args.impl == "local" else _wait_line()["initial_peers"]
    opt, dht, maddrs = _make_optimizer(args, model, initial)
    timings = _timed_methods(opt) if args.impl == "swarmtrain" else {}
    _emit({"event": "joined", "maddrs": maddrs})
    plain = args.config == "plain"  # a user's script: no wait for peers, no evaluation per epoch
    waited = 0.0
    if dht is not None and not plain:
        waited = _wait_for_peers(opt, model, (x[:1], y[:1]), args.peers)
    _emit({"event": "ready", "waited": waited})
    _wait_line()  # start
    for times in timings.values():
        times.clear()  # count the measured window only, not the warm-up
    first_epoch = getattr(opt, "local_epoch", 0)
    generator = torch.Generator().manual_seed(args.index)
    epoch_of = (lambda: getattr(opt, "local_epoch", 0)) if dht is not None else None
    epochs_at, eval_by_epoch, step_times = [], [], []
    compute = samples = local_steps = evaluating = 0
    epoch = epoch_of() if epoch_of else 0
    started = time.perf_counter()
    while time.perf_counter() - started < args.duration:
        rows = torch.randint(0, len(x), (args.batch,), generator=generator)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        if args.accelerator_ms > 0:
            time.sleep(args.accelerator_ms / 1000)  # the accelerator computes; the CPU is free
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        compute += t1 - t0
        step_times.append(t2 - t1)
        samples += args.batch
        if epoch_of is None:
            local_steps += 1
            continue
        if epoch_of() != epoch:
            epoch = epoch_of()
            epochs_at.append(round(t2 - started, 3))
            if not plain:
                eval_by_epoch.append((epoch, _evaluate(model, eval_set)))
                evaluating += time.perf_counter() - t2
    wall = time.perf_counter() - started - evaluating  # the training loop's time
    step_times.sort()
    result = {
        "event": "result",
        "epochs": epoch_of() - first_epoch if epoch_of else 0,
        "warmup_epochs": first_epoch,
        "epochs_at": epochs_at,
        "eval_by_epoch": eval_by_epoch,
        "eval_loss": _evaluate(model, eval_set),
        "wall": wall,
        "compute": compute,
        "samples": samples,
        "step_total": sum(step_times),
        "step_p50": step_times[len(step_times) // 2] if step_times else 0.0,
        "step_max": step_times[-1] if step_times else 0.0,
        "timings": {k: [len(v), sum(v), max(v, default=0.0)] for k, v in timings.items()},
    }
    for name in ("epochs_averaged", "epochs_alone"):
        if hasattr(opt, name):
            result[name] = getattr(opt, name)
    _emit(result)
    _wait_line()  # exit: stay in the swarm until every peer reported
    if dht is not None:
        opt.shutdown()
        dht.shutdown()


# ---------------------------------------------------------------------------------- runner


def run_swarm(args, impl: str, peers: int, workload: dict, opts: dict) -> list[dict]:
    """Start ``peers`` worker processes, train together for ``args.duration`` s, return their
    results (one dict per peer)."""
    python = args.python if impl == "hivemind" else sys.executable
    command = [python, HERE, "--worker", "--impl", impl, "--peers", str(peers)]
    command += ["--duration", str(args.duration), "--opts", json.dumps(opts)]
    command += ["--run-id", f"bench{os.getpid()}_{time.monotonic_ns()}"]
    command += ["--accelerator-ms", str(getattr(args, "accelerator_ms", 0.0))]
    command += ["--config", args.config, "--optimizer-form", args.optimizer_form]
    for key, value in workload.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if impl != "hivemind":  # measure the swarmtrain of this checkout, not an installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    log = open(os.devnull, "w") if not args.verbose else None
    procs = [
        subprocess.Popen(
            [*command, "--index", str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        for i in range(peers)
    ]

    def send(proc, message):
        proc.stdin.write(json.dumps(message) + "\n")
        proc.stdin.flush()

    def read(proc) -> dict:
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a {impl} worker exited early (rerun with --verbose)")
            if line.startswith("{"):
                return json.loads(line)

    try:
        first = read(procs[0])
        for proc in procs[1:]:
            send(proc, {"initial_peers": first["maddrs"]})
        for proc in procs[1:]:
            read(proc)  # joined
        waited = [read(proc)["waited"] for proc in procs]  # ready: each sees all peers
        if args.verbose:
            print(f"    {impl}: peers saw each other after {max(waited):.1f} s", flush=True)
        for proc in procs:
            send(proc, {"cmd": "start"})
        results: list[dict] = [{} for _ in procs]

        def collect(i):
            results[i] = read(procs[i])

        threads = [threading.Thread(target=collect, args=(i,)) for i in range(peers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.duration + 120)
        if not all(results):
            raise RuntimeError(f"a {impl} worker did not report (rerun with --verbose)")
        for proc in procs:
            send(proc, {"cmd": "exit"})
        for proc in procs:
            proc.wait(timeout=60)
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if log is not None:
            log.close()


def summarize(results: list[dict], duration: float) -> dict:
    epochs = statistics.median(r["epochs"] for r in results)
    samples = sum(r["samples"] for r in results)
    summary = {
        "epochs": epochs,
        "epochs_per_min": 60 * epochs / duration,
        "samples_per_s": samples / statistics.median(r["wall"] for r in results),
        "samples_per_epoch": samples / max(epochs, 1),
        "utilization": statistics.median(r["compute"] / r["wall"] for r in results),
        "eval_loss": statistics.median(r["eval_loss"] for r in results),
        "step_p50_ms": 1000 * statistics.median(r["step_p50"] for r in results),
        "step_share": statistics.median(r["step_total"] / r["wall"] for r in results),
        "eval_by_epoch": dict(results[0]["eval_by_epoch"]),
    }
    gaps = [b - a for r in results for a, b in itertools.pairwise(r["epochs_at"])]
    summary["epoch_s_p50"] = statistics.median(gaps) if gaps else float("nan")
    timings: dict[str, list[float]] = {}
    for r in results:
        for name, (count, total, worst) in r.get("timings", {}).items():
            entry = timings.setdefault(name, [0, 0.0, 0.0])
            entry[0] += count
            entry[1] += total
            entry[2] = max(entry[2], worst)
    summary["timings"] = {
        k: [c / len(results), t / len(results), w] for k, (c, t, w) in timings.items()
    }
    if any("epochs_alone" in r for r in results):
        summary["epochs_alone"] = sum(r.get("epochs_alone", 0) for r in results)
    return summary


def medians(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(run[k] for run in runs) for k in keys}


EPOCHS_WORKLOAD = {
    "features": 64,
    "hidden": 128,
    "layers": 2,
    "batch": 32,
    "target": 256,
    "matchmaking_time": 2.0,
    "averaging_timeout": 30.0,
    "lr": 0.001,
}
PLAIN_WORKLOAD = dict(EPOCHS_WORKLOAD, averaging_timeout=10.0)  # the script
UTILIZATION_WORKLOAD = dict(
    EPOCHS_WORKLOAD, hidden=1024, layers=3, target=4096, matchmaking_time=1.0
)


def bench_epochs(args) -> dict:
    impls = ["swarmtrain", "hivemind"] if args.impl == "both" else [args.impl]
    if "hivemind" in impls and not args.python:
        raise SystemExit("--impl hivemind/both needs --python pointing at hivemind's venv")
    workload = PLAIN_WORKLOAD if args.config == "plain" else EPOCHS_WORKLOAD
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for repeat in range(args.repeats):
        for impl in impls:  # interleaved, so both see the same machine load
            opts = json.loads(args.optimizer_opts)
            summary = summarize(run_swarm(args, impl, 3, workload, opts), args.duration)
            summary["load_avg_1min"] = os.getloadavg()[0]
            runs[impl].append(summary)
            alone = (
                f", {summary['epochs_alone']} peer-epochs alone"
                if "epochs_alone" in summary
                else ""
            )
            print(
                f"  run {repeat + 1} {impl:10s}: {summary['epochs']:g} epochs, "
                f"{summary['samples_per_epoch']:.0f} samples/epoch, "
                f"eval loss {summary['eval_loss']:.3f}, epoch {summary['epoch_s_p50']:.2f} s"
                f"{alone}, load {summary['load_avg_1min']:.2f}",
                flush=True,
            )
            if args.verbose and summary["timings"]:
                print(f"    per peer: {json.dumps(summary['timings'])}")
    table = {impl: medians(r) for impl, r in runs.items()}
    config = "plain script" if args.config == "plain" else "benchmark loop"
    if args.config == "plain":
        config += f", optimizer {args.optimizer_form}"
    print(f"\n3 peers ({config}), MLP {workload}, {args.duration:g} s, median of {args.repeats}\n")
    print("| impl | epochs/min | epoch (s) | samples/epoch | eval loss (end) | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for impl, m in table.items():
        print(
            f"| {impl} | {m['epochs_per_min']:.1f} | {m['epoch_s_p50']:.2f} | "
            f"{m['samples_per_epoch']:.0f} | {m['eval_loss']:.3f} | {m['load_avg_1min']:.1f} |"
        )
    if len(table) == 2:
        common = int(min(m["epochs"] for m in table.values()))
        at = {
            impl: statistics.median(
                r["eval_by_epoch"].get(common, float("nan")) for r in runs[impl]
            )
            for impl in impls
        }
        ratio = table["swarmtrain"]["epochs_per_min"] / table["hivemind"]["epochs_per_min"]
        loss_at = ""
        if args.config != "plain":  # the plain script evaluates at the end only
            loss_at = (
                f"; eval loss at epoch {common}: swarmtrain {at['swarmtrain']:.3f}, "
                f"hivemind {at['hivemind']:.3f}"
            )
        print(f"\nepochs/min swarmtrain / hivemind: {ratio:.2f}x (goal >= 2x){loss_at}")
        table["ratio"] = {"epochs_per_min": ratio, "common_epoch": common, **at}
    return table


def bench_utilization(args) -> dict:
    opts = {}
    if args.delay:
        import inspect

        import swarmtrain

        known = inspect.signature(swarmtrain.Optimizer).parameters
        wanted = {"delay_optimizer_step": True, "delay_grad_averaging": True}
        opts = {k: v for k, v in wanted.items() if k in known}
        missing = sorted(set(wanted) - set(opts))
        if missing:
            print(f"this Optimizer has no {missing}: measuring without them")
    solo_runs, swarm_runs = [], []
    for repeat in range(args.repeats):
        solo = summarize(run_swarm(args, "local", 1, UTILIZATION_WORKLOAD, {}), args.duration)
        swarm = summarize(
            run_swarm(args, "swarmtrain", args.peers, UTILIZATION_WORKLOAD, opts), args.duration
        )
        solo_runs.append(solo)
        swarm_runs.append(swarm)
        print(
            f"  run {repeat + 1}: alone {solo['samples_per_s']:.0f} samples/s "
            f"(utilization {solo['utilization']:.1%}); {args.peers} peers "
            f"{swarm['samples_per_s']:.0f} samples/s (utilization {swarm['utilization']:.1%}, "
            f"{swarm['epochs']:g} epochs, {swarm.get('epochs_alone', 0)} peer-epochs alone)",
            flush=True,
        )
        if args.verbose and swarm["timings"]:
            print(f"    per peer: {json.dumps(swarm['timings'])}")
    solo_m, swarm_m = medians(solo_runs), medians(swarm_runs)
    flags = ", ".join(f"{k}=True" for k in opts) or "no delay options"
    if args.accelerator_ms > 0:
        flags += f", accelerator stand-in {args.accelerator_ms:g} ms per forward + backward"
    print(f"\nMLP {UTILIZATION_WORKLOAD}, {args.duration:g} s, {flags}, median of {args.repeats}")
    print(f"(this machine has {os.cpu_count()} cores shared by all peers)\n")
    print("| arm | samples/s | utilization | epochs | step() p50 (ms) | step() share of wall |")
    print("|---|---|---|---|---|---|")
    print(
        f"| 1 peer alone (torch.optim.Adam) | {solo_m['samples_per_s']:.0f} | "
        f"{solo_m['utilization']:.1%} | - | {solo_m['step_p50_ms']:.2f} | "
        f"{solo_m['step_share']:.1%} |"
    )
    print(
        f"| {args.peers} peers (swarmtrain) | {swarm_m['samples_per_s']:.0f} | "
        f"{swarm_m['utilization']:.1%} | {swarm_m['epochs']:g} | {swarm_m['step_p50_ms']:.2f} | "
        f"{swarm_m['step_share']:.1%} |"
    )
    ratio = swarm_m["samples_per_s"] / solo_m["samples_per_s"]
    print(f"\nsamples/s {args.peers} peers / 1 peer: {ratio:.2f}x")
    return {"solo": solo_m, "swarm": swarm_m, "options": opts, "speedup": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("suite", nargs="?", choices=["epochs", "utilization"], default="epochs")
    parser.add_argument(
        "--impl", choices=["swarmtrain", "hivemind", "both", "local"], default="swarmtrain"
    )
    parser.add_argument("--python", default=None, help="interpreter with hivemind 1.1.12")
    parser.add_argument("--peers", type=int, default=4, help="utilization: number of peers")
    parser.add_argument("--delay", action="store_true", help="utilization: delay_* options")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of training")
    parser.add_argument(
        "--accelerator-ms",
        type=float,
        default=0.0,
        help="utilization: a GIL-free wait per forward + backward standing in for a device",
    )
    parser.add_argument(
        "--config",
        choices=["loop", "plain"],
        default="loop",
        help="epochs: 'loop' (tuned host, waits for peers, factory) or 'plain' (a hivemind "
        "user's script: default DHT settings, no wait for peers, averaging_timeout 10)",
    )
    parser.add_argument(
        "--optimizer-form",
        choices=["instance", "factory"],
        default="instance",
        help="--config plain: pass torch.optim.Adam(...) itself, or a factory with params",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verbose", action="store_true", help="worker logs and timings")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--optimizer-opts", default="{}", help="epochs: more Optimizer keywords (JSON), both impls"
    )
    # worker-only arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-id", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    for key, value in EPOCHS_WORKLOAD.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}", type=type(value), default=value, help=argparse.SUPPRESS
        )
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.repeats < 1 or args.duration <= 0 or args.peers < 1:
        parser.error("--repeats and --peers must be >= 1, --duration positive")
    print(f"benchmark_optimizer {args.suite}: {' '.join(sys.argv[1:])}", flush=True)
    results = bench_epochs(args) if args.suite == "epochs" else bench_utilization(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
