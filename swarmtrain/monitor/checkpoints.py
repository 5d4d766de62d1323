"""The monitor's checkpoints of a run's shared state (``swarmtrain monitor --checkpoint_dir``).

The monitor downloads the state the run's peers share (``{run_id}_state_averager``: the
parameters and optimizer statistics of an ``Optimizer``'s ``TrainingStateAverager``, by default)
as a client that serves nothing and trains nothing
(:class:`~swarmtrain.averaging.state_sharing.StateSharing` with ``serve=False``), every
``every`` seconds, and saves it as one ``torch.save`` file ``{directory}/{run_id}/state_{ms}.pt``
holding ``{"run_id", "prefix", "time", "metadata", "tensors"}``, written to a temporary name
then renamed (a crash never leaves half a file under the final name). Only the newest ``keep``
checkpoints are kept.

What a donor sends is checked by state sharing (no NaN / inf, bounded messages, a donor whose
state fails is banned). The monitor knows no model: the first state it saves pins the shapes
and dtypes (:class:`~swarmtrain.averaging.state_checks.TensorSpec`) every later download must
have, so a donor cannot swap in a state of another shape or size once one was saved. The first
download is bounded by ``download_timeout`` only.

The schedule and the retention are plain functions (:class:`CheckpointSchedule`,
:func:`checkpoints_to_delete`); :func:`checkpoint_loop` does the I/O. Importing this module
imports torch (the monitor imports it only with ``--checkpoint_dir``).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import torch
import trio

from swarmtrain.averaging.state_checks import StateRejected, TensorSpec
from swarmtrain.averaging.state_sharing import StateSharing
from swarmtrain.compression import NoCompression
from swarmtrain.dht import AsyncDHT, get_dht_time

__all__ = [
    "CheckpointSchedule",
    "CheckpointStatistics",
    "checkpoint_loop",
    "checkpoints_to_delete",
    "save_state",
]

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^state_(\d{10,20})\.pt$")


class CheckpointSchedule:
    """When to try the next checkpoint: every ``every`` seconds after the last attempt, and
    ``retry`` seconds after a failed one (no state found). Pure: pass ``now``."""

    def __init__(self, every: float, retry: float | None = None):
        if not (math.isfinite(every) and every > 0):
            raise ValueError("checkpoint interval must be positive")
        self.every = every
        self.retry = min(every, 30.0) if retry is None else retry
        self._next = -math.inf

    def due(self, now: float) -> float:
        """Seconds until the next attempt (0: now)."""
        return max(0.0, self._next - now)

    def attempted(self, now: float, saved: bool) -> None:
        self._next = now + (self.every if saved else self.retry)


def checkpoints_to_delete(names: Sequence[str], keep: int) -> list[str]:
    """Of the files ``names`` in a run's checkpoint folder, those beyond the newest ``keep``
    checkpoints (other files are never named)."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    ours = sorted((n for n in names if _NAME_RE.match(n)), key=lambda n: int(n[6:-3]))
    return ours[:-keep] if len(ours) > keep else []


@dataclass(frozen=True)
class CheckpointStatistics:
    saved: int
    failed: int
    last_path: str | None


def _specs(tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]


def save_state(
    directory: str, run_id: str, prefix: str, metadata: Any, tensors: list, now: float, keep: int
) -> str:
    """Write one checkpoint (atomically) and delete those beyond the newest ``keep``; its path.
    Blocking: run it in a worker thread."""
    folder = os.path.join(directory, run_id)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"state_{int(now * 1000):013d}.pt")
    temporary = path + ".partial"
    payload = {
        "run_id": run_id,
        "prefix": prefix,
        "time": now,
        "metadata": metadata,
        "tensors": tensors,
    }
    torch.save(payload, temporary)
    os.replace(temporary, path)
    for name in checkpoints_to_delete(os.listdir(folder), keep):
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    return path


