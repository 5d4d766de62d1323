"""The monitor: its bounded state (pure), its HTTP server (real sockets), and the whole thing
following real training peers over loopback libp2p, read with a plain HTTP client."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
import trio.lowlevel
from swarm_util import FAST_DHT, open_dhts

from swarmtrain.dht import DHT
from swarmtrain.monitor import AsyncMetricsPublisher, LocalMetrics
from swarmtrain.monitor.http import DashboardServer
from swarmtrain.monitor.runs import AsyncRunAnnouncer, RunAnnouncement, announce_run, list_runs
from swarmtrain.monitor.sinks import SwarmPoint, TensorBoardSink, WandbSink
from swarmtrain.monitor.state import MonitorState, PeerProgress
from swarmtrain.monitor.watch import _parse_progress, refresh, send_to_sinks, watch
from swarmtrain.optim import ProgressTracker

QUICK = {"min_refresh_period": 0.2, "max_refresh_period": 0.5, "default_refresh_period": 0.5}


def metrics(peer: int, time_: float, loss: float | None = 1.0, rate: float = 10.0):
    return LocalMetrics(peer_id=f"peer{peer}", time=time_, loss=loss, samples_per_second=rate)


# ---------------------------------------------------------------- pure state


def test_state_keeps_alive_peers_and_swarm_curves():
    state = MonitorState(history=3, peer_history=2)
    state.on_metrics(
        "run", {b"[owner:a]": metrics(1, 1.0, 2.0), b"[owner:b]": metrics(2, 1.0, 4.0)}, 1.0
    )
    for now in (2.0, 3.0, 4.0):
        state.on_metrics("run", {b"[owner:a]": metrics(1, now, 1.0, rate=5.0)}, now)
    run = state.snapshot()["runs"]["run"]
    assert run["history"] == [[2.0, 1.0, 5.0, 1], [3.0, 1.0, 5.0, 1], [4.0, 1.0, 5.0, 1]]
    (peer,) = run["peers"]  # peer b's record expired: it is gone, with its history
    assert peer["peer_id"] == "peer1" and "history" not in peer
    assert state.peer_history_of("run", b"[owner:a]") == [(3.0, 1.0, 5.0), (4.0, 1.0, 5.0)]
    assert state.peer_history_of("run", b"[owner:b]") == []
    assert json.loads(json.dumps(state.snapshot())) == state.snapshot()


def test_state_memory_is_bounded_under_a_flood_of_peers_and_runs():
    state = MonitorState(max_runs=2, max_peers=10, history=5)
    flood = {f"[owner:{i}]".encode(): metrics(i, float(i)) for i in range(1000)}
    for round_ in range(50):
        state.on_metrics("run", flood, float(round_))
    for i in range(20):
        state.on_runs([RunAnnouncement(run_id=f"spam{i}", time=float(i))])
    snapshot = state.snapshot()["runs"]
    assert list(snapshot) == ["run", "spam0"]
    peers = snapshot["run"]["peers"]
    assert len(peers) == 10 and {p["time"] for p in peers} == {float(i) for i in range(990, 1000)}
    assert len(snapshot["run"]["history"]) == 5


def test_a_later_announcer_of_the_same_run_id_does_not_replace_the_first():
    organiser = RunAnnouncement(
        run_id="r", initial_peers=("/ip4/1.2.3.4/tcp/1/p2p/QmOrg",), time=1.0, announcer="QmOrg"
    )
    impostor = RunAnnouncement(
        run_id="r", initial_peers=("/ip4/6.6.6.6/tcp/1",), time=2.0, announcer="QmBad"
    )
    state = MonitorState()
    state.on_runs([impostor, organiser])  # both new: the one among its initial peers wins
    assert state.snapshot()["runs"]["r"]["announcement"]["announcer"] == "QmOrg"
    refreshed = RunAnnouncement(**(organiser.to_dict() | {"time": 3.0, "name": "v2"}))
    state.on_runs([impostor, dataclasses.replace(refreshed, announcer="QmOrg")])
    assert state.snapshot()["runs"]["r"]["announcement"]["name"] == "v2"
    state.on_runs([impostor])  # the organiser stopped announcing: the other one is shown
    assert state.snapshot()["runs"]["r"]["announcement"]["announcer"] == "QmBad"


def test_eta_from_progress_records():
    state = MonitorState(target_batch_size=1000)
    assert state.eta("run") is None
    state.follow("run")
    state.on_progress(
        "run", [PeerProgress(3, 300, 50.0), PeerProgress(3, 100, 50.0), PeerProgress(2, 999, 0.0)]
    )
    assert state.eta("run") == (3, 400, 6.0)
    assert state.snapshot()["runs"]["run"]["progress"]["eta_seconds"] == 6.0
    assert MonitorState().eta("run") is None
    with pytest.raises(ValueError):
        MonitorState(max_peers=0)


# ---------------------------------------------------------------- HTTP server


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def first_event(url: str, predicate, timeout: float = 20.0) -> dict:
    """Read ``url``'s event stream until a ``state`` event satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        event = None
        while time.monotonic() < deadline:
            line = response.readline().decode().rstrip("\n")
            if line == "event: state":
                event = "state"
            elif line.startswith("data: ") and event == "state":
                state = json.loads(line[len("data: ") :])
                if predicate(state):
                    return state
    raise TimeoutError("no matching event")


