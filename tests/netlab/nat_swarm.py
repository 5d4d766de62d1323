"""A ready-made NAT scenario for tests and benchmarks: public peers and peers behind NATs.

``NatSwarm(lab, homes={"a": "cone", "b": "cone", "c": "symmetric"})`` starts a public relay
peer ("relay") and a second public peer ("boot"), both bootstrap peers, and one peer behind
each home's NAT box, all listening on ``0.0.0.0`` with swarmtrain's defaults (relay service,
AutoNAT, hole punching, data lanes): the NAT peers learn from AutoNAT that nobody can dial
them, reserve a slot on the relay and announce ``/p2p-circuit`` addresses. Peers start
concurrently (importing libp2p takes seconds on a busy machine).
"""

from __future__ import annotations

import json
import os
import time

from .process import PeerProcess
from .topology import Host, Lab

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")
TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_peer.py")
LISTEN_ALL = ["/ip4/0.0.0.0/tcp/0"]


class NatSwarm:
    def __init__(
        self,
        lab: Lab,
        homes: dict[str, str],
        *,
        start_timeout: float = 90.0,
        log: tuple[str, ...] = (),
        options: dict[str, dict] | None = None,
        runner: str = PEER_SCRIPT,
        runner_options: dict | None = None,
    ):
        """``options``: extra ``DHT`` keywords per peer name (e.g. ``use_autonat=False``);
        ``runner``: the script the NAT peers run (the public ones run ``peer.py``), given
        ``runner_options`` and ``index`` (0, 1, ...) besides ``dht`` and ``log``."""
        self.lab = lab
        self.hosts: dict[str, Host] = {}
        self.peers: dict[str, PeerProcess] = {}
        self.info: dict[str, dict] = {}
        self.hosts["relay"] = lab.add_public_host("relay")
        self.hosts["boot"] = lab.add_public_host("boot")
        for name, nat in homes.items():
            self.hosts[name] = lab.add_home(name, nat=nat).add_host(name)
        started = time.monotonic()
        self._start("relay", (options or {}).get("relay", {}), log)
        self._start("boot", (options or {}).get("boot", {}), log)
        for name in ("relay", "boot"):
            self.info[name] = self.peers[name].recv(start_timeout)
        bootstrap = [self.public_maddr(name) for name in ("relay", "boot")]
        self.peers["boot"].ask({"op": "connect", "maddr": bootstrap[0]}, start_timeout)
        for index, name in enumerate(homes):
            extra = (options or {}).get(name, {})
            more = {**(runner_options or {}), "index": index}
            self._start(name, {"initial_peers": bootstrap, **extra}, log, runner, more)
        for name in homes:
            self.info[name] = self.peers[name].recv(start_timeout)
        self.startup_seconds = time.monotonic() - started

    def _start(
        self, name: str, dht: dict, log, script: str = PEER_SCRIPT, more: dict | None = None
    ) -> None:
        options = {"dht": {"host_maddrs": LISTEN_ALL, **dht}, "log": list(log), **(more or {})}
        self.peers[name] = self.lab.spawn(self.hosts[name], script, json.dumps(options))

    def public_maddr(self, name: str) -> str:
        """``name``'s address on the public segment (a public peer's only dialable one)."""
        ip = self.hosts[name].ip
        return next(a for a in self.info[name]["maddrs"] if f"/ip4/{ip}/" in a)

    def peer_id(self, name: str) -> str:
        return self.info[name]["peer_id"]

    def name_of(self, peer_id: str) -> str:
        return next((n for n, i in self.info.items() if i["peer_id"] == peer_id), peer_id)

    def ask(self, name: str, message: dict, timeout: float = 60.0) -> dict:
        return self.peers[name].ask(message, timeout)

    def ask_all(self, messages: dict[str, dict], timeout: float = 120.0) -> dict[str, dict]:
        """Send each peer its message at once, then collect every answer."""
        for name, message in messages.items():
            self.peers[name].send(message)
        return {name: self.peers[name].recv(timeout) for name in messages}

    def paths(self, name: str) -> dict:
        """``name``'s connections by peer *name*, and its relay/lane counters."""
        answer = self.ask(name, {"op": "paths"})
        answer["paths"] = {self.name_of(p): kinds for p, kinds in answer["paths"].items()}
        return answer

    def public_bytes(self) -> int:
        """Bytes the public peers (the relays) received and sent so far (interface counters)."""
        return sum(sum(self.hosts[name].interface_bytes()) for name in ("relay", "boot"))
