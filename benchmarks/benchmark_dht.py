"""DHT store/get success rate and latency with 10% of the nodes killed mid-run.

    python benchmarks/benchmark_dht.py [--num_peers 64] [--rounds 10] [--seed 0]
    python benchmarks/benchmark_dht.py --impl hivemind --python /path/to/venv/bin/python

The same workload for both implementations: ``num_peers`` nodes join one at a time through a
random earlier node; each round, ``stores_per_round`` random nodes store a dictionary value
(random key from a pool of ``num_keys``, a fresh subkey) and then ``gets_per_round`` random live
nodes get a key already stored (``latest=True``); after half of the rounds 10% of the nodes
(never the reader) are shut down. A get succeeds when it returns every subkey stored for that
key before the round began. swarmtrain spreads its nodes over ``--workers`` processes (one trio
loop each, relays and AutoNAT off; latency is measured inside the worker); hivemind 1.1.12 runs
each ``DHT`` in its own process plus its Go daemon (its only mode). Prints success rates
and p50/p95 latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Workload:
    """Pure bookkeeping of the benchmark: what to store, what to expect, what succeeded."""

    def __init__(self, args):
        self.rng = random.Random(args.seed)
        self.args = args
        self.stored: dict[str, set[str]] = {}
        self.store_ok, self.store_total, self.get_ok, self.get_total = 0, 0, 0, 0
        self.store_ms: list[float] = []
        self.get_ms: list[float] = []
        self.get_timeouts = 0  # failed gets that ran out of time (the rest missed subkeys)
        self.store_rpcs: list[int] = []
        self.get_rpcs: list[int] = []
        self.per_round: list[list[tuple[bool, float]]] = [[]]

    def store_requests(self, round_index):
        for i in range(self.args.stores_per_round):
            key = f"key{self.rng.randrange(self.args.num_keys)}"
            yield key, f"r{round_index}s{i}", self.rng.random()

    def get_requests(self):
        keys = [k for k, subkeys in self.stored.items() if subkeys]
        for _ in range(self.args.gets_per_round):
            if keys:
                key = self.rng.choice(keys)
                yield key, set(self.stored[key])

    def record_store(self, key, subkey, ok, ms, rpcs=None):
        self.store_total += 1
        if rpcs is not None:
            self.store_rpcs.append(rpcs)
        self.store_ms.append(ms)
        if ok:
            self.store_ok += 1
            self.stored.setdefault(key, set()).add(subkey)

    def record_get(self, expected, got_subkeys, ms, rpcs=None, timed_out=False):
        self.get_total += 1
        self.get_timeouts += bool(timed_out)
        if rpcs is not None:
            self.get_rpcs.append(rpcs)
        self.get_ms.append(ms)
        ok = got_subkeys is not None and expected <= set(got_subkeys)
        self.get_ok += ok
        self.per_round[-1].append((ok, ms))

    def end_round(self, round_index):
        if self.args.verbose and self.per_round[-1]:
            oks = [ok for ok, _ in self.per_round[-1]]
            ms = [m for _, m in self.per_round[-1]]
            print(
                f"  round {round_index}: gets ok {sum(oks)}/{len(oks)}, "
                f"p50 {percentile(ms, 0.5):.0f} ms"
            )
        self.per_round.append([])

    def summary(self):
        return {
            "store_success": self.store_ok / max(1, self.store_total),
            "get_success": self.get_ok / max(1, self.get_total),
            "stores": self.store_total,
            "gets": self.get_total,
            "store_p50_ms": percentile(self.store_ms, 0.5),
            "store_p95_ms": percentile(self.store_ms, 0.95),
            "get_p50_ms": percentile(self.get_ms, 0.5),
            "get_p95_ms": percentile(self.get_ms, 0.95),
            # RPCs a request sent, mean per store / get: swarmtrain, all methods counted in the
            # requesting node's tasks; hivemind, find RPCs of all nodes during the phase
            "store_rpcs": sum(self.store_rpcs) / len(self.store_rpcs) if self.store_rpcs else None,
            "get_timeouts": self.get_timeouts,
            "get_rpcs": sum(self.get_rpcs) / len(self.get_rpcs) if self.get_rpcs else None,
        }


async def _worker_main() -> None:
    """A worker process: hosts some of the swarmtrain nodes; JSON-lines commands on stdin."""
    import contextvars

    import trio

    from swarmtrain.dht import DHT, get_dht_time
    from swarmtrain.dht.protocol import DHTProtocol

    # Count the RPCs each request sends: the tasks of one request (search workers, stores)
    # inherit its context, so a counter set there sees only that request's calls. ``costs``
    # (for --verbose) counts every RPC of the process, dials, and cyclic-GC time.
    rpc_counter: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
        "rpc_counter", default=None
    )
    costs = {"dials": 0, "rpcs": 0, "gc_s": 0.0}
    original_call = DHTProtocol._call

    async def counting_call(self, peer_id, *args, **kwargs):
        costs["rpcs"] += 1
        counter = rpc_counter.get()
        if counter is not None and not self._skips(peer_id, get_dht_time()):
            counter[0] += 1
        return await original_call(self, peer_id, *args, **kwargs)

    DHTProtocol._call = counting_call
    from swarmtrain.p2p.host import P2P

    original_ensure_connected = P2P.ensure_connected

    async def counting_ensure_connected(self, peer):
        if not self.is_connected(peer):
            costs["dials"] += 1
        return await original_ensure_connected(self, peer)

    P2P.ensure_connected = counting_ensure_connected
    gc_started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_started[0] = time.process_time()
        else:
            costs["gc_s"] += time.process_time() - gc_started[0]

    import gc

    gc.callbacks.append(on_gc)

    host_kwargs = dict(use_relay=False, relay_service=False, use_autonat=False)
    nodes, stops = {}, {}
    out = trio.lowlevel.FdStream(os.dup(1))
    out_lock = trio.Lock()

    async def reply(message):
        async with out_lock:
            await out.send_all((json.dumps(message) + "\n").encode())

    async def run_node(name, initial, task_status=trio.TASK_STATUS_IGNORED):
        stop = trio.Event()
        async with DHT.create(initial, **host_kwargs) as dht:
            nodes[name], stops[name] = dht, stop
            task_status.started(dht.get_visible_maddrs())
            await stop.wait()
        nodes.pop(name, None)

    async def handle(cmd, nursery):
        op, rid = cmd["op"], cmd["id"]
        started = time.perf_counter()
        counter = [0]
        rpc_counter.set(counter)
        if op == "start":
            maddrs = await nursery.start(run_node, cmd["node"], cmd["initial"])
            await reply({"id": rid, "maddrs": maddrs})
        elif op == "store":
            ok = False
            with trio.move_on_after(cmd["timeout"]):
                ok = await nodes[cmd["node"]].store(
                    cmd["key"], cmd["value"], get_dht_time() + 600, subkey=cmd["subkey"]
                )
            ms = 1000 * (time.perf_counter() - started)
            await reply({"id": rid, "ok": bool(ok), "ms": ms, "rpcs": counter[0]})
        elif op == "get":
            subkeys = None
            with trio.move_on_after(cmd["timeout"]) as scope:
                result = await nodes[cmd["node"]].get(cmd["key"], latest=True)
                if result is not None and isinstance(result.value, dict):
                    subkeys = list(result.value)
            ms = 1000 * (time.perf_counter() - started)
            timed_out = scope.cancelled_caught
            await reply(
                {"id": rid, "subkeys": subkeys, "ms": ms, "rpcs": counter[0], "late": timed_out}
            )
        elif op == "costs":
            tasks, stack = 0, [trio.lowlevel.current_root_task()]
            names: dict[str, int] = {}
            while stack:
                task = stack.pop()
                tasks += 1
                names[task.name] = names.get(task.name, 0) + 1
                for child_nursery in task.child_nurseries:
                    stack.extend(child_nursery.child_tasks)
            await reply(
                {
                    "id": rid,
                    "cpu_s": time.process_time(),
                    "objects": len(gc.get_objects()),
                    "tasks": tasks,
                    "task_names": sorted(names.items(), key=lambda kv: -kv[1])[:12],
                    **costs,
                }
            )
        elif op == "stop":
            stops[cmd["node"]].set()
            await reply({"id": rid})

    async with trio.open_nursery() as nursery:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffer = b""
        while data := await stdin.receive_some(65536):
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["op"] == "exit":
                    for stop in stops.values():
                        stop.set()
                    return
                nursery.start_soon(handle, cmd, nursery)


def run_swarmtrain(args) -> dict:
    import trio

    workload = Workload(args)

    async def main():
        workers, pending, next_id, send_locks = [], {}, [0], {}

        async def read_replies(proc):
            buffer = b""
            while data := await proc.stdout.receive_some(65536):
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    event, box = pending.pop(message["id"])
                    box.append(message)
                    event.set()

        async def call(worker, **cmd):
            next_id[0] += 1
            cmd["id"] = next_id[0]
            event, box = trio.Event(), []
            pending[cmd["id"]] = (event, box)
            async with send_locks.setdefault(id(worker), trio.Lock()):
                await worker.stdin.send_all((json.dumps(cmd) + "\n").encode())
            await event.wait()
            return box[0]

        async with trio.open_nursery() as nursery:
            for _ in range(args.workers):
                proc = await trio.lowlevel.open_process(
                    [sys.executable, __file__, "--worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                workers.append(proc)
                nursery.start_soon(read_replies, proc)
            owner = [workers[i % args.workers] for i in range(args.num_peers)]
            maddrs: list[list[str]] = []
            started = time.perf_counter()
            for i in range(args.num_peers):
                initial = workload.rng.choice(maddrs) if maddrs else []
                maddrs.append((await call(owner[i], op="start", node=i, initial=initial))["maddrs"])
            print(
                f"swarmtrain: {args.num_peers} nodes in {args.workers} processes up in "
                f"{time.perf_counter() - started:.1f} s"
            )
            alive = list(range(args.num_peers))
            last_costs: dict[str, float] = {}

            async def report_costs(phase):
                """--verbose: what the workers spent since the last report (all processes)."""
                costs = [await call(w, op="costs") for w in workers]
                totals = {k: sum(c[k] for c in costs) for k in ("cpu_s", "dials", "rpcs", "gc_s")}
                totals["wall_s"] = time.perf_counter()
                if last_costs:
                    spent = ", ".join(f"{k} {totals[k] - last_costs[k]:.2f}" for k in totals)
                    print(f"    {phase}: {spent}")
                last_costs.update(totals)
                return costs

            if args.verbose:
                await report_costs("start")
            for round_index in range(args.rounds):
                if round_index == args.rounds // 2:
                    victims = workload.rng.sample(alive[1:], max(1, args.num_peers // 10))
                    for v in victims:
                        await call(owner[v], op="stop", node=v)
                        alive.remove(v)
                    print(f"swarmtrain: killed {len(victims)} nodes")

                async def store(key, subkey, value):
                    n = workload.rng.choice(alive)
                    r = await call(
                        owner[n],
                        op="store",
                        node=n,
                        key=key,
                        subkey=subkey,
                        value=value,
                        timeout=args.timeout,
                    )
                    workload.record_store(key, subkey, r["ok"], r["ms"], r.get("rpcs"))

                async def get(key, expected):
                    n = workload.rng.choice(alive)
                    r = await call(owner[n], op="get", node=n, key=key, timeout=args.timeout)
                    workload.record_get(
                        expected, r["subkeys"], r["ms"], r.get("rpcs"), r.get("late")
                    )

                async with trio.open_nursery() as round_nursery:
                    for request in workload.store_requests(round_index):
                        round_nursery.start_soon(store, *request)
                if args.verbose:
                    await report_costs("stores")
                async with trio.open_nursery() as round_nursery:
                    for request in workload.get_requests():
                        round_nursery.start_soon(get, *request)
                workload.end_round(round_index)
                if args.verbose:
                    costs = await report_costs("gets")
                    print(
                        f"    gc objects {[c['objects'] for c in costs]}, trio tasks "
                        f"{[c['tasks'] for c in costs]}"
                    )
                    if os.environ.get("BENCH_TASKS"):
                        print(f"    task names (worker 0): {costs[0]['task_names']}")
            for proc in workers:
                await proc.stdin.send_all(b'{"op": "exit", "id": 0}\n')
                await proc.stdin.aclose()
            for proc in workers:
                await proc.wait()

    trio.run(main)
    return workload.summary()


def run_hivemind(args) -> dict:
    import asyncio
    import multiprocessing

    import hivemind
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.utils.timed_storage import get_dht_time as hivemind_time

    # Count find RPCs in every DHT process (forked after this patch) through a shared counter.
    finds = multiprocessing.Value("l", 0)
    original_call_find = DHTProtocol.call_find

    async def counting_call_find(self, *call_args, **call_kwargs):
        with finds.get_lock():
            finds.value += 1
        return await original_call_find(self, *call_args, **call_kwargs)

    DHTProtocol.call_find = counting_call_find

    def count_finds(requests, per_request):
        before = finds.value
        yield
        per_request.extend([(finds.value - before) / max(1, len(requests))] * len(requests))

    workload = Workload(args)
    started = time.perf_counter()
    nodes = []
    for _ in range(args.num_peers):
        initial = workload.rng.choice(nodes).get_visible_maddrs() if nodes else []
        nodes.append(hivemind.DHT(initial_peers=initial, start=True))
    print(f"hivemind: {args.num_peers} nodes up in {time.perf_counter() - started:.1f} s")
    alive = list(range(args.num_peers))

    async def main():
        for round_index in range(args.rounds):
            if round_index == args.rounds // 2:
                victims = workload.rng.sample(alive[1:], max(1, args.num_peers // 10))
                for v in victims:
                    nodes[v].shutdown()
                    alive.remove(v)
                print(f"hivemind: killed {len(victims)} nodes")

            async def store(key, subkey, value):
                dht = nodes[workload.rng.choice(alive)]
                t = time.perf_counter()
                try:
                    ok = await asyncio.wait_for(
                        dht.store(
                            key,
                            value,
                            hivemind_time() + 600,
                            subkey=subkey,
                            return_future=True,
                        ),
                        args.timeout,
                    )
                except Exception:
                    ok = False
                workload.record_store(key, subkey, ok, 1000 * (time.perf_counter() - t))

            async def get(key, expected):
                dht = nodes[workload.rng.choice(alive)]
                t = time.perf_counter()
                got = None
                try:
                    result = await asyncio.wait_for(
                        dht.get(key, latest=True, return_future=True), args.timeout
                    )
                    if result is not None and isinstance(result.value, dict):
                        got = list(result.value)
                except Exception:
                    pass
                workload.record_get(expected, got, 1000 * (time.perf_counter() - t))

            stores = list(workload.store_requests(round_index))
            counting = count_finds(stores, workload.store_rpcs)
            next(counting)
            await asyncio.gather(*[store(*r) for r in stores])
            next(counting, None)
            gets = list(workload.get_requests())
            counting = count_finds(gets, workload.get_rpcs)
            next(counting)
            await asyncio.gather(*[get(*r) for r in gets])
            next(counting, None)
            workload.end_round(round_index)

    asyncio.run(main())
    for i in alive:
        nodes[i].shutdown()
    return workload.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=["swarmtrain", "hivemind", "both"], default="swarmtrain")
    parser.add_argument("--python", default=None, help="interpreter with hivemind 1.1.12")
    parser.add_argument("--num_peers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--stores_per_round", type=int, default=16)
    parser.add_argument("--gets_per_round", type=int, default=32)
    parser.add_argument("--num_keys", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="per-round get statistics")
    parser.add_argument("--workers", type=int, default=4, help="swarmtrain worker processes")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        return trio.run(_worker_main)
    if args.num_peers < 10 or args.num_peers > 256:
        parser.error("--num_peers must be within 10..256")
    results = {}
    if args.impl in ("swarmtrain", "both"):
        results["swarmtrain"] = run_swarmtrain(args)
    if args.impl == "hivemind":
        results["hivemind"] = run_hivemind(args)
    if args.impl == "both":
        if not args.python:
            parser.error("--impl both needs --python pointing at a venv with hivemind")
        command = [args.python, __file__, "--impl", "hivemind", "--json"]
        for name in ("num_peers", "rounds", "stores_per_round", "gets_per_round", "num_keys"):
            command += [f"--{name}", str(getattr(args, name))]
        command += ["--timeout", str(args.timeout), "--seed", str(args.seed)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results["hivemind"] = json.loads(out.strip().splitlines()[-1])["hivemind"]
    if args.json:
        print(json.dumps(results))
        return
    for impl, r in results.items():
        print(
            f"{impl:10s} store ok {100 * r['store_success']:5.1f}% of {r['stores']}, "
            f"p50 {r['store_p50_ms']:.0f} ms p95 {r['store_p95_ms']:.0f} ms | get ok "
            f"{100 * r['get_success']:5.1f}% of {r['gets']}, p50 {r['get_p50_ms']:.0f} ms "
            f"p95 {r['get_p95_ms']:.0f} ms"
        )
        if r.get("get_rpcs") is not None:
            print(
                f"{'':10s} RPCs sent per store {r['store_rpcs']:.1f}, per get "
                f"{r['get_rpcs']:.1f}; gets timed out: {r['get_timeouts']}"
            )
    if "hivemind" in results and "swarmtrain" in results:
        ratio = results["swarmtrain"]["get_p50_ms"] / results["hivemind"]["get_p50_ms"]
        print(f"get p50 ratio swarmtrain / hivemind: {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