@asynccontextmanager
async def serving(server: DashboardServer):
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0, "127.0.0.1")
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_server_serves_the_page_the_state_and_events():
    server = DashboardServer()
    async with serving(server) as base:
        status, kind, body = await trio.to_thread.run_sync(http_get, base + "/")
        assert status == 200 and kind.startswith("text/html") and b"/app.js" in body
        assert b"http://" not in body.replace(b"http://www.w3.org", b"")  # no CDN
        status, kind, body = await trio.to_thread.run_sync(http_get, base + "/app.js")
        assert status == 200 and b"EventSource" in body
        status, _, _ = await trio.to_thread.run_sync(http_get, base + "/style.css")
        assert status == 200
        status, _, _ = await trio.to_thread.run_sync(http_get, base + "/../etc/passwd")
        assert status == 404
        server.publish(b'{"runs":{"a":1}}')
        status, kind, body = await trio.to_thread.run_sync(http_get, base + "/api/state")
        assert (status, kind, json.loads(body)) == (200, "application/json", {"runs": {"a": 1}})
        status, kind, body = await trio.to_thread.run_sync(http_get, base + "/state.js")
        assert body == b'window.SWARMTRAIN_STATE = {"runs":{"a":1}};\n' and "javascript" in kind
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                trio.to_thread.run_sync,
                first_event,
                base + "/events",
                lambda s: s == {"runs": {"b": 2}},
            )
            await trio.lowlevel.checkpoint()
            server.publish(b'{"runs":{"b":2}}')


