"""A long run of `swarmtrain monitor` (a real subprocess) following peers that keep publishing
metrics while they come and go (a fresh peer id replaces one every few seconds), with a live
event-stream reader attached: the monitor's memory and CPU stay bounded (slow soak test;
SWARMTRAIN_SOAK_SECONDS sets its length, 150 s by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from contextlib import AsyncExitStack

import pytest
import trio
from swarm_util import FAST_DHT
from test_monitor_dashboard import start_monitor

from swarmtrain.dht import DHT
from swarmtrain.monitor import AsyncMetricsPublisher
from swarmtrain.monitor.runs import RunAnnouncement, announce_run

SOAK_SECONDS = float(os.environ.get("SWARMTRAIN_SOAK_SECONDS", "150"))
TRAINERS = 3
REPLACE_EVERY = 5.0  # seconds between a trainer leaving and a fresh one (new peer id) joining
MAX_RSS_GROWTH_MIB = 25.0  # from the end of the warm-up to the end of the run
MAX_CPU_CORES = 0.5  # the monitor's average CPU use after the warm-up


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _start_monitor(address: str) -> tuple[subprocess.Popen, threading.Thread, str]:
    proc, base = start_monitor(address)
    drain = threading.Thread(target=proc.stdout.read, daemon=True)  # keep its pipe drained
    drain.start()
    return proc, drain, base


def _read_events(url: str, stop: threading.Event, counts: list[int]) -> None:
    """A dashboard tab left open: read the event stream until ``stop``."""
    with urllib.request.urlopen(url, timeout=30) as response:
        while not stop.is_set():
            line = response.readline()
            if not line:
                return
            if line.startswith(b"event: state"):
                counts[0] += 1


async def _trainer(bootstrap: str, index: int, stop_after: float) -> None:
    """One trainer: a DHT peer of its own publishing changing metrics until ``stop_after``."""
    async with AsyncExitStack() as stack:
        dht = await stack.enter_async_context(DHT.create([bootstrap], **FAST_DHT))
        publisher = await stack.enter_async_context(
            AsyncMetricsPublisher.create(dht, "soak", min_interval=0.2, expiration=6.0)
        )
        step = 0
        while time.monotonic() < stop_after:
            step += 1
            publisher.report(loss=10.0 / step, step=step, samples_per_second=100.0 + index)
            await trio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 150)
@pytest.mark.trio
async def test_the_monitor_stays_bounded_over_a_long_run_with_churning_peers():
    async with DHT.create(**FAST_DHT) as bootstrap:
        await announce_run(bootstrap, RunAnnouncement(run_id="soak", name="soak test"))
        address = bootstrap.get_visible_maddrs()[0]
        proc, drain, base = await trio.to_thread.run_sync(_start_monitor, address)
        stop_reader, events = threading.Event(), [0]
        reader = threading.Thread(
            target=_read_events, args=(base + "/events", stop_reader, events), daemon=True
        )
        reader.start()
        samples: list[tuple[float, float, float]] = []  # (time, RSS MiB, CPU s)
        started = time.monotonic()
        end = started + SOAK_SECONDS
        peers_started = 0
        try:
            async with trio.open_nursery() as nursery:
                for index in range(TRAINERS):  # staggered lifetimes: one leaves every few s
                    lifetime = REPLACE_EVERY * (index + 1)
                    nursery.start_soon(_trainer, address, index, started + lifetime)
                    peers_started += 1
                next_join = started + REPLACE_EVERY
                while time.monotonic() < end:
                    if time.monotonic() >= next_join:
                        lifetime = REPLACE_EVERY * TRAINERS
                        nursery.start_soon(
                            _trainer, address, peers_started, time.monotonic() + lifetime
                        )
                        peers_started += 1
                        next_join += REPLACE_EVERY
                    assert proc.poll() is None, "the monitor exited"
                    samples.append((time.monotonic(), _rss_mib(proc.pid), _cpu_seconds(proc.pid)))
                    await trio.sleep(1.0)
        finally:
            stop_reader.set()
            proc.send_signal(signal.SIGINT)
            try:
                await trio.to_thread.run_sync(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            finally:
                await trio.to_thread.run_sync(drain.join, 10)
                proc.stdout.close()
    assert proc.returncode == 0
    assert events[0] >= SOAK_SECONDS / 2, events  # the stream kept flowing to the open tab
    warm = next(i for i, (t, _, _) in enumerate(samples) if t - started >= SOAK_SECONDS / 3)
    (t0, rss0, cpu0), (t1, rss1, cpu1) = samples[warm], samples[-1]
    growth, cores = rss1 - rss0, (cpu1 - cpu0) / (t1 - t0)
    print(
        f"{peers_started} peer ids over {SOAK_SECONDS:.0f} s: RSS {rss0:.0f} -> {rss1:.0f} MiB, "
        f"{cores:.2f} cores after the warm-up, {events[0]} events read"
    )
    assert growth < MAX_RSS_GROWTH_MIB, (rss0, rss1, peers_started)
    assert cores < MAX_CPU_CORES, cores
