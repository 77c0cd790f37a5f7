"""Tiny fake source files for the real TFDS `lm1b` builder (One Billion Word benchmark), to prepare offline.

The writer lays files out exactly as tensorflow-datasets 4.9's `datasets/lm1b/lm1b_dataset_builder.py` reads them
after download and extraction: one tokenized sentence a line, train shards under
`training-monolingual.tokenized.shuffled/news.en-*` and held-out shards (the 'test' split) under
`heldout-monolingual.tokenized.shuffled/news.en.heldout-*`. The sentences are English numbers spelled out by
num2words in a short frame, tokenized as lm1b is (punctuation split off by spaces).
"""

from __future__ import annotations

import os

import tensorflow_datasets as tfds
from num2words import num2words

from tests.helpers import fake_tfds

LM1B_ROOT = "1-billion-word-language-modeling-benchmark-r13output"
_SHARDS = {"train": ("training-monolingual.tokenized.shuffled", "news.en-{:05d}-of-00100"),
           "test": ("heldout-monolingual.tokenized.shuffled", "news.en.heldout-{:05d}-of-00050")}


def lm1b_sentence(number: int) -> str:
    """Sentence `number`: 'They counted <number in words> votes .', every 3rd twice as long, every 5th with a
    double space to normalize away, and every 7th an empty line (which the input must drop)."""
    if number % 7 == 0:
        return ""
    space = "  " if number % 5 == 0 else " "
    words = num2words(number)
    more = f" , then {words} more" if number % 3 == 0 else ""
    return f"They counted{space}{words} votes{more} ."


def lm1b_corpus() -> dict[str, list[str]]:
    """Per split, the sentences `write_lm1b` writes by default: 40 train, 12 test."""
    return {"train": [lm1b_sentence(n) for n in range(1, 41)], "test": [lm1b_sentence(n) for n in range(41, 53)]}


def write_lm1b(root: str, corpus: dict[str, list[str]] | None = None, shards: int = 2) -> dict[str, list[str]]:
    """Writes the extracted lm1b archive under `root`, each split's sentences dealt over `shards` files."""
    corpus = corpus or lm1b_corpus()
    for split, sentences in corpus.items():
        folder, name = _SHARDS[split]
        os.makedirs(os.path.join(root, LM1B_ROOT, folder), exist_ok=True)
        for shard in range(shards):
            with open(os.path.join(root, LM1B_ROOT, folder, name.format(shard + 1)), "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in sentences[shard::shards])
    return corpus


def prepare_lm1b(data_dir: str, source_dir: str) -> dict[str, list[str]]:
    """Writes fake lm1b files into `source_dir` and runs the real builder on them into `data_dir`."""
    corpus = write_lm1b(source_dir)
    fake_tfds.prepare_offline(tfds.builder("lm1b", data_dir=data_dir), source_dir)
    return corpus