async def raw_request(port: int, data: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        with trio.fail_after(10):
            await stream.send_all(data)
            received = b""
            try:
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass  # reset: the server closed with our request unread
            return received


@pytest.mark.trio
async def test_server_refuses_bad_requests_oversized_heads_and_too_many_clients():
    server = DashboardServer(max_connections=2, request_timeout=1.0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0, "127.0.0.1")
        assert (await raw_request(port, b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400")
        assert (await raw_request(port, b"POST / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        oversized = await raw_request(port, b"GET / HTTP/1.1\r\nX: " + b"a" * 20000)
        assert oversized.startswith(b"HTTP/1.1 431") or oversized == b""
        # two clients that never finish their request hold both slots: the next one is told
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        try:
            with trio.fail_after(10):
                while server._limiter.borrowed_tokens < 2:  # noqa: ASYNC110 (no event for it)
                    await trio.sleep(0.01)
            assert (await raw_request(port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 503")
        finally:
            for stream in idle:
                await stream.aclose()
        # the idle ones time out and free their slots: the page is served again
        with trio.fail_after(10):
            while True:
                answer = await raw_request(port, b"GET / HTTP/1.1\r\n\r\n")
                if answer.startswith(b"HTTP/1.1 200"):
                    break
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- real training peers


@pytest.mark.trio
async def test_monitor_follows_training_peers_and_streams_their_metrics():
    announcement = RunAnnouncement(run_id="run", name="tiny", command="python train.py")
    async with open_dhts(4) as (monitor_dht, *trainers), AsyncExitStack() as stack:
        publishers = []
        for i, dht in enumerate(trainers):
            tracker = await stack.enter_async_context(
                ProgressTracker.create(
                    dht,
                    "run",
                    1000,
                    use_pubsub=False,
                    min_refresh_period=0.2,
                    max_refresh_period=0.5,
                    default_refresh_period=0.5,
                )
            )
            tracker.report_local_progress(0, 100 * (i + 1))
            publisher = await stack.enter_async_context(
                AsyncMetricsPublisher.create(dht, "run", min_interval=0.2)
            )
            publisher.report(loss=1.0 + i, step=10 * i, samples_per_second=5.0 + i)
            publishers.append(publisher)
        await stack.enter_async_context(
            AsyncRunAnnouncer.create(trainers[0], announcement, expiration=60)
        )
        state = MonitorState(target_batch_size=1000)
        server = DashboardServer()
        async with serving(server) as base, trio.open_nursery() as nursery:
            nursery.start_soon(watch, monitor_dht, state, server, None, 0.2)

            def complete(snapshot):
                run = snapshot.get("runs", {}).get("run")
                return (
                    run is not None
                    and len(run["peers"]) == 3
                    and run["announcement"] is not None
                    and run["progress"] is not None
                    and run["progress"]["samples"] == 600
                )

            snapshot = await trio.to_thread.run_sync(first_event, base + "/events", complete)
            run = snapshot["runs"]["run"]
            assert sorted(p["loss"] for p in run["peers"]) == [1.0, 2.0, 3.0]
            assert {p["role"] for p in run["peers"]} == {"node"}
            assert run["announcement"]["command"] == "python train.py"
            assert run["history"][-1][1] == 2.0 and run["history"][-1][2] == 18.0
            assert run["progress"]["epoch"] == 0 and run["progress"]["eta_seconds"] is not None
            assert math.isfinite(run["progress"]["eta_seconds"])
            nursery.cancel_scope.cancel()


def start_monitor(address: str, *options: str) -> tuple[subprocess.Popen, str]:
    """A ``swarmtrain monitor`` subprocess following ``address`` (more ``options`` for it);
    its dashboard's base URL (read from its output, killed if it prints none)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmtrain.cli.main",
            "monitor",
            "--initial_peers",
            address,
            "--port",
            "0",
            "--refresh_period",
            "0.3",
            *options,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = [proc.stdout.readline()]  # other lines: warnings of a client on loopback
    while output[-1] and not output[-1].startswith("dashboard at "):
        output.append(proc.stdout.readline())
    if not output[-1].startswith("dashboard at http://127.0.0.1:"):
        proc.kill()
        proc.communicate()
        raise AssertionError(f"the monitor printed no dashboard address: {output}")
    return proc, output[-1].split(" at ")[1].strip().rstrip("/")


def test_the_monitor_command_serves_a_dashboard(tmp_path):
    trainer = DHT(**FAST_DHT)
    proc = None
    try:
        trainer.run_coroutine(
            lambda dht, _: announce_run(dht, RunAnnouncement(run_id="cli_run", name="from the CLI"))
        )
        proc, base = start_monitor(trainer.get_visible_maddrs()[0])
        status, _, page = http_get(base + "/")
        assert status == 200 and b"swarmtrain monitor" in page
        state = first_event(base + "/events", lambda s: "cli_run" in s.get("runs", {}))
        assert state["runs"]["cli_run"]["announcement"]["name"] == "from the CLI"
    finally:
        if proc is not None:
            proc.send_signal(__import__("signal").SIGINT)
            rest, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, rest
        trainer.shutdown()


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {"epoch": -1, "samples_accumulated": 1, "samples_per_second": 1.0},
        {"epoch": True, "samples_accumulated": 1, "samples_per_second": 1.0},
        {"epoch": 1, "samples_accumulated": 1, "samples_per_second": math.nan},
        {"epoch": 1, "samples_accumulated": 1, "samples_per_second": -1.0},
        {"epoch": 1, "samples_accumulated": "1", "samples_per_second": 1.0},
    ],
)
def test_bad_progress_records_are_ignored(value):
    assert _parse_progress(value) is None
    good = {"epoch": 1, "samples_accumulated": 2, "samples_per_second": 3.0}
    assert _parse_progress(good) == PeerProgress(1, 2, 3.0)


@pytest.mark.trio
async def test_a_flood_of_announced_runs_cannot_push_out_the_followed_run():
    async with open_dhts(4) as (monitor_dht, spammer, other_spammer, organiser):
        # one announcement per peer: a spammer's second run replaces its first
        for i in range(5):
            await announce_run(spammer, RunAnnouncement(run_id=f"spam{i}"))
        await announce_run(other_spammer, RunAnnouncement(run_id="spam"))
        await announce_run(organiser, RunAnnouncement(run_id="real", name="the real one"))
        with trio.fail_after(15):
            while True:
                runs = await list_runs(monitor_dht)
                if len(runs) == 3:
                    break
                await trio.sleep(0.05)
        assert sorted(run.run_id for run in runs) == ["real", "spam", "spam4"]
        state = MonitorState(max_runs=2)
        with trio.fail_after(15):
            while not state.snapshot()["runs"].get("real", {}).get("announcement"):
                await refresh(monitor_dht, state, "real")
        assert state.run_ids() == ["real"]
        everything = MonitorState(max_runs=2)
        await refresh(monitor_dht, everything, None)
        assert len(everything.run_ids()) == 2  # following all runs: bounded too


class ListSink:
    """A sink that keeps what it is sent (the protocol's simplest real implementation)."""

    def __init__(self):
        self.points: list[SwarmPoint] = []

    def log(self, point: SwarmPoint) -> None:
        self.points.append(point)

    def close(self) -> None:
        pass


class BrokenSink(ListSink):
    def log(self, point: SwarmPoint) -> None:
        raise RuntimeError("disk full")


def test_sinks_get_each_new_point_once_and_a_broken_sink_harms_nobody():
    state = MonitorState(target_batch_size=100)
    good, sent = ListSink(), {}
    state.on_metrics("run", {b"[owner:a]": metrics(1, 1.0, 2.0)}, 1.0)
    state.on_progress("run", [PeerProgress(4, 10, 1.0)])
    send_to_sinks(state, [BrokenSink(), good], sent)
    send_to_sinks(state, [BrokenSink(), good], sent)  # nothing new
    state.on_metrics("run", {b"[owner:a]": metrics(1, 2.0, None)}, 2.0)
    send_to_sinks(state, [good], sent)
    assert good.points == [
        SwarmPoint("run", 1.0, 1, 2.0, 10.0, 1, 4),
        SwarmPoint("run", 2.0, 2, None, 10.0, 1, 4),
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None
    and importlib.util.find_spec("wandb") is not None,
    reason="tensorboard and wandb are installed",
)
def test_sinks_name_the_package_to_install(tmp_path):
    for make, package in (
        (lambda: TensorBoardSink(str(tmp_path)), "tensorboard"),
        (lambda: WandbSink("p"), "wandb"),
    ):
        if importlib.util.find_spec(package) is None:
            with pytest.raises(ImportError, match=f"pip install {package}"):
                make()
    code = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmtrain.cli.main",
            "monitor",
            "--initial_peers",
            "/ip4/127.0.0.1/tcp/1",
            "--wandb_project",
            "p",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if importlib.util.find_spec("wandb") is None:
        assert code.returncode == 1 and "pip install wandb" in code.stderr
