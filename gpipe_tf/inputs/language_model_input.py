"""Language-model batches (next-token prediction over single sentences), and the offline numbers-corpus source.

Every language-model input gives ClassifierTask one label per position and weights that ignore padding, so a
per-position softmax over the vocabulary trains on it unchanged. Padding only follows the tokens: a causal model
(TransformerEncoderLayer causal=True) needs no attention mask, as no real position ever attends to a padded one.
The TFDS source (lm1b and other TFDS text) is tfds_language_model.TfdsLanguageModelInput.

NumbersLanguageModelInput: each example is one number of the split spelled out in one language and tagged with
it ("<2fr> vingt et un"), every number in every language, listed number by number. The tag tells the model which
language to continue in (its own label is a guess among the languages). Corpus, split by number, vocabulary and
shapes are the numbers translation input's (see numbers_input): with equal settings both share one vocabulary.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.inputs import numbers_corpus
from gpipe_tf.inputs.numbers_input import NumbersCorpusInput
from gpipe_tf.inputs.text_base import TextInput

__all__ = ["LanguageModelInput", "NumbersLanguageModelInput"]


class LanguageModelInput(TextInput):
    """Base class of language-model inputs.

    Every batch is a dict of
      'inputs'   int32 [B, T]  bos, then the sentence's n ids, then pad 0;
      'labels'   int32 [B, T]  the sentence's n ids, then eos (inputs shifted left by one), then pad 0;
      'weights'  float32 [B, T]  1.0 at the n + 1 real label positions, 0.0 on padding;
    with a static batch size B and T <= `max_length`. Subclasses set `self.vocab` (see `_load_vocabulary`).
    """

    def _next_token_batch(self, inputs: tf.Tensor, labels: tf.Tensor) -> dict[str, tf.Tensor]:
        """The batch dict of padded `inputs` and `labels`: real tokens never have the pad id, so weights are 1.0
        exactly where labels are not pad (every sentence's labels end with eos)."""
        return {"inputs": inputs, "labels": labels,
                "weights": tf.cast(tf.not_equal(labels, self.vocab.pad_id), tf.float32)}


class NumbersLanguageModelInput(NumbersCorpusInput, LanguageModelInput):
    """Tagged spelled-out numbers as next-token batches of T = max_length (see the module doc).

    Params: NumbersCorpusInput's (10 languages, numbers below 10,000, 1,000 ids, length 16). num_batches=None
    repeats forever, reshuffled every epoch; an int gives that many batches (fewer if the split is smaller) in
    corpus order, matching `sentences()`.
    """

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        numbers = [n for n in self.splits[p.split] for _ in p.languages]
        languages = [lang for _ in self.splits[p.split] for lang in p.languages]
        sentences = [numbers_corpus.tagged_source(lang, numbers_corpus.spell(n, lang))
                     for n, lang in zip(numbers, languages)]
        ids = self.vocab.encode_batch(sentences)
        # bos or eos takes one more position than the tokens.
        keep = self._keep_fitting([len(seq) + 1 for seq in ids], lambda i: (
            f"number {numbers[i]} in {languages[i]}: {sentences[i]!r}, {len(ids[i])} tokens + bos/eos"))
        self._sentences = [sentences[i] for i in keep]
        inputs = np.zeros([len(keep), p.max_length], np.int32)
        labels = np.zeros([len(keep), p.max_length], np.int32)
        for row, i in enumerate(keep):
            inputs[row, :len(ids[i]) + 1] = [self.vocab.bos_id] + ids[i]
            labels[row, :len(ids[i]) + 1] = ids[i] + [self.vocab.eos_id]
        self._arrays = {"inputs": inputs, "labels": labels}

    def sentences(self) -> list[str]:
        """The tagged sentence of each example, in the order batches yield them.

        With num_batches set, row j of batch b is entry b * batch_size + j. Without (training), batches are
        shuffled, and this lists every example in the corpus's order.
        """
        return self._in_batch_order(self._sentences)

    def _batch(self, rows: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return self._next_token_batch(rows["inputs"], rows["labels"])
