"""The dashboard in a real browser: headless Chromium renders what real training peers publish.

Skipped where Chromium is not installed (``apt-get install -y chromium``). With
``SWARMTRAIN_SCREENSHOT=docs/monitor.png`` it also saves a screenshot there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import AsyncExitStack

import pytest
import trio
from polling import wait_until
from test_monitor_dashboard import open_dhts, serving

from swarmtrain.monitor import AsyncMetricsPublisher
from swarmtrain.monitor.http import DashboardServer
from swarmtrain.monitor.runs import AsyncRunAnnouncer, RunAnnouncement, generate_owner_key
from swarmtrain.monitor.state import MonitorState
from swarmtrain.monitor.watch import watch

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed")


async def chromium(*args: str) -> bytes:
    with tempfile.TemporaryDirectory() as profile:
        command = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--timeout=5000",
            *args,
        ]
        with trio.fail_after(60):
            result = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
        return result.stdout


@pytest.mark.trio
async def test_dashboard_renders_the_peers_in_headless_chromium(tmp_path):
    announcement = RunAnnouncement(
        run_id="demo_run",
        name="tiny transformer on the stdlib",
        model="2-layer transformer, 3M parameters",
        command="python examples/quickstart/train.py --run_id demo_run --initial_peers ...",
        requirements="any CPU",
    )
    async with open_dhts(3) as (monitor_dht, *trainers), AsyncExitStack() as stack:
        publishers = [
            await stack.enter_async_context(
                AsyncMetricsPublisher.create(dht, "demo_run", min_interval=0.1)
            )
            for dht in trainers
        ]
        await stack.enter_async_context(
            AsyncRunAnnouncer.create(trainers[0], announcement, owner_key=generate_owner_key())
        )
        publishers[1].report_failure(
            "state_download_failed",
            "3 state downloads from peers failed in a row (last: no donor answered in time)",
        )
        state = MonitorState()
        server = DashboardServer()
        async with serving(server) as base, trio.open_nursery() as nursery:
            nursery.start_soon(watch, monitor_dht, state, server, None, 0.1)
            with trio.fail_after(30):
                step = 0
                while True:  # a short loss curve, then every peer and the run are in the state
                    step += 1
                    for i, publisher in enumerate(publishers):
                        publisher.report(
                            loss=4.0 / (1 + 0.05 * step) + 0.1 * i,
                            step=step,
                            samples_per_second=30.0 + 5 * i,
                        )
                    run = state.snapshot()["runs"].get("demo_run")
                    if run and len(run["peers"]) == 2 and run["announcement"] and step > 40:
                        break
                    await trio.sleep(0.1)
            dom = (await chromium("--dump-dom", base + "/")).decode()
            assert dom.count('<tr class="peer">') == 2, dom
            assert "tiny transformer on the stdlib" in dom and "How to join" in dom
            assert "<polyline" in dom  # the charts were drawn
            assert '<td class="kind">state_download_failed</td>' in dom
            assert 'class="trust trust-owner"' in dom and "signed by the run's owner key" in dom
            screenshot = await trio.Path(
                os.environ.get("SWARMTRAIN_SCREENSHOT") or tmp_path / "monitor.png"
            ).absolute()
            await chromium(f"--screenshot={screenshot}", "--window-size=1200,1000", base + "/")
            assert (await screenshot.read_bytes()).startswith(b"\x89PNG\r\n\x1a\n")
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_failures_from_peers_are_shown_as_text_never_as_markup():
    """A peer's failure message is markup meant to run in the viewer's page: the dashboard
    shows it as text (no element is created from it)."""
    markup = "<img src=x onerror=\"document.title='pwned'\"><script>alert(1)</script>"
    async with open_dhts(2) as (monitor_dht, trainer):
        async with AsyncMetricsPublisher.create(trainer, "run", min_interval=0.1) as publisher:
            publisher.report(loss=1.0, step=1)
            publisher.report_failure("lone_peer", markup)
            state = MonitorState()
            server = DashboardServer()
            async with serving(server) as base, trio.open_nursery() as nursery:
                nursery.start_soon(watch, monitor_dht, state, server, "run", 0.1)
                with trio.fail_after(30):
                    await wait_until(lambda: state.failures_of("run"))
                dom = (await chromium("--dump-dom", base + "/")).decode()
                assert "Recent failures and warnings" in dom, dom
                assert '<td class="kind">lone_peer</td>' in dom
                assert "&lt;img src=x onerror=" in dom and "&lt;script&gt;alert(1)" in dom
                assert "<img" not in dom and "<script>alert" not in dom
                assert "pwned" not in dom.split("<title>")[1].split("</title>")[0]
                nursery.cancel_scope.cancel()
