"""Does a DHT node keep answering pings while a peer stores worst-case values? (issue 17.2)

    python benchmarks/benchmark_dht_abuse.py [--attack legal|bomb] [--seconds 10]

Three processes on loopback: a victim DHT node, an attacker that calls the victim's
``rpc_store`` in a loop (one request in flight), and this process, which pings the victim every
``--interval`` seconds (timeout ``--ping_timeout``) for ``--baseline`` seconds before the attack
and ``--seconds`` during it. Attacks:

* ``legal``: the costliest values the decoder accepts, ``--items`` per request, each one msgpack
  array of ``MAX_VALUE_ELEMENTS - 1`` empty arrays (16 KiB; the most objects per byte);
* ``bomb``: audit finding 2, 7 values of 1 MiB, each one array of ~1M empty arrays (before the
  bounded decoder one such request froze a node for ~21 s);
* ``flood``: audit finding 8, 7 plain values of 1 MiB per request under fresh keys (before the
  per-peer quotas 420 of them pinned 543 MiB of the victim; now it keeps the attacker's quota).

Prints ping latency p50 / p99 / max and failures before and during the attack, the attacker's
requests and how the victim answered them, and the victim's CPU seconds, resident memory and
stored records. Run it from a
checkout (or with ``PYTHONPATH``) to measure that checkout's ``swarmtrain``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HOST_KWARGS = dict(use_relay=False, relay_service=False, use_autonat=False)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def worst_legal_value() -> bytes:
    import swarmtrain.dht

    n = getattr(swarmtrain.dht, "MAX_VALUE_ELEMENTS", 16384) - 1  # the same bytes on old code
    return b"\xdc" + n.to_bytes(2, "big") + b"\x90" * n


def flood_value() -> bytes:
    """A legal, cheap-to-decode value of just under 1 MiB (msgpack bin32)."""
    n = 1024 * 1024 - 64
    return b"\xc6" + n.to_bytes(4, "big") + b"\x00" * n


def rss_mib() -> float:
    """This process's resident memory now, in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def audit_bomb() -> bytes:
    n = 1024 * 1024 - 8
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


async def _emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


class LongestSteps:
    """A trio instrument: the longest task steps (the loop is blocked for each of them)."""

    def __init__(self, keep: int = 5):
        self.keep, self.steps, self._started = keep, [], None

    def before_task_step(self, task) -> None:
        self._started = time.perf_counter()

    def after_task_step(self, task) -> None:
        if self._started is None:
            return  # the step that added the instrument
        ms = 1000 * (time.perf_counter() - self._started)
        if len(self.steps) < self.keep or ms > self.steps[-1][0]:
            self.steps = sorted([*self.steps, (round(ms, 1), task.name)], reverse=True)
            del self.steps[self.keep :]


async def victim_main() -> None:
    """Run a DHT node; print its addresses, then its statistics once stdin closes."""
    import trio

    from swarmtrain.dht import DHT

    steps = LongestSteps()
    trio.lowlevel.add_instrument(steps)
    async with DHT.create([], **HOST_KWARGS) as dht:
        info = {"maddrs": dht.get_visible_maddrs(), "peer_id": dht.peer_id.to_base58()}
        await _emit({**info, "rss_mib": rss_mib()})
        await trio.to_thread.run_sync(sys.stdin.read)
        storage = getattr(dht.node.protocol.storage, "statistics", None)
        await _emit(
            {
                "cpu_s": time.process_time(),
                "rss_mib": rss_mib(),
                "stored_keys": dht.node.statistics().num_stored_keys,
                "stored_bytes": storage(time.time()).num_bytes if storage else None,
                "longest_steps_ms": steps.steps,
            }
        )


async def store_request(dht, victim, items, timeout: float) -> str:
    """One raw ``rpc_store`` call to ``victim``: ``"ok N/M"``, ``"rejected: ..."`` or the error."""
    from swarmtrain.p2p import P2PError, RemoteError
    from swarmtrain.proto import dht_pb2

    request = dht_pb2.DHTStoreRequest(
        keys=[key for key, _, _ in items],
        subkeys=[b"" for _ in items],
        values=[value for _, value, _ in items],
        expiration_time=[expiration for _, _, expiration in items],
        peer=dht_pb2.DHTNodeInfo(),
    )
    try:
        response = await dht.p2p.call_protobuf_handler(
            victim,
            dht.node.protocol.method_name("rpc_store"),
            request,
            dht_pb2.DHTStoreResponse,
            timeout=timeout,
        )
    except RemoteError as e:
        return f"rejected: {e}"
    except P2PError as e:
        return f"failed: {type(e).__name__}: {e}"
    return f"ok {sum(response.store_ok)}/{len(items)}"


def attack_items(kind: str, index: int, count: int) -> list[tuple[bytes, bytes, float]]:
    from swarmtrain.dht import get_dht_time, serialize

    value = {"legal": worst_legal_value, "bomb": audit_bomb, "flood": flood_value}[kind]()
    expiration = get_dht_time() + 600
    return [(serialize(f"junk{index}.{i}"), value, expiration) for i in range(count)]


