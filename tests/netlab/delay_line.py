"""A packet-level delay line (netem is not in this kernel): run it inside a host's access
router namespace (``Lab.add_delayed_host``), where policy routing sends every packet the
router forwards, either way, into the TUN device ``--tun``; this reads each IP packet, holds it
``delay`` s (+ a uniform draw in [0, ``jitter``], order kept per direction), drops it with
probability ``loss``, and writes it back into the same TUN device, from where the router
forwards it on to its destination (packets arriving from the TUN device take the main
routing table). End-to-end TCP between the hosts then sees the delay and the loss: slow
start, congestion windows and loss recovery run at the real RTT.

Direction: a packet addressed to ``--host`` goes "in" (towards the host), any other "out".
Each direction is a FIFO of at most ``QUEUE_LIMIT`` bytes (a packet that finds it full is
dropped and counted as ``overflow``: a bound, not a model of a router queue; use ``tc tbf``
on the router's veths for a rate limit and its queue).

Prints one JSON line ``{"ready": tun}`` once attached; then answers one JSON line per command
on stdin: ``{"op": "set", "delay", "jitter", "loss"}`` (any subset; applies to packets read
from then on) -> ``{"ok": true}``; ``{"op": "stats"}`` -> packets seen, dropped (loss,
overflow), forwarded per direction, and the largest lateness of a write past its due time;
``{"op": "quit"}`` or stdin closed: exit.

Priority (``--priority``): a forwarder that waits for the CPU writes its packets late, which
adds to every RTT through it (``max_late``). On a busy box it asks for ``rr`` (default):
``SCHED_RR`` at the lowest real-time priority, so it runs as soon as a packet is due (it
blocks in ``select`` between packets, and the kernel's real-time throttling leaves others
their share), falling back to ``nice`` -15 where that is refused; ``nice``: only the nice
value; ``none``: leave it. The ready line and ``stats`` say which it got (``priority``).
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import random
import select
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
QUEUE_LIMIT = 16 << 20  # bytes per direction
READ_BATCH = 512  # packets read per wake-up before writing what is due
MAX_PACKET = 65536
NICE = -15  # the forwarder's nice value when it may not run as SCHED_RR
PRIORITIES = ("rr", "nice", "none")


def raise_priority(wanted: str) -> str:
    """Give this process ``wanted`` (``PRIORITIES``) or the next best it may have; what it got."""
    if wanted == "rr":
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
            return "rr"
        except (OSError, AttributeError):
            pass
    if wanted in ("rr", "nice"):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, NICE)
            return "nice"
        except OSError:
            pass
    return "none"


def open_tun(name: str) -> int:
    """Attach to the (existing) TUN device ``name``; a non-blocking fd of raw IP packets."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Direction:
    """One direction's FIFO of (due time, packet) and its counters."""

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.last_due = 0.0
        self.seen = self.lost = self.overflow = self.forwarded = 0


class DelayLine:
    def __init__(self, fd: int, host_ip: str, delay: float, jitter: float, loss: float, seed: int):
        self.fd = fd
        self.host = socket.inet_aton(host_ip)
        self.delay, self.jitter, self.loss = delay, jitter, loss
        self.rng = random.Random(seed)
        self.ways = {"in": Direction(), "out": Direction()}
        self.max_late = 0.0
        self.priority = "none"

    def configure(self, command: dict) -> None:
        delay = float(command.get("delay", self.delay))
        jitter = float(command.get("jitter", self.jitter))
        loss = float(command.get("loss", self.loss))
        if delay < 0 or jitter < 0 or not 0 <= loss < 1:
            raise ValueError(f"bad delay line settings: {command}")
        self.delay, self.jitter, self.loss = delay, jitter, loss

    def statistics(self) -> dict:
        keys = ("seen", "lost", "overflow", "forwarded")
        stats: dict = {f"{k}_{w}": getattr(d, k) for w, d in self.ways.items() for k in keys}
        return {**stats, "max_late": round(self.max_late, 4), "priority": self.priority}

    def read_packets(self, now: float) -> None:
        for _ in range(READ_BATCH):
            try:
                packet = os.read(self.fd, MAX_PACKET)
            except BlockingIOError:
                return
            way = self.ways["in" if packet[16:20] == self.host else "out"]
            way.seen += 1
            if self.loss and self.rng.random() < self.loss:
                way.lost += 1
                continue
            if way.queued + len(packet) > QUEUE_LIMIT:
                way.overflow += 1
                continue
            due = now + self.delay
            if self.jitter:
                due += self.rng.uniform(0.0, self.jitter)
            way.last_due = due = max(due, way.last_due)
            way.queue.append((due, packet))
            way.queued += len(packet)

    def write_due(self, now: float) -> float | None:
        """Write every packet due by ``now``; the next due time (None: nothing queued)."""
        next_due = None
        for way in self.ways.values():
            queue = way.queue
            while queue and queue[0][0] <= now:
                due, packet = queue.popleft()
                way.queued -= len(packet)
                self.max_late = max(self.max_late, now - due)
                try:
                    os.write(self.fd, packet)
                    way.forwarded += 1
                except OSError:
                    way.overflow += 1  # the kernel refused it: lost like a full queue
            if queue and (next_due is None or queue[0][0] < next_due):
                next_due = queue[0][0]
        return next_due


def answer(text: str, delay_line: DelayLine) -> bool:
    """Handle one command line; False: quit."""
    command = json.loads(text)
    op = command.get("op")
    if op == "quit":
        return False
    try:
        if op == "set":
            delay_line.configure(command)
            message: dict = {"ok": True}
        elif op == "stats":
            message = delay_line.statistics()
        else:
            message = {"error": f"unknown op {op!r}"}
    except (ValueError, TypeError) as e:
        message = {"error": str(e)}
    print(json.dumps(message), flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tun", required=True)
    parser.add_argument("--host", required=True, help="the host's IP: packets to it go 'in'")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds, each way")
    parser.add_argument("--jitter", type=float, default=0.0, help="extra seconds, 0..jitter")
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability, each way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--priority", choices=PRIORITIES, default="rr")
    args = parser.parse_args()
    priority = raise_priority(args.priority)
    fd = open_tun(args.tun)
    delay_line = DelayLine(fd, args.host, 0.0, 0.0, 0.0, args.seed)
    delay_line.configure(vars(args))
    delay_line.priority = priority
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    pending = b""
    print(json.dumps({"ready": args.tun, "priority": priority}), flush=True)
    next_due = None
    while True:
        timeout = None if next_due is None else max(next_due - time.monotonic(), 0.0)
        readable, _, _ = select.select([fd, stdin], [], [], timeout)
        now = time.monotonic()
        if fd in readable:
            delay_line.read_packets(now)
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                text, pending = pending.split(b"\n", 1)
                if text.strip() and not answer(text.decode(), delay_line):
                    return
        next_due = delay_line.write_due(time.monotonic())


if __name__ == "__main__":
    main()
