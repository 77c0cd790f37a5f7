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

import numpy as np
import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs import numbers_corpus
from gpipe_tf.inputs.numbers_input import NumbersCorpusInput
from gpipe_tf.inputs.translation_base import TranslationInput


class NumbersTranslationInput(NumbersCorpusInput, TranslationInput):
    """Batches of number translations with a static batch dimension (the last partial batch is dropped).

    Batches are TranslationInput's, with S = T = max_length. The vocabulary learns from a deterministic
    subsample of the train split's sentences. num_batches=None repeats forever, reshuffled
    every epoch; an int gives that many batches (fewer if the split is smaller) in the corpus's order, matching
    `references()`.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: NumbersCorpusInput's, 4 directions per number among all language pairs."""
        p = super().params()
        p.define("pairs_per_number", 4, "Examples per number, each in a different (source, target) direction.")
        p.define("directions", "many_to_many", f"Language directions: one of {numbers_corpus.DIRECTIONS}.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        if p.directions not in numbers_corpus.DIRECTIONS:
            raise ParamsError(f"directions={p.directions!r} must be one of {numbers_corpus.DIRECTIONS}")
        numbers = self.splits[p.split]
        try:
            pairs = numbers_corpus.make_pairs(numbers, p.languages, p.corpus_seed, p.pairs_per_number,
                                              p.directions)
        except ValueError as e:
            raise ParamsError(str(e)) from None
        self._encode(pairs, [n for n in numbers for _ in range(p.pairs_per_number)])

    def _encode(self, pairs: list[tuple[str, str, str, str]], numbers: list[int]) -> None:
        p = self.p
        sources = [numbers_corpus.tagged_source(tgt_lang, src_text) for _, tgt_lang, src_text, _ in pairs]
        targets = [tgt_text for _, _, _, tgt_text in pairs]
        src_ids = self.vocab.encode_batch(sources)
        tgt_ids = self.vocab.encode_batch(targets)
        # A target takes one more position than its tokens: bos in tgt_in_ids, eos in tgt_out_ids.
        needed = [max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids)]
        keep = self._keep_fitting(needed, lambda i: (
            f"number {numbers[i]}, {pairs[i][0]}->{pairs[i][1]}: {sources[i]!r} -> {targets[i]!r}, "
            f"{len(src_ids[i])} source tokens, {len(tgt_ids[i])} target tokens + bos/eos"))
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

    def references(self) -> list[tuple[str, str, str]]:
        """(tagged source text, target text, target language) per example, in the order batches yield them.

        With num_batches set, row j of batch b is entry b * batch_size + j. Without (training), batches are
        shuffled, and this lists every example in the corpus's order.
        """
        return self._in_batch_order(self._references)

    def _length_paddings(self, lengths: tf.Tensor) -> tf.Tensor:
        """float32 [B, max_length]: 1.0 at positions >= each row's length."""
        positions = tf.range(self.p.max_length)[tf.newaxis, :]
        return tf.cast(positions >= lengths[:, tf.newaxis], tf.float32)

    def _batch(self, rows: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return {
            "src_ids": rows["src_ids"],
            "src_paddings": self._length_paddings(rows["src_lengths"]),
            "tgt_in_ids": rows["tgt_in_ids"],
            "tgt_out_ids": rows["tgt_out_ids"],
            "tgt_paddings": self._length_paddings(rows["tgt_lengths"]),
            "tgt_lang": rows["tgt_lang"],
        }