class CheckpointLoop:
    """The state of :func:`checkpoint_loop` (its statistics, the pinned tensor specs)."""

    def __init__(self, run_id: str, directory: str, keep: int, prefix: str):
        if not isinstance(run_id, str) or not run_id or os.sep in run_id or run_id in (".", ".."):
            raise ValueError(f"cannot checkpoint run_id {run_id!r} (not a folder name)")
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.run_id, self.directory, self.keep, self.prefix = run_id, directory, keep, prefix
        self.specs: list[TensorSpec] | None = None  #: pinned by the first saved state
        self.saved = self.failed = 0
        self.last_path: str | None = None
        self.on_saved: Callable[[str], None] | None = None  #: called with each saved path
        self.rejected_donors: set[str] = set()  #: peer ids whose state failed a check

    def statistics(self) -> CheckpointStatistics:
        return CheckpointStatistics(self.saved, self.failed, self.last_path)

    def check(self, metadata: Any) -> list[TensorSpec]:
        if self.specs is None:
            raise AssertionError("check is used only once specs are pinned")
        return self.specs

    async def attempt(self, sharing: StateSharing, download_timeout: float) -> bool:
        """One download (bounded by ``download_timeout``) and save; whether a checkpoint was
        written."""
        loaded = None
        with trio.move_on_after(download_timeout):
            try:
                check = None if self.specs is None else self.check
                loaded = await sharing.load_state_from_peers(check=check)
            except StateRejected as e:
                logger.warning("the shared state of %s was rejected: %s", self.run_id, e)
        if loaded is None:
            self.failed += 1
            for reason in getattr(sharing.last_failure, "reasons", ()):
                if reason.rejected is not None:
                    self.rejected_donors.add(reason.donor.to_base58())
            why = sharing.last_failure or "no donor answered in time"
            logger.info("no checkpoint of %s this time: %s", self.run_id, why)
            return False
        metadata, tensors = loaded
        path = await anyio.to_thread.run_sync(
            save_state,
            self.directory,
            self.run_id,
            self.prefix,
            metadata,
            list(tensors),
            get_dht_time(),
            self.keep,
        )
        if self.specs is None:
            self.specs = _specs(tensors)
        self.saved += 1
        self.last_path = path
        logger.info("saved the shared state of %s to %s", self.run_id, path)
        if self.on_saved is not None:
            self.on_saved(path)
        return True


async def checkpoint_loop(
    dht: AsyncDHT,
    run_id: str,
    directory: str,
    *,
    every: float,
    keep: int = 3,
    download_timeout: float = 300.0,
    prefix: str | None = None,
    on_saved: Callable[[str], None] | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Save ``run_id``'s shared state into ``directory`` every ``every`` seconds, keeping the
    newest ``keep``, until cancelled (see the module docstring). ``prefix``: the averager whose
    state is saved (default ``f"{run_id}_state_averager"``, the ``Optimizer``'s);
    ``on_saved(path)`` is called after each save. A failed save is logged and retried sooner.
    ``task_status.started(loop)`` hands out the :class:`CheckpointLoop` (its statistics)."""
    prefix = f"{run_id}_state_averager" if prefix is None else prefix
    loop = CheckpointLoop(run_id, directory, keep, prefix)
    loop.on_saved = on_saved
    schedule = CheckpointSchedule(every)

    async def nothing_to_serve():
        raise RuntimeError("the monitor serves no state")

    async with StateSharing.create(
        dht,
        prefix,
        get_state=nothing_to_serve,
        state_compression=NoCompression(),
        allow_state_sharing=False,
        declare_state_period=math.inf,
        serve=False,
        message_timeout=min(30.0, download_timeout),
    ) as sharing:
        task_status.started(loop)
        while True:
            await trio.sleep(schedule.due(trio.current_time()))
            try:
                saved = await loop.attempt(sharing, download_timeout)
            except OSError as e:  # disk full, permissions: try again later
                logger.error("could not save a checkpoint of %s: %s", run_id, e)
                loop.failed += 1
                saved = False
            schedule.attempted(trio.current_time(), saved)
