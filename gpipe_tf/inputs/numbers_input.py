"""What the inputs built from the spelled-out numbers corpus share: its Params, its split, its vocabulary, its shapes.

Translation (translation_input.NumbersTranslationInput) and language modelling
(language_model_input.NumbersLanguageModelInput) read the same corpus: the numbers in [0, max_number), split into
train, dev and test by a hash of (corpus_seed, number) (numbers_corpus.split_numbers), spelled in `languages`.

* Vocabulary: both learn it from every train number in every language, with a `<2xx>` tag per language, so equal
  settings share one cached model file in vocab_dir (see vocabulary.load_or_train).
* Shapes: every example is padded to one fixed `max_length`, so the train step is traced once and every
  micro-batch of a pipeline has the same shape. Longer examples are dropped from train and an error in dev/test.
* Order: batches are gathered by index from constant arrays (text_base.indexed_batches): deterministic given
  `seed`, reshuffled every epoch when training, and iterator checkpoints hold positions only.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs import numbers_corpus
from gpipe_tf.inputs.text_base import TextInput, indexed_batches

# Part of the cached vocabulary's file name: bump it when the corpus text or the vocabulary training changes,
# so that an old model in vocab_dir is not reused for different text.
_VOCAB_FORMAT = 1


class NumbersCorpusInput(TextInput):
    """Base of the numbers-corpus inputs; list it first: `class X(NumbersCorpusInput, TranslationInput)`.

    `__init__` checks the corpus Params, sets `self.splits` ({split: ascending numbers}) and `self.vocab`.
    A subclass then builds its examples, keeps those that fit (`_keep_fitting`), stores them as equal-length
    numpy arrays in `self._arrays` and turns gathered rows into its batch dict in `_batch`.
    """

    _arrays: dict[str, np.ndarray]

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: 10 languages, numbers below 10,000 split 80/10/10, a 1,000-id vocabulary, length 16."""
        p = super().params()
        p.define("languages", list(numbers_corpus.LANGUAGES), "num2words language codes of the corpus.")
        p.define("max_number", 10_000, "The corpus spells the numbers in [0, max_number).")
        p.define("split", "train", f"Which part of the numbers: one of {numbers_corpus.SPLITS}.")
        p.define("split_fractions", (0.8, 0.1, 0.1), "Shares of the numbers in train, dev and test.")
        p.define("corpus_seed", 1234, "Seed of the split and of the language pairs: keep it equal across "
                 "train/dev/test (unlike seed, which only orders the training batches), or splits overlap.")
        p.define("max_length", 16, "Fixed length every sequence is padded to (translation: the tagged source, and "
                 "the target + bos/eos; language model: the tagged sentence + bos/eos). Longer examples are dropped "
                 "from the train split; in dev/test they are an error.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        if p.split not in numbers_corpus.SPLITS:
            raise ParamsError(f"split={p.split!r} must be one of {numbers_corpus.SPLITS}")
        if p.max_length < 2:
            raise ParamsError(f"max_length={p.max_length} must be >= 2 (a sequence needs bos or eos and a token)")
        try:
            for lang in p.languages:
                numbers_corpus.check_language(lang)
            self.splits = numbers_corpus.split_numbers(p.max_number, p.corpus_seed, tuple(p.split_fractions))
        except ValueError as e:
            raise ParamsError(str(e)) from None
        setting = (_VOCAB_FORMAT, importlib.metadata.version("num2words"), list(p.languages), p.max_number,
                   p.corpus_seed, tuple(p.split_fractions))
        # Language by language, so that a subsample keeps every language (not only every 10th sentence).
        self.vocab = self._load_vocabulary(
            "numbers", setting, lambda: [numbers_corpus.spell(n, lang) for lang in p.languages
                                         for n in self.splits["train"]], p.languages)

    def _keep_fitting(self, needed: list[int], describe: Callable[[int], str]) -> list[int]:
        """Indices of the examples whose `needed` positions fit max_length; sets num_examples and num_dropped.

        Longer train examples are dropped with a warning; a longer dev or test example is a ConfigError (an
        evaluation must see all of them), naming example i by `describe(i)`. Fewer fitting examples than
        batch_size is a ConfigError too (there would be no batch at all).
        """
        p = self.p
        too_long = [i for i, n in enumerate(needed) if n > p.max_length]
        if too_long and p.split != "train":
            i = too_long[0]
            raise ConfigError(
                f"{len(too_long)} of {len(needed)} {p.split} examples do not fit max_length={p.max_length}, e.g. "
                f"example {i} ({describe(i)}) needs {needed[i]} positions. Raise the input param max_length to "
                f"at least {max(needed)} (evaluation examples are never dropped).")
        keep = [i for i, n in enumerate(needed) if n <= p.max_length]
        self.num_dropped = len(needed) - len(keep)
        if self.num_dropped:
            logging.warning("Dropped %d of %d train examples longer than max_length=%d (the longest needs %d).",
                            self.num_dropped, len(needed), p.max_length, max(needed))
        self.num_examples = len(keep)
        if self.num_examples < p.batch_size:
            raise ConfigError(f"the {p.split} split has {self.num_examples} examples that fit max_length="
                              f"{p.max_length}, fewer than batch_size={p.batch_size}: raise max_number (or the "
                              "examples per number), or lower batch_size")
        return keep

    def _in_batch_order(self, entries: list) -> list:
        """`entries` (one per kept example, in corpus order) as batches yield them: with num_batches set, the first
        num_batches * batch_size (row j of batch b is entry b * batch_size + j); without (training, shuffled), all."""
        if self.p.num_batches is None:
            return list(entries)
        return entries[:min(self.p.num_batches, self.num_examples // self.p.batch_size) * self.p.batch_size]

    def _batch(self, rows: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        """The batch dict from `self._arrays` rows gathered for one batch."""
        raise NotImplementedError(f"{type(self).__name__}._batch")

    def _gather(self, indices: tf.Tensor) -> dict[str, tf.Tensor]:
        return self._batch({name: tf.gather(tf.constant(array), indices) for name, array in self._arrays.items()})

    def dataset(self) -> tf.data.Dataset:
        """The batches: shuffled every epoch and endless, or the first num_batches in corpus order."""
        p = self.p
        return indexed_batches(self.num_examples, p.batch_size, p.seed, p.num_batches, self._gather)
