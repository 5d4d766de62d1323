"""The terminal display of ``swarmtrain demo``: a small table redrawn in place on a terminal,
plain lines (one per swarm epoch) otherwise. Plain ANSI escapes, no dependency."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TextIO

_UP_AND_CLEAR = "\x1b[{n}F\x1b[J"  # cursor to the start of the line n lines up; clear below


@dataclass
class PeerView:
    """What the parent knows about one peer, from its latest events."""

    epoch: int = 0
    train_loss: float | None = None
    eval_loss: float | None = None
    accuracy: float | None = None
    samples_per_second: float = 0.0
    samples: int = 0  #: trained by this peer so far
    peers_seen: int = 0
    swarm_samples: int = 0
    status: str = "starting"
    history: list[tuple[int, float, float]] = field(default_factory=list)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class ProgressDisplay:
    """Renders ``PeerView`` rows; ``live`` redraws in place (a TTY), else prints epoch lines.

    :param out: the stream to write to
    :param live: redraw a table in place (else plain periodic lines)
    :param quiet: print nothing but :meth:`message` calls with ``important=True``
    """

    def __init__(self, out: TextIO, *, live: bool, quiet: bool = False, target: int, epochs):
        self.out, self.live, self.quiet = out, live, quiet
        self.target, self.epochs = target, epochs
        self._drawn_lines = 0
        self._last_draw = 0.0
        self._printed_epoch = 0
        self._last_line = (time.monotonic(), 0)  # time and swarm samples at the last epoch line
        self.started = time.monotonic()

    def message(self, text: str, *, important: bool = False) -> None:
        """Print a line above the table (the table is redrawn below it)."""
        if self.quiet and not important:
            return
        self._erase()
        self.out.write(text + "\n")
        self.out.flush()

    def update(self, peers: list[PeerView], *, force: bool = False) -> None:
        """Redraw the table (at most 4 times a second) or print lines for finished epochs."""
        if self.quiet:
            return
        if self.live:
            now = time.monotonic()
            if force or now - self._last_draw >= 0.25:
                self._erase()
                lines = self.render(peers)
                self.out.write("\n".join(lines) + "\n")
                self.out.flush()
                self._drawn_lines, self._last_draw = len(lines), now
            return
        epoch = min((p.epoch for p in peers), default=0)
        while self._printed_epoch < epoch:
            self._printed_epoch += 1
            self.out.write(self.epoch_line(peers, self._printed_epoch) + "\n")
            self.out.flush()

    def start_clock(self) -> None:
        """Training starts now: rates and times of epoch lines count from here."""
        self._last_line = (time.monotonic(), 0)

    def close(self) -> None:
        """Leave the last table on screen and stop redrawing."""
        self._drawn_lines = 0

    def _erase(self) -> None:
        if self.live and self._drawn_lines:
            self.out.write(_UP_AND_CLEAR.format(n=self._drawn_lines))
            self._drawn_lines = 0

    def render(self, peers: list[PeerView]) -> list[str]:
        """The table's lines: a swarm header, then one row per peer."""
        elapsed = time.monotonic() - self.started
        epoch = max((p.epoch for p in peers), default=0)
        of = f"/{self.epochs}" if self.epochs else ""
        rate = sum(p.samples_per_second for p in peers)
        swarm = max((p.swarm_samples for p in peers if p.epoch == epoch), default=0)
        filled = min(20, int(20 * swarm / max(1, self.target)))
        bar = "#" * filled + "." * (20 - filled)
        lines = [
            f"epoch {epoch}{of}  [{bar}] {min(swarm, self.target)}/{self.target} samples  "
            f"{rate:,.0f} samples/s  {elapsed:.1f} s",
            "  peer  epoch  train loss  eval loss  accuracy  samples/s  peers  status",
        ]
        for i, p in enumerate(peers):
            lines.append(
                f"  {i:>4}  {p.epoch:>5}  {_fmt(p.train_loss, '10.3f')}  "
                f"{_fmt(p.eval_loss, '9.3f')}  {_fmt(p.accuracy, '8.1%')}  "
                f"{p.samples_per_second:>9,.0f}  {p.peers_seen:>5}  {p.status}"
            )
        return lines

    def epoch_line(self, peers: list[PeerView], epoch: int) -> str:
        """One plain line for a swarm epoch: the peers' mean evaluation at that epoch."""
        seen = [h for p in peers for h in p.history if h[0] == epoch]
        loss = sum(h[1] for h in seen) / len(seen) if seen else None
        accuracy = sum(h[2] for h in seen) / len(seen) if seen else None
        now, samples = time.monotonic(), sum(p.samples for p in peers)
        rate = (samples - self._last_line[1]) / max(now - self._last_line[0], 1e-9)
        self._last_line = (now, samples)
        peers_seen = max((p.peers_seen for p in peers), default=0)
        of = f"/{self.epochs}" if self.epochs else ""
        return (
            f"epoch {epoch}{of}  eval loss {_fmt(loss, '.3f')}  accuracy {_fmt(accuracy, '.1%')}"
            f"  {rate:,.0f} samples/s  {peers_seen} peers  "
            f"{now - self.started:.1f} s"
        )
