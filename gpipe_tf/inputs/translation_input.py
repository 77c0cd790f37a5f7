"""Translation batches from the spelled-out numbers corpus, encoded with a SentencePiece vocabulary.

Each example translates one number between two languages; the source starts with the target-language tag
("<2fr> twenty-one" -> "vingt et un"), so one model serves every direction (many-to-many).

Shapes are static: source and target are padded to one fixed `max_length` (no length buckets), so the train
step is traced once and every micro-batch of the pipeline has the same shape. Spelled-out numbers are short:
with the defaults (numbers below 10,000, a 1,000-id vocabulary) a tagged source takes 5.7 tokens on average
and the longest example of any split and direction needs 12 positions, so the default max_length of 16 fits
them all with little padding.

Determinism: the corpus is a pure function of `corpus_seed` (see numbers_corpus), the vocabulary is trained
deterministically from the train split only, and training order is a stateless shuffle of the example indices
seeded by (seed, epoch). The iterator checkpoint thus holds only positions, and a restored iterator resumes at
the exact example.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import tensorflow as tf
from absl import logging

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs import numbers_corpus
from gpipe_tf.inputs.translation_base import TranslationInput

# Part of the cached vocabulary's file name: bump it when the corpus text or the vocabulary training changes,
# so that an old model in vocab_dir is not reused for different text.
_VOCAB_FORMAT = 1


class NumbersTranslationInput(TranslationInput):
    """Batches of number translations with a static batch dimension (the last partial batch is dropped).

    Batches are TranslationInput's, with S = T = max_length. The vocabulary learns from a deterministic
    subsample of the train split's sentences (~0.4 s per 100,000). num_batches=None repeats forever, reshuffled
    every epoch; an int gives that many batches (fewer if the split is smaller) in the corpus's order, matching
    `references()`.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: 10 languages, numbers below 10,000, a 1,000-id vocabulary, sequences of 16."""
        p = super().params()
        p.define("languages", list(numbers_corpus.LANGUAGES), "num2words language codes of the corpus.")
        p.define("max_number", 10_000, "The corpus spells the numbers in [0, max_number).")
        p.define("split", "train", f"Which part of the numbers: one of {numbers_corpus.SPLITS}.")
        p.define("split_fractions", (0.8, 0.1, 0.1), "Shares of the numbers in train, dev and test.")
        p.define("corpus_seed", 1234, "Seed of the split and of the language pairs: keep it equal across "
                 "train/dev/test (unlike seed, which only orders the training batches), or splits overlap.")
        p.define("pairs_per_number", 4, "Examples per number, each in a different (source, target) direction.")
        p.define("directions", "many_to_many", f"Language directions: one of {numbers_corpus.DIRECTIONS}.")
        p.define("max_length", 16, "Fixed length S = T of source and target (target + bos/eos). Longer "
                 "examples are dropped from the train split; in dev/test they are an error.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        if p.split not in numbers_corpus.SPLITS:
            raise ParamsError(f"split={p.split!r} must be one of {numbers_corpus.SPLITS}")
        if p.directions not in numbers_corpus.DIRECTIONS:
            raise ParamsError(f"directions={p.directions!r} must be one of {numbers_corpus.DIRECTIONS}")
        if p.max_length < 2:
            raise ParamsError(f"max_length={p.max_length} must be >= 2 (a target needs bos or eos and a token)")
        try:
            splits = numbers_corpus.split_numbers(p.max_number, p.corpus_seed, tuple(p.split_fractions))
            numbers = splits[p.split]
            pairs = numbers_corpus.make_pairs(numbers, p.languages, p.corpus_seed, p.pairs_per_number,
                                              p.directions)
        except ValueError as e:
            raise ParamsError(str(e)) from None
        setting = (_VOCAB_FORMAT, importlib.metadata.version("num2words"), list(p.languages), p.max_number,
                   p.corpus_seed, tuple(p.split_fractions))
        # Language by language, so that a subsample keeps every language (not only every 10th sentence).
        self.vocab = self._load_vocabulary(
            "numbers", setting, lambda: [numbers_corpus.spell(n, lang) for lang in p.languages
                                         for n in splits["train"]], p.languages)
        self._encode(pairs, [n for n in numbers for _ in range(p.pairs_per_number)])

    def _encode(self, pairs: list[tuple[str, str, str, str]], numbers: list[int]) -> None:
        p = self.p
        sources = [numbers_corpus.tagged_source(tgt_lang, src_text) for _, tgt_lang, src_text, _ in pairs]
        targets = [tgt_text for _, _, _, tgt_text in pairs]
        src_ids = self.vocab.encode_batch(sources)
        tgt_ids = self.vocab.encode_batch(targets)
        # A target takes one more position than its tokens: bos in tgt_in_ids, eos in tgt_out_ids.
        needed = [max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids)]
        too_long = [i for i, n in enumerate(needed) if n > p.max_length]
        if too_long and p.split != "train":
            i = too_long[0]
            raise ConfigError(
                f"{len(too_long)} of {len(pairs)} {p.split} examples do not fit max_length={p.max_length}, e.g. "
                f"example {i} (number {numbers[i]}, {pairs[i][0]}->{pairs[i][1]}): {sources[i]!r} -> "
                f"{targets[i]!r} needs {needed[i]} positions ({len(src_ids[i])} source tokens, "
                f"{len(tgt_ids[i])} target tokens + bos/eos). Raise the input param max_length to at least "
                f"{max(needed)} (evaluation examples are never dropped).")
        keep = [i for i, n in enumerate(needed) if n <= p.max_length]
        self.num_dropped = len(pairs) - len(keep)
        if self.num_dropped:
            logging.warning("Dropped %d of %d train examples longer than max_length=%d (the longest needs %d).",
                            self.num_dropped, len(pairs), p.max_length, max(needed))
        self.num_examples = len(keep)
        if self.num_examples < p.batch_size:
            raise ConfigError(f"the {p.split} split has {self.num_examples} examples that fit max_length="
                              f"{p.max_length}, fewer than batch_size={p.batch_size}: raise max_number or "
                              "pairs_per_number, or lower batch_size")
        self._references = [(sources[i], targets[i], pairs[i][1]) for i in keep]
        length = p.max_length
        src = np.zeros([len(keep), length], np.int32)
        tgt_in = np.zeros([len(keep), length], np.int32)
        tgt_out = np.zeros([len(keep), length], np.int32)
        for row, i in enumerate(keep):
            s, t = src_ids[i], tgt_ids[i]
            src[row, :len(s)] = s
            tgt_in[row, :len(t) + 1] = [self.vocab.bos_id] + t
            tgt_out[row, :len(t) + 1] = t + [self.vocab.eos_id]
        self._arrays = {
            "src_ids": src, "tgt_in_ids": tgt_in, "tgt_out_ids": tgt_out,
            "src_lengths": np.array([len(src_ids[i]) for i in keep], np.int32),
            "tgt_lengths": np.array([len(tgt_ids[i]) + 1 for i in keep], np.int32),
            "tgt_lang": np.array([pairs[i][1] for i in keep], object),
        }

    def _num_finite_examples(self) -> int:
        return min(self.p.num_batches, self.num_examples // self.p.batch_size) * self.p.batch_size

    def references(self) -> list[tuple[str, str, str]]:
        """(tagged source text, target text, target language) per example, in the order batches yield them.

        With num_batches set, row j of batch b is entry b * batch_size + j. Without (training), batches are
        shuffled, and this lists every example in the corpus's order.
        """
        if self.p.num_batches is None:
            return list(self._references)
        return self._references[:self._num_finite_examples()]

    def _gather(self, indices: tf.Tensor) -> dict[str, tf.Tensor]:
        # Batches are gathered by index from constant arrays, so iterator checkpoints store positions only, never
        # examples (a shuffle buffer of examples would be saved in every checkpoint).
        rows = {name: tf.gather(tf.constant(array), indices) for name, array in self._arrays.items()}
        positions = tf.range(self.p.max_length)[tf.newaxis, :]
        return {
            "src_ids": rows["src_ids"],
            "src_paddings": tf.cast(positions >= rows["src_lengths"][:, tf.newaxis], tf.float32),
            "tgt_in_ids": rows["tgt_in_ids"],
            "tgt_out_ids": rows["tgt_out_ids"],
            "tgt_paddings": tf.cast(positions >= rows["tgt_lengths"][:, tf.newaxis], tf.float32),
            "tgt_lang": rows["tgt_lang"],
        }

    def dataset(self) -> tf.data.Dataset:
        """The batches; see the class doc string."""
        p = self.p
        size = self.num_examples
        if p.num_batches is None:
            seed = tf.constant(p.seed, tf.int64)

            def epoch_order(epoch: tf.Tensor) -> tf.data.Dataset:
                order = tf.random.experimental.stateless_shuffle(tf.range(size, dtype=tf.int64),
                                                                 seed=tf.stack([seed, epoch]))
                return tf.data.Dataset.from_tensor_slices(order)

            # Batching across epoch boundaries drops no example; each epoch is a fresh permutation.
            indices = tf.data.Dataset.counter().flat_map(epoch_order)
        else:
            indices = tf.data.Dataset.range(self._num_finite_examples())
        ds = indices.batch(p.batch_size, drop_remainder=True).map(self._gather)
        options = tf.data.Options()
        options.deterministic = True
        return ds.prefetch(1).with_options(options)
