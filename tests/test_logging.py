"""swarmtrain never touches the root logger; ``verbose=True`` and ``SWARMTRAIN_LOGLEVEL`` show
its progress through a handler on the ``swarmtrain`` logger only.

Each check runs in a fresh interpreter: pytest's own logging plugin puts handlers on the root
logger, and the question is what the root logger of a plain script looks like.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from polling import wait_until

from swarmtrain.dht import DHT
from swarmtrain.optim import ProgressTracker

REPO = Path(__file__).resolve().parents[1]


def run_script(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "SWARMTRAIN_LOGLEVEL"}
    environment.update(env or {})
    environment["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=100,
        env=environment,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


CONNECT_TWO_PEERS = """
    import logging, trio
    from swarmtrain.p2p import P2P

    async def connect():
        async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
            await trio.sleep(0.2)

    trio.run(connect)
"""


def test_connecting_peers_leaves_the_root_logger_alone_and_basic_config_works():
    result = run_script(
        CONNECT_TWO_PEERS
        + """
    print("handlers after connecting:", logging.root.handlers, logging.root.level)
    logging.basicConfig(level=logging.INFO, format="USER %(name)s %(message)s")
    print("level after basicConfig:", logging.getLevelName(logging.root.level))
    logging.getLogger("app").info("hello")
    """
    )
    assert "handlers after connecting: [] 30" in result.stdout, result.stdout + result.stderr
    assert "level after basicConfig: INFO" in result.stdout
    assert "USER app hello" in result.stderr


LONE_OPTIMIZER = """
    import logging, torch
    import swarmtrain
    {setup}
    dht = swarmtrain.DHT(start=True)
    model = torch.nn.Linear(4, 1)
    opt = swarmtrain.Optimizer(
        dht=dht, run_id="verbose_test", target_batch_size=16, batch_size_per_step=8,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), matchmaking_time=0.5,
        averaging_timeout=2, verbose={verbose},
    )
    while opt.local_epoch < 2:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.shutdown()
    dht.shutdown()
    print("root handlers:", logging.root.handlers)
"""


def test_verbose_shows_epochs_without_a_root_handler():
    result = run_script(LONE_OPTIMIZER.format(setup="", verbose=True))
    assert "verbose_test: epoch 1" in result.stderr, result.stderr
    assert "verbose_test: epoch 2" in result.stderr
    assert "INFO swarmtrain.optim" in result.stderr
    assert "root handlers: []" in result.stdout


def test_without_verbose_nothing_at_info_is_printed():
    result = run_script(LONE_OPTIMIZER.format(setup="", verbose=False))
    assert "epoch 1" not in result.stderr, result.stderr


def test_verbose_with_the_users_logging_prints_each_record_once_through_the_users_handler():
    setup = 'logging.basicConfig(level=logging.WARNING, format="USER %(name)s: %(message)s")'
    result = run_script(LONE_OPTIMIZER.format(setup=setup, verbose=True))
    lines = result.stderr.splitlines()
    epoch_line = "USER swarmtrain.optim.optimizer: verbose_test: epoch 1 (no state averaging)"
    assert epoch_line in lines, result.stderr
    assert sum("verbose_test: epoch 1 " in line for line in lines) == 1, result.stderr


def test_loglevel_environment_variable_shows_debug_records():
    code = """
        import logging, swarmtrain
        logging.getLogger("swarmtrain.example").debug("a debug record")
        logging.getLogger("other").warning("not ours")
        print("root handlers:", logging.root.handlers)
    """
    shown = run_script(code, env={"SWARMTRAIN_LOGLEVEL": "debug"})
    assert "DEBUG swarmtrain.example] a debug record" in shown.stderr, shown.stderr
    assert "root handlers: []" in shown.stdout
    quiet = run_script(code)
    assert "a debug record" not in quiet.stderr


def test_a_bad_loglevel_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-c", "import swarmtrain"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SWARMTRAIN_LOGLEVEL": "loud", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode != 0
    assert "unknown log level 'loud'" in result.stderr


@pytest.mark.trio
async def test_progress_is_logged_at_the_status_level_once_per_change(caplog):
    fast = {"use_relay": False, "relay_service": False, "use_autonat": False}
    refresh = {"min_refresh_period": 0.2, "max_refresh_period": 0.3, "default_refresh_period": 0.3}
    caplog.set_level(logging.DEBUG, logger="swarmtrain.optim.progress_tracker")
    async with (
        DHT.create(**fast) as dht,
        ProgressTracker.create(
            dht, "log_once", 1000, status_loglevel=logging.INFO, **refresh
        ) as tracker,
    ):
        tracker.report_local_progress(0, 10)
        with trio.fail_after(20):  # a fetch every 0.2-0.3 s
            await wait_until(lambda: len(_fetch_logs(caplog)) >= 5)
    records = _fetch_logs(caplog)
    at_info = [r for r in records if r.levelno == logging.INFO]
    assert len(records) >= 5, [r.getMessage() for r in records]  # a fetch every 0.2-0.3 s
    assert 1 <= len(at_info) <= 2, [r.getMessage() for r in at_info]  # 0 peers, then 1


def _fetch_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "samples of 1000" in r.getMessage()]
