"""State download progress: the byte accounting (pure), then real two-peer downloads with the bar
forced on (bytes reach the total) and off (two log lines, nothing per chunk)."""

from __future__ import annotations

import logging

import pytest
import torch
import trio
from tqdm import tqdm

from swarmtrain.averaging.state_checks import TensorSpec
from swarmtrain.averaging.state_progress import StateDownloadProgress
from swarmtrain.averaging.state_sharing import StateSharing
from swarmtrain.compression import Float16Compression, NoCompression
from swarmtrain.compression.base import CompressionInfo
from swarmtrain.compression.chunking import split_for_streaming
from swarmtrain.utils.progress import Progress, set_progress_bars
from tests.swarm_util import open_dhts

SHAPES = [(64, 64), (256, 256), (300,), (7, 9)]
STATE_BYTES = sum(torch.Size(s).numel() for s in SHAPES) * 4  # float32


@pytest.fixture
def bars():
    """Set the process-wide bar setting for one test, then restore it."""
    previous = set_progress_bars(None)
    try:
        yield set_progress_bars
    finally:
        set_progress_bars(previous)


def _counting(opened: list) -> StateDownloadProgress:
    def open_progress(total):
        progress = Progress("test download", total=total, bar=False)
        opened.append(progress)
        return progress

    return StateDownloadProgress(open_progress)


def _chunks(tensor, compression, chunk_size):
    message = compression.compress(tensor, CompressionInfo.from_tensor(tensor))
    return list(split_for_streaming(message, chunk_size))


def test_counts_decoded_bytes_in_proportion_to_wire_bytes():
    opened: list = []
    progress = _counting(opened)
    specs = [TensorSpec(s, torch.float32) for s in [(1000,), (10,)]]
    progress.on_header(specs)
    assert opened[0].total == 4040
    chunks = _chunks(torch.ones(1000), Float16Compression(), 500)  # 2000 wire bytes: 4 chunks
    assert len(chunks) == 4
    seen = []
    for chunk in chunks:
        progress.on_chunk(chunk)
        seen.append(progress.done)
    assert seen == [1000, 2000, 3000, 4000]  # float16 on the wire, float32 decoded
    progress.on_tensor(0, torch.ones(1000))
    assert progress.done == opened[0].done == 4000
    progress.on_chunk(_chunks(torch.ones(10), NoCompression(), 1 << 20)[0])  # one whole message
    assert progress.done == 4040
    progress.rewind(1)  # the donor failed after the message: the tensor in flight is gone
    assert progress.done == 4000
    progress.rewind(0)  # a rejected donor: nothing kept
    assert progress.done == 0 == opened[0].done
    progress.on_header(specs)  # the next donor's header opens nothing new
    assert len(opened) == 1
    progress.close(ok=True)
    assert opened[0].closed


def test_without_specs_the_total_is_unknown_and_nothing_opens_before_a_header():
    opened: list = []
    progress = _counting(opened)
    progress.close(ok=False)  # no donor answered: nothing was shown
    assert opened == []
    progress.on_header(None)
    assert opened[0].total is None


def test_without_specs_the_total_is_the_size_the_donor_announces():
    opened: list = []
    _counting(opened).on_header(None, 4040)
    _counting(opened).on_header(None, 0)  # an older donor announces nothing: unknown
    _counting(opened).on_header([TensorSpec((10,), torch.float32)], 10**12)  # checked specs win
    assert [p.total for p in opened] == [4040, None, 40]


def _state():
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=generator) for s in SHAPES]


class OlderDonor(StateSharing):
    """A donor of a version before ``StateHeader.state_bytes``: its header announces no size."""

    async def _rpc_download_state(self, request, context):
        async for response in super()._rpc_download_state(request, context):
            if response.HasField("header"):
                response.header.ClearField("state_bytes")
            yield response


async def _download_between_two_peers(
    checked: bool = True, donor_class: type[StateSharing] = StateSharing
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    donor_state = _state()

    async def get_state():
        return {"epoch": 3}, donor_state, None

    def check(metadata):
        return [TensorSpec(s, torch.float32) for s in SHAPES]

    common = {"state_compression": NoCompression(), "declare_state_period": 5.0}
    async with open_dhts(2) as (first, second):
        async with (
            donor_class.create(
                first,
                "progress",
                get_state=get_state,
                allow_state_sharing=True,
                chunk_size=16 * 1024,
                **common,
            ),
            StateSharing.create(
                second,
                "progress",
                get_state=get_state,
                allow_state_sharing=False,
                serve=False,
                **common,
            ) as newcomer,
        ):
            with trio.fail_after(20):  # the donor declared its state before create returned
                loaded = await newcomer.load_state_from_peers(check=check if checked else None)
    assert loaded is not None
    return donor_state, loaded[1]


@pytest.mark.trio
async def test_a_forced_bar_counts_the_bytes_up_to_the_state_size(bars, capsys):
    bars(True)
    expected, got = await _download_between_two_peers()
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    frames = capsys.readouterr().err.replace("\r", "\n").split("\n")
    frames = [f for f in frames if f.startswith("loading the state of progress:")]
    total = tqdm.format_sizeof(STATE_BYTES, divisor=1024)  # "273k": tqdm's scaled bytes
    assert f"0.00/{total} [" in frames[0]  # the total is known from the first frame on
    assert "100%" in frames[-1] and f"| {total}/{total} [" in frames[-1], frames[-1]
    assert "B/s]" in frames[-1]  # the rate


@pytest.mark.trio
async def test_without_a_bar_two_log_lines_and_nothing_per_chunk(bars, capsys, caplog):
    bars(False)
    with caplog.at_level(logging.INFO, logger="swarmtrain.averaging.state_sharing"):
        await _download_between_two_peers()
    assert capsys.readouterr().err == ""
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "swarmtrain.averaging.state_sharing" and "loading the state" in r.getMessage()
    ]
    size = f"{STATE_BYTES / 1024:.1f} KiB"
    assert len(lines) == 2, lines
    assert lines[0] == f"loading the state of progress: started ({size})"
    assert lines[1].startswith(f"loading the state of progress: done {size} in ")
    assert "4 tensors" in lines[1]


@pytest.mark.trio
@pytest.mark.parametrize("donor", ["current", "older"])
async def test_without_a_check_the_size_comes_from_the_donors_header(bars, caplog, donor):
    bars(False)
    older = donor == "older"
    with caplog.at_level(logging.INFO, logger="swarmtrain.averaging.state_sharing"):
        expected, got = await _download_between_two_peers(
            checked=False, donor_class=OlderDonor if older else StateSharing
        )
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "swarmtrain.averaging.state_sharing" and "loading the state" in r.getMessage()
    ]
    size = f"{STATE_BYTES / 1024:.1f} KiB"
    started = "loading the state of progress: started"
    assert lines[0] == (started if older else f"{started} ({size})"), lines
    assert lines[1].startswith(f"loading the state of progress: done {size} in "), lines
