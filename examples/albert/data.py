"""Data for the ALBERT recipe, made offline: a corpus of text lines read from the Python
standard library's own sources, a WordPiece tokenizer trained on it (``tokenizers``), and ALBERT
pre-training examples: masked language modelling (15% of the tokens: 80% ``[MASK]``, 10% a
random token, 10% kept) plus sentence-order prediction (two consecutive segments, swapped for
half of the examples). Masks are drawn once, from a seed (static masking, as original BERT).
Preprocessing shows a progress bar on a terminal (or with ``SWARMTRAIN_PROGRESS_BARS=1``), else
logs a line when it starts and ends (``swarmtrain.utils.progress``).

    python examples/albert/data.py --output_dir albert_data   # tokenizer + a preview
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from collections.abc import Iterator

import tokenizers
import torch

from swarmtrain.utils.progress import progress_bars_enabled, progress_iter

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
logger = logging.getLogger("albert.data")


def stdlib_documents(max_files: int | None = 40) -> list[list[str]]:
    """One document per standard-library module (sorted by name): its non-empty lines."""
    directory = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))[:max_files]
    documents = []
    for name in names:
        with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        if len(lines) >= 4:
            documents.append(lines)
    if not documents:
        raise FileNotFoundError(f"no standard library .py sources in {directory}")
    return documents


def train_tokenizer(documents: list[list[str]], vocab_size: int) -> tokenizers.Tokenizer:
    """A BERT-style WordPiece tokenizer trained on ``documents``."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=progress_bars_enabled(),  # tokenizers' own bar, under the same rule
    )
    lines = (line for document in documents for line in document)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def _segments(document: list[list[int]], length: int) -> Iterator[list[int]]:
    """Consecutive runs of whole lines, each at most ``length`` tokens."""
    current: list[int] = []
    for line in document:
        if current and len(current) + len(line) > length:
            yield current
            current = []
        current.extend(line[:length])
    if current:
        yield current


def pretraining_examples(
    documents: list[list[str]], tokenizer: tokenizers.Tokenizer, seq_len: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """MLM + sentence-order-prediction examples of ``seq_len`` tokens (``[CLS] A [SEP] B [SEP]``,
    padded); ``sentence_order_label`` 1 when A and B were swapped."""
    rng = random.Random(seed)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size()
    half = (seq_len - 3) // 2
    examples = []
    for document in progress_iter(documents, "preprocessing", unit="documents", log=logger):
        encoded = [e.ids for e in tokenizer.encode_batch(document, add_special_tokens=False)]
        segments = list(_segments(encoded, half))
        for first, second in zip(segments[0::2], segments[1::2], strict=False):
            swapped = rng.random() < 0.5
            a, b = (second, first) if swapped else (first, second)
            tokens = [ids["[CLS]"], *a, ids["[SEP]"], *b, ids["[SEP]"]]
            types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
            labels = [-100] * len(tokens)
            for i, token in enumerate(tokens):
                if token in (ids["[CLS]"], ids["[SEP]"]) or rng.random() >= 0.15:
                    continue
                labels[i] = token
                draw = rng.random()
                if draw < 0.8:
                    tokens[i] = ids["[MASK]"]
                elif draw < 0.9:
                    tokens[i] = rng.randrange(len(SPECIAL_TOKENS), vocab_size)
            padding = seq_len - len(tokens)
            examples.append(
                {
                    "input_ids": torch.tensor(tokens + [ids["[PAD]"]] * padding),
                    "attention_mask": torch.tensor([1] * len(tokens) + [0] * padding),
                    "token_type_ids": torch.tensor(types + [0] * padding),
                    "labels": torch.tensor(labels + [-100] * padding),
                    "sentence_order_label": torch.tensor(int(swapped)),
                }
            )
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="albert_data")
    parser.add_argument("--vocab_size", type=int, default=2000)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--max_files", type=int, default=40)
    args = parser.parse_args()
    documents = stdlib_documents(args.max_files)
    tokenizer = train_tokenizer(documents, args.vocab_size)
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer.save(os.path.join(args.output_dir, "tokenizer.json"))
    examples = pretraining_examples(documents, tokenizer, args.seq_len)
    torch.save(examples, os.path.join(args.output_dir, "examples.pt"))
    print(f"{len(documents)} documents, {len(examples)} examples -> {args.output_dir}")
    print(tokenizer.decode(examples[0]["input_ids"].tolist(), skip_special_tokens=False)[:300])


if __name__ == "__main__":
    main()