async def attacker_main(args) -> None:
    """Store ``args.attack`` values at ``args.target`` in a loop until stdin closes."""
    import trio

    from swarmtrain.dht import DHT
    from swarmtrain.p2p import PeerID

    victim = PeerID.from_base58(args.target_peer)
    count = args.items if args.attack == "legal" else 7  # 7 values of 1 MiB: one 8 MiB message
    outcomes: dict[str, int] = {}
    async with DHT.create([args.target], client_mode=True, **HOST_KWARGS) as dht:
        await _emit({"ready": True})
        async with trio.open_nursery() as nursery:

            async def stop_on_eof() -> None:
                await trio.to_thread.run_sync(sys.stdin.read)
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_eof)
            index = 0
            while True:
                outcome = await store_request(
                    dht, victim, attack_items(args.attack, index, count), timeout=120
                )
                key = outcome.split(":")[0] if not outcome.startswith("ok") else outcome
                outcomes[key] = outcomes.get(key, 0) + 1
                if index == 0:
                    outcomes["first answer: " + outcome[:160]] = 1
                index += 1
    await _emit({"requests": index, "outcomes": outcomes})


async def ping_once(dht, victim, timeout: float) -> float | None:
    """Seconds one ``rpc_ping`` took, or None if it failed or took longer than ``timeout``."""
    from swarmtrain.p2p import P2PError
    from swarmtrain.proto import dht_pb2

    started = time.perf_counter()
    try:
        await dht.p2p.call_protobuf_handler(
            victim,
            dht.node.protocol.method_name("rpc_ping"),
            dht_pb2.DHTPingRequest(),
            dht_pb2.DHTPingResponse,
            timeout=timeout,
        )
    except P2PError:
        return None
    return time.perf_counter() - started


async def probe(dht, victim, seconds: float, interval: float, timeout: float) -> dict:
    """Ping ``victim`` every ``interval`` seconds for ``seconds``; latency statistics in ms."""
    import trio

    latencies, failures = [], 0
    deadline = trio.current_time() + seconds
    while trio.current_time() < deadline:
        started = trio.current_time()
        latency = await ping_once(dht, victim, timeout)
        if latency is None:
            failures += 1
        else:
            latencies.append(latency)
        await trio.sleep_until(started + interval)
    ms = [1000 * x for x in latencies]
    return {
        "pings": len(ms) + failures,
        "failed": failures,
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms, default=float("nan")),
    }


def spawn(*role_args: str) -> subprocess.Popen:
    """This script in another role, importing the same ``swarmtrain`` as this process."""
    import swarmtrain

    root = os.path.dirname(os.path.dirname(os.path.abspath(swarmtrain.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *role_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_json_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{proc.args[2:]} exited without output (rc={proc.wait()})")
    return json.loads(line)


def finish(proc: subprocess.Popen) -> dict:
    """Close ``proc``'s stdin (it then reports and exits); its last JSON line."""
    proc.stdin.close()
    try:
        return read_json_line(proc)
    finally:
        proc.stdout.close()
        proc.wait(timeout=30)


def kill(proc: subprocess.Popen) -> None:
    """Stop ``proc`` if it still runs and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()


async def main_async(args) -> dict:
    import trio

    from swarmtrain.dht import DHT
    from swarmtrain.p2p import PeerID

    victim_proc = spawn("--role", "victim")
    try:
        info = read_json_line(victim_proc)
        victim = PeerID.from_base58(info["peer_id"])
        async with DHT.create(info["maddrs"][:1], client_mode=True, **HOST_KWARGS) as prober:
            await ping_once(prober, victim, args.ping_timeout)  # connect
            before = await probe(prober, victim, args.baseline, args.interval, args.ping_timeout)
            attacker_proc = spawn(
                "--role",
                "attacker",
                "--attack",
                args.attack,
                "--items",
                str(args.items),
                "--target",
                info["maddrs"][0],
                "--target_peer",
                info["peer_id"],
            )
            try:
                await trio.to_thread.run_sync(read_json_line, attacker_proc)
                during = await probe(prober, victim, args.seconds, args.interval, args.ping_timeout)
            finally:
                attacker = await trio.to_thread.run_sync(finish, attacker_proc)
        victim_stats = finish(victim_proc)
        victim_stats["rss_mib_at_start"] = info.get("rss_mib")
    finally:
        kill(victim_proc)
    return {"before": before, "during": during, "attacker": attacker, "victim": victim_stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=["main", "victim", "attacker"], default="main")
    parser.add_argument("--attack", choices=["legal", "bomb", "flood"], default="legal")
    parser.add_argument("--items", type=int, default=256, help="values per legal request")
    parser.add_argument("--seconds", type=float, default=10.0, help="probing during the attack")
    parser.add_argument("--baseline", type=float, default=3.0, help="probing before it")
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--ping_timeout", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--target_peer", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import trio

    if args.role == "victim":
        trio.run(victim_main)
        return
    if args.role == "attacker":
        trio.run(attacker_main, args)
        return
    load = os.getloadavg()[0]
    result = trio.run(main_async, args)
    result["load_at_start"] = load
    if args.json:
        print(json.dumps(result))
        return
    print(f"attack={args.attack} load at start {load:.1f}")
    for phase in ("before", "during"):
        r = result[phase]
        print(
            f"{phase:7s} pings {r['pings']:4d} failed {r['failed']:3d}  "
            f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms"
        )
    print(f"attacker: {result['attacker']['requests']} requests, {result['attacker']['outcomes']}")
    print(f"victim: {result['victim']}")


if __name__ == "__main__":
    main()
