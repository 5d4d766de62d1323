"""What a circuit relay adds to small messages (issue 18.2): relayed against direct, one run.

    sudo PYTHONPATH=. nice -n 10 python benchmarks/benchmark_relay_rpc.py [--blocks 3] [--rpcs 200]

A ``tests/netlab`` lab (root only, network namespaces; no added delay, no rate limit) holds two
swarms side by side, each a public hub (bootstrap peer, relay) and two peers x and y:

- direct: x and y public, y dials x's address (an initial peer of y);
- relayed: x and y each behind its own cone NAT (hole punching off, so the pair stays on the
  relay; both reserve a slot on the hub), y dials x's ``/p2p-circuit`` address.

Every peer runs ``tests/netlab/latency_peer.py`` (a DHT, a PubSub, an echo handler). Blocks
alternate direct and relayed; each block measures, from y (x for gossip), timed inside the
peer process:

- ``rpc``: ``--rpcs`` sequential echo calls of 32 bytes to x (and ``--large`` calls of
  ``--large-kib`` KiB), with the RPC streams opened meanwhile;
- ``dht``: ``--dht`` stores of fresh keys, then a get of each (a 3-node swarm: the hub, x, y);
- ``gossip``: x publishes ``--gossip`` messages 50 ms apart; y's delay from publish to
  receipt (``time.monotonic``, one clock for the whole box);

and after the last block ``redial``: ``--redials`` times, y closes its connections to x, then
calls it once (a new dial, direct or through the relay, and a call; a failure is counted, not
timed).

Prints JSON lines: per block and kind the median (ms), then the medians over all
blocks and the ratio relayed / direct, and ``uptime``'s load at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netlab

RUNNER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "netlab", "latency_peer.py"
)
LISTEN_ALL = ["/ip4/0.0.0.0/tcp/0"]
FAILED_DIAL_MEMORY = 11.0  # seconds: our hosts' negative dial cache, and a margin
KINDS = ("rpc", "rpc_large", "redial", "dht_store", "dht_get", "gossip")


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def checked(answer: dict) -> dict:
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer


class Swarm:
    """A hub and peers x, y (public or behind cone NATs) running ``latency_peer.py``."""

    def __init__(self, lab: netlab.Lab, name: str, relayed: bool, timeout: float):
        self.name = name
        hub = lab.add_public_host(f"{name}hub")
        self.peers = {
            "hub": lab.spawn(hub, RUNNER, json.dumps({"dht": {"host_maddrs": LISTEN_ALL}}))
        }
        hub_info = checked(self.peers["hub"].recv(timeout))
        hub_addr = next(a for a in hub_info["maddrs"] if f"/ip4/{hub.ip}/" in a)
        self.hosts = {}
        self.info = {}
        for peer in ("x", "y"):
            if relayed:
                host = lab.add_home(f"{name}{peer}", nat="cone").add_host(f"{name}{peer}h")
            else:
                host = lab.add_public_host(f"{name}{peer}")
            self.hosts[peer] = host
            dht = {"host_maddrs": LISTEN_ALL, "initial_peers": [hub_addr]}
            if relayed:  # reserve on the hub whatever AutoNAT says; stay on the relay
                dht.update(use_auto_relay=True, use_hole_punching=False)
            elif peer == "y":  # y dials x first, before the DHT tells it of x
                dht["initial_peers"].append(self._public_addr("x"))
            self.peers[peer] = lab.spawn(host, RUNNER, json.dumps({"dht": dht}))
            self.info[peer] = checked(self.peers[peer].recv(timeout))
        if relayed:
            maddrs = checked(self.ask("x", {"op": "wait_circuit", "timeout": timeout}))["maddrs"]
            x_addr = next(a for a in maddrs if "/p2p-circuit" in a)
            checked(self.ask("y", {"op": "wait_circuit", "timeout": timeout}))
        else:
            x_addr = self._public_addr("x")
        for attempt in range(3):  # a dial the DHT tried first may sit in the negative cache
            try:
                paths = self.ask("y", {"op": "connect", "maddr": x_addr})["paths"]
                break
            except RuntimeError as e:
                report(swarm=name, connect_failed=str(e)[:300])
                if attempt == 2:
                    raise
                time.sleep(FAILED_DIAL_MEMORY)
        if set(paths) != ({"relayed"} if relayed else {"direct"}):  # x may have dialled y too
            raise RuntimeError(f"{name}: y reaches x over {paths}")
        for peer in ("x", "y"):
            checked(self.ask(peer, {"op": "wait_mesh", "count": 2, "timeout": timeout}))

    def _public_addr(self, peer: str) -> str:
        ip = self.hosts[peer].ip
        return next(a for a in self.info[peer]["maddrs"] if f"/ip4/{ip}/" in a)

    def ask(self, peer: str, message: dict, timeout: float = 300.0) -> dict:
        return checked(self.peers[peer].ask(message, timeout))

    def measure(self, args, block: int) -> dict[str, list[float]]:
        x = self.info["x"]["peer_id"]
        rpc = self.ask("y", {"op": "rpc", "peer": x, "count": args.rpcs, "size": 32})
        large = self.ask(
            "y", {"op": "rpc", "peer": x, "count": args.large, "size": args.large_kib << 10}
        )
        dht = self.ask("y", {"op": "dht", "count": args.dht, "prefix": f"{self.name}/{block}"})
        self.ask("y", {"op": "received"})  # forget anything earlier
        self.ask("x", {"op": "publish", "count": args.gossip, "interval": 0.05})
        time.sleep(1.0)  # the last messages on their way
        delays = self.ask("y", {"op": "received"})["delays"]
        if len(delays) < args.gossip:
            report(swarm=self.name, block=block, gossip_lost=args.gossip - len(delays))
        return {
            "rpc": rpc["seconds"],
            "rpc_large": large["seconds"],
            "rpc_streams_opened": [rpc["rpc_streams_opened"]],
            "dht_store": dht["store"],
            "dht_get": dht["get"],
            "gossip": list(delays.values()),
        }

    def measure_redials(self, args) -> dict[str, list[float]]:
        """Last (a failed redial leaves y without a connection to x): ``--redials`` times, y
        closes its connections to x and calls it once."""
        x = self.info["x"]["peer_id"]
        redial = self.ask("y", {"op": "redial", "peer": x, "count": args.redials})
        if redial["failures"]:
            report(swarm=self.name, redial_failures=redial["failures"][:2])
        return {"redial": redial["seconds"], "redial_failed": [len(redial["failures"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks per swarm")
    parser.add_argument("--rpcs", type=int, default=200, help="small echo calls per block")
    parser.add_argument("--large", type=int, default=20, help="large echo calls per block")
    parser.add_argument("--large-kib", type=int, default=256, help="size of a large echo call")
    parser.add_argument("--redials", type=int, default=10, help="disconnect + call per block")
    parser.add_argument("--dht", type=int, default=20, help="stores (and gets) per block")
    parser.add_argument("--gossip", type=int, default=60, help="gossip messages per block")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    reason = netlab.unavailable_reason() or netlab.iptables_unavailable_reason()
    if reason:
        sys.exit(f"netlab unavailable: {reason}")
    report(load_start=load(), args=vars(args))
    samples: dict[str, dict[str, list[float]]] = {"direct": {}, "relayed": {}}
    with netlab.Lab() as lab:
        swarms = {
            "direct": Swarm(lab, "d", relayed=False, timeout=args.timeout),
            "relayed": Swarm(lab, "r", relayed=True, timeout=args.timeout),
        }
        for swarm in swarms.values():  # warm-up: streams, routing tables, the mesh
            swarm.ask("y", {"op": "rpc", "peer": swarm.info["x"]["peer_id"], "count": 20})
            swarm.ask("y", {"op": "dht", "count": 2, "prefix": f"{swarm.name}/warm"})
        for block in range(args.blocks):
            for name, swarm in swarms.items():
                measured = swarm.measure(args, block)
                for kind, values in measured.items():
                    samples[name].setdefault(kind, []).extend(values)
                report(
                    block=block,
                    swarm=name,
                    **{
                        kind: round(1e3 * statistics.median(v), 3) if kind in KINDS else v
                        for kind, v in measured.items()
                        if v
                    },
                )
        for name, swarm in swarms.items():
            measured = swarm.measure_redials(args)
            for kind, values in measured.items():
                samples[name].setdefault(kind, []).extend(values)
    summary = {}
    for kind in KINDS:
        got = {name: samples[name].get(kind, []) for name in samples}
        medians = {name: statistics.median(v) if v else None for name, v in got.items()}
        direct, relayed = medians["direct"], medians["relayed"]
        summary[kind] = {
            "direct_ms": None if direct is None else round(1e3 * direct, 3),
            "relayed_ms": None if relayed is None else round(1e3 * relayed, 3),
            "ratio": None if not (direct and relayed) else round(relayed / direct, 2),
            "samples": [len(got["direct"]), len(got["relayed"])],
        }
        report(kind=kind, **summary[kind])
    report(
        rpc_streams_opened={n: sum(samples[n]["rpc_streams_opened"]) for n in samples},
        redials_failed={n: sum(samples[n]["redial_failed"]) for n in samples},
        load_end=load(),
    )


if __name__ == "__main__":
    main()
