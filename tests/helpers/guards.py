"""Guards that turn "fast" into something a test can check without a clock: work that must not happen raises."""

import pytest
import sentencepiece as spm
import tensorflow_datasets as tfds


def forbid_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any TFDS download manager created from now on fails the test: a missing dataset must not reach the network
    (with downloads allowed, TFDS retries for minutes before it gives up here)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a TFDS download manager was created: the code tried to download")

    monkeypatch.setattr(tfds.download.DownloadManager, "__init__", refuse)


def forbid_vocabulary_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training a SentencePiece model from now on fails the test: a cached vocabulary must be reused."""

    def refuse(*args, **kwargs):
        raise AssertionError("a SentencePiece model was trained again instead of reusing the cached one")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", refuse)
