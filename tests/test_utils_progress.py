"""swarmtrain.utils.progress: when bars are drawn, and the log lines drawn instead."""

from __future__ import annotations

import io
import logging

import pytest

from swarmtrain.utils.progress import (
    PROGRESS_BARS_ENV,
    Progress,
    format_size,
    progress_bars_enabled,
    progress_iter,
    set_progress_bars,
)

LOG = logging.getLogger("test.progress")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def auto_setting(monkeypatch):
    monkeypatch.delenv(PROGRESS_BARS_ENV, raising=False)
    previous = set_progress_bars(None)
    yield
    set_progress_bars(previous)


def test_bars_only_on_a_terminal_unless_asked(monkeypatch):
    assert progress_bars_enabled(_Terminal())
    assert not progress_bars_enabled(io.StringIO())
    monkeypatch.setenv(PROGRESS_BARS_ENV, "1")
    assert progress_bars_enabled(io.StringIO())
    monkeypatch.setenv(PROGRESS_BARS_ENV, "off")
    assert not progress_bars_enabled(_Terminal())
    assert set_progress_bars(True) is None  # the setting wins over the environment
    assert progress_bars_enabled(io.StringIO())
    assert set_progress_bars(False) is True
    assert not progress_bars_enabled(_Terminal())
    with pytest.raises(TypeError):
        set_progress_bars("yes")  # type: ignore[arg-type]


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 1024**3) == "3.0 GiB"
    assert format_size(12, "files") == "12 files"


def test_without_a_bar_one_line_at_start_and_one_at_end(caplog):
    now = [100.0]
    with caplog.at_level(logging.INFO, logger=LOG.name):
        progress = Progress("saving", total=4096, log=LOG, bar=False, clock=lambda: now[0])
        for _ in range(64):
            progress.advance(64)
        now[0] += 2.0
        progress.close(note=", 2 files")
        progress.close()  # idempotent
    assert [r.getMessage() for r in caplog.records] == [
        "saving: started (4.0 KiB)",
        "saving: done 4.0 KiB in 2.0 s, 2.0 KiB/s, 2 files",
    ]


def test_a_failure_says_how_far_it_got(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        with pytest.raises(KeyError), Progress("loading", total=2048, log=LOG, bar=False) as p:
            p.update_to(1024)
            raise KeyError
    assert caplog.records[-1].getMessage().startswith("loading: stopped after 1.0 KiB of 2.0 KiB")


def test_a_bar_draws_to_its_file_and_ends_at_the_total(caplog):
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        progress = Progress("copying", total=10, unit="it", log=LOG, bar=True, file=out)
        assert progress.has_bar
        for _ in range(10):
            progress.advance()
        progress.close()
    assert caplog.records == []  # the bar replaces the log lines
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("copying: 100%") and "10/10" in last


def test_progress_iter_counts_items(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert list(progress_iter(range(5), "tokenizing", log=LOG, bar=False)) == list(range(5))
    assert caplog.records[0].getMessage() == "tokenizing: started (5 it)"
    assert caplog.records[1].getMessage().startswith("tokenizing: done 5 it in ")


def test_without_tqdm_a_forced_bar_falls_back_to_log_lines(monkeypatch, caplog):
    import sys

    from swarmtrain.utils import progress as module

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    module._bar_class.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=LOG.name):
            with Progress("loading", total=10, unit="it", log=LOG, bar=True) as progress:
                progress.update_to(10)
        assert not progress.has_bar
        assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
            "loading: started (10 it)",
            "loading: done 10 it",
        ]
    finally:
        module._bar_class.cache_clear()
