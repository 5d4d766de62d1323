"""Multi-host tests on one machine: hosts in network namespaces on one bridge (root only).

``Lan(2)`` makes a bridge namespace and one namespace per host, each with a veth into the
bridge and an address in 10.77.0.0/24; leaving it deletes them all (deleting a namespace
deletes its links). ``PeerProcess`` runs a Python script inside a namespace and talks to it in
JSON lines over stdin/stdout, with a timeout on every wait.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading

_counter = itertools.count()


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2 (`ip`)"
    return None


def run(*command: str, timeout: float = 10.0) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


class Lan:
    """A bridge (in its own namespace) and ``hosts`` namespaces with addresses on it."""

    def __init__(self, hosts: int, subnet: str = "10.77.0"):
        # interface names have at most 15 characters: "st" + 5 + 1 + "v" + index
        self.tag = f"st{os.getpid() % 100000}{'abcdefghij'[next(_counter) % 10]}"
        self.bridge = f"{self.tag}_br"
        self.hosts = [f"{self.tag}_h{i}" for i in range(hosts)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(hosts)]

    def __enter__(self) -> Lan:
        try:
            run("ip", "netns", "add", self.bridge)
            self.exec(self.bridge, "ip", "link", "add", "br0", "type", "bridge")
            self.exec(self.bridge, "ip", "link", "set", "br0", "up")
            for i, (ns, address) in enumerate(zip(self.hosts, self.addresses, strict=True)):
                inside, outside = f"{self.tag}v{i}", f"{self.tag}b{i}"
                run("ip", "netns", "add", ns)
                run(
                    *("ip", "link", "add", inside, "netns", ns, "type", "veth"),
                    *("peer", "name", outside, "netns", self.bridge),
                )
                self.exec(ns, "ip", "link", "set", "lo", "up")
                self.exec(ns, "ip", "addr", "add", f"{address}/24", "dev", inside)
                self.exec(ns, "ip", "link", "set", inside, "up")
                self.exec(self.bridge, "ip", "link", "set", outside, "master", "br0")
                self.exec(self.bridge, "ip", "link", "set", outside, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for ns in [*self.hosts, self.bridge]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def exec(self, ns: str, *command: str, timeout: float = 10.0) -> str:
        return run("ip", "netns", "exec", ns, *command, timeout=timeout)


class PeerProcess:
    """``python script *args`` inside namespace ``ns``; JSON lines both ways.

    ``recv`` and ``ask`` raise ``TimeoutError`` (with the child's stderr) instead of hanging;
    ``close`` asks the child to quit, kills it if it does not, and closes every pipe.
    """

    def __init__(self, ns: str, script: str, *args: str):
        self._stderr = tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, script, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
                bufsize=1,
            )
        except BaseException:
            self._stderr.close()
            raise
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def recv(self, timeout: float) -> dict:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer in {timeout} s; stderr:\n{self.stderr()}") from None
            if line is None:
                self._proc.wait(timeout=5)
                raise RuntimeError(
                    f"the peer exited ({self._proc.returncode}); stderr:\n{self.stderr()}"
                )
            if line.startswith("{"):  # anything else is stray output
                message = json.loads(line)
                if "error" in message:
                    raise RuntimeError(f"the peer failed: {message['error']}")
                return message

    def send(self, message: dict) -> None:
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def ask(self, message: dict, timeout: float) -> dict:
        self.send(message)
        return self.recv(timeout)

    def request_quit(self) -> None:
        """Ask the child to quit (and close its stdin) without waiting for it."""
        if self._proc.poll() is None and not self._proc.stdin.closed:
            try:
                self.send({"op": "quit"})
                self._proc.stdin.close()
            except OSError:
                pass

    def close(self, timeout: float = 5.0) -> None:
        try:
            if self._proc.poll() is None:
                self.request_quit()
                try:
                    self._proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=timeout)
        finally:
            if not self._proc.stdin.closed:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
            self._reader.join(timeout=timeout)
            self._proc.stdout.close()
            self._stderr.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
