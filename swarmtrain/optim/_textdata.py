"""Byte-level text that needs no download: the Python standard library's own ``.py`` files.

Used by :mod:`swarmtrain.optim.diloco_simulation`. Tokens are bytes (vocabulary 256). The
files of ``os.path.dirname(os.__file__)`` (top level only) are read in sorted order; every
``eval_every``-th file goes to the evaluation split, the others to training. The numbers a run
gives therefore depend on the Python version, not on the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["BatchSampler", "TextData", "stdlib_text"]


@dataclass(frozen=True)
class TextData:
    """Train and evaluation bytes, as 1-D uint8 tensors."""

    train: torch.Tensor
    eval: torch.Tensor

    def shards(self, num_shards: int) -> list[torch.Tensor]:
        """``num_shards`` disjoint, contiguous, equally long slices of the training bytes."""
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
        size = len(self.train) // num_shards
        return [self.train[i * size : (i + 1) * size] for i in range(num_shards)]

    def eval_windows(self, context: int, count: int) -> torch.Tensor:
        """``count`` fixed windows of ``context + 1`` bytes, evenly spaced over the eval split."""
        span = len(self.eval) - (context + 1)
        if span < 0 or count < 1:
            raise ValueError(f"cannot cut {count} windows of {context + 1} bytes from the eval set")
        starts = torch.linspace(0, span, count).long()
        return torch.stack([self.eval[s : s + context + 1] for s in starts.tolist()]).long()


def stdlib_text(max_bytes: int | None = 2_000_000, eval_every: int = 10) -> TextData:
    """The standard library's top-level ``.py`` files as bytes.

    :param max_bytes: read files (in sorted order) until this many bytes are collected
    :param eval_every: every ``eval_every``-th file (from the second) is evaluation data
    :raises FileNotFoundError: this Python has no readable standard library sources
    """
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 2:
        raise ValueError(f"eval_every must be an integer of at least 2, got {eval_every!r}")
    directory = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    train, evaluation = bytearray(), bytearray()
    for number, name in enumerate(names):
        if max_bytes is not None and len(train) + len(evaluation) >= max_bytes:
            break
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        (evaluation if number % eval_every == 1 else train).extend(data)
    if not train or not evaluation:
        raise FileNotFoundError(f"no standard library .py sources found in {directory}")
    return TextData(
        torch.frombuffer(train, dtype=torch.uint8).clone(),
        torch.frombuffer(evaluation, dtype=torch.uint8).clone(),
    )


class BatchSampler:
    """Random windows of ``context + 1`` bytes from one shard, from a seeded generator."""

    def __init__(self, tokens: torch.Tensor, context: int, batch_size: int, seed: int):
        if len(tokens) < context + 2:
            raise ValueError(f"a shard of {len(tokens)} bytes is too short for context {context}")
        self.tokens, self.context, self.batch_size = tokens, context, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        """A ``(batch_size, context + 1)`` int64 tensor."""
        starts = torch.randint(
            0, len(self.tokens) - self.context - 1, (self.batch_size,), generator=self.generator
        )
        offsets = torch.arange(self.context + 1)
        return self.tokens[starts[:, None] + offsets].long()
