"""What every text input shares: a learned SentencePiece vocabulary, and text turned into bounded-shape id batches.

Translation inputs (tagged sentence pairs) and language-model inputs (single sentences) differ in the batch
dict they give their task, but not in how they get a vocabulary (learned once from their train split, cached in
vocab_dir, see vocabulary.load_or_train) nor in how ids become batches whose shapes the train step can be traced
for once per shape:

* an in-memory corpus (the spelled-out numbers) is padded to one fixed length and gathered by index from
  constant arrays (`indexed_batches`), so an iterator checkpoint holds positions only;
* a streamed corpus (TFDS) is encoded a few hundred sentences per SentencePiece call (`encode_padded`) and
  bucketed by length (`bucket_batches`): batches of one bucket each, padded to the bucket's length, so there are
  only len(bucket_lengths) shapes.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs.base_input import BaseInput
from gpipe_tf.inputs.language_pairs import language_tag
from gpipe_tf.inputs.vocabulary import Vocabulary, load_or_train

__all__ = ["TextInput", "ENCODE_BATCH", "normalize", "define_streaming_params", "default_bucket_lengths",
           "check_bucket_lengths", "encode_padded", "bucket_batches", "indexed_batches", "finish"]

# The shortest bucket of the default bucket_lengths; each next one doubles up to max_length.
_SHORTEST_BUCKET = 8
# Sentences per SentencePiece call in tf.data: one call per sentence would cost more in Python than the encoding.
ENCODE_BATCH = 256


class TextInput(BaseInput):
    """Base class of inputs that encode text with a SentencePiece vocabulary; subclasses set `self.vocab`."""

    vocab: Vocabulary

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: BaseInput's, plus the vocabulary's."""
        p = super().params()
        p.define("vocab_model", None, "Path of a SentencePiece .model to use; None trains one into vocab_dir "
                 "from the train split's text (or reuses the one an identical setting trained there).")
        p.define("vocab_dir", None, "Where to train the vocabulary when vocab_model is None, e.g. the logdir "
                 "(unused when vocab_model is set).")
        p.define("vocab_size", 1000, "Ids in a trained vocabulary (special ids and language tags included).")
        p.define("vocab_max_sentences", 200_000, "At most this many train sentences train the vocabulary "
                 "(None = all); bounds its training time. Which ones: see the input's doc.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        if self.p.vocab_model is None and self.p.vocab_dir is None:
            raise ParamsError("set vocab_model (a trained SentencePiece .model) or vocab_dir (where to train one, "
                              "e.g. the logdir); both are None")

    def _load_vocabulary(self, name: str, setting: object, texts: Callable[[], list[str]],
                         languages: Sequence[str] = ()) -> Vocabulary:
        """vocab_model, or the vocabulary learned from `texts()` with a `<2xx>` tag per language; see
        vocabulary.load_or_train for `name` and `setting`."""
        p = self.p
        return load_or_train(p.vocab_model, p.vocab_dir, name, setting, texts, p.vocab_size,
                             [language_tag(lang) for lang in languages], p.vocab_max_sentences)


def normalize(text: str) -> str:
    """Unicode NFC (an accent is one code point) and single spaces, no outer spaces; case is kept."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def define_streaming_params(p: InstantiableParams, padded: str, examples: str) -> InstantiableParams:
    """Defines max_length, bucket_lengths and shuffle_buffer of a streamed, bucketed text input; returns p.

    `padded` says what max_length bounds, `examples` what one example is (in the plural).
    """
    p.define("max_length", 128, f"Longest padded length {padded}; longer {examples} are dropped.")
    p.define("bucket_lengths", None, "Ascending padded lengths, the last = max_length; None = 8, 16, 32, ... "
             "then max_length. (max_length,) gives one shape.")
    p.define("shuffle_buffer", 10_000, f"{examples.capitalize()} (text) in the training shuffle buffer; <= 1 "
             "disables it. Checkpointed iterators store the whole buffer.")
    return p


def default_bucket_lengths(max_length: int) -> tuple[int, ...]:
    """8, 16, 32, ... below max_length, then max_length: about log2(max_length) shapes, padding <= 2x."""
    lengths = []
    length = _SHORTEST_BUCKET
    while length < max_length:
        lengths.append(length)
        length *= 2
    return (*lengths, max_length)


def check_bucket_lengths(max_length: int, bucket_lengths: Sequence[int] | None) -> tuple[int, ...]:
    """`bucket_lengths` (None: the defaults for max_length) if they are distinct, ascending, >= 2 and end with
    max_length; else raises ParamsError."""
    lengths = tuple(bucket_lengths) if bucket_lengths is not None else default_bucket_lengths(max_length)
    if list(lengths) != sorted(set(lengths)) or lengths[0] < 2 or lengths[-1] != max_length:
        raise ParamsError(f"bucket_lengths={lengths} must be distinct ascending lengths >= 2 ending with "
                          f"max_length={max_length}")
    return lengths


def encode_padded(vocab: Vocabulary, texts: Sequence[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n, width], lengths int32 [n]) of `texts`: each row's ids cut to `width` and 0-padded.

    A length is the full count of ids, so a caller sees which rows were cut (length > width) and drops them.
    """
    ids = vocab.encode_batch(texts)
    padded = np.zeros([len(ids), width], np.int32)
    for row, seq in enumerate(ids):
        padded[row, :min(len(seq), width)] = seq[:width]
    return padded, np.array([len(seq) for seq in ids], np.int32)


def bucket_batches(ds: tf.data.Dataset, length_fn: Callable[[dict[str, tf.Tensor]], tf.Tensor],
                   bucket_lengths: Sequence[int], batch_size: int) -> tf.data.Dataset:
    """Batches of `batch_size` examples of one bucket each, every sequence padded with 0 to the bucket's length.

    An example goes to the shortest of `bucket_lengths` >= length_fn(example); longer ones must be filtered out
    before. Each bucket's last partial batch is dropped, and the batch dimension is static.
    """
    # Boundaries are exclusive upper ends, and pad_to_bucket_boundary pads to boundary - 1: the bucket length.
    boundaries = [length + 1 for length in bucket_lengths]
    ds = ds.bucket_by_sequence_length(length_fn, boundaries, [batch_size] * (len(boundaries) + 1),
                                      pad_to_bucket_boundary=True, drop_remainder=True)
    # Static batch size: bucket_by_sequence_length cannot know that drop_remainder makes every batch full.
    return ds.map(lambda batch: {name: tf.ensure_shape(value, [batch_size] + [None] * (value.shape.rank - 1))
                                 for name, value in batch.items()})


def indexed_batches(num_examples: int, batch_size: int, seed: int, num_batches: int | None,
                    gather: Callable[[tf.Tensor], dict[str, tf.Tensor]]) -> tf.data.Dataset:
    """Batches `gather(indices)` of `batch_size` example indices in [0, num_examples), drop-remainder.

    num_batches=None repeats forever, every epoch a fresh stateless permutation seeded by (seed, epoch), batching
    across epoch boundaries (no example is dropped); an int gives the first `num_batches` batches in index order.
    Only positions are state, so an iterator checkpoint never stores examples.
    """
    if num_batches is None:
        seed_tensor = tf.constant(seed, tf.int64)

        def epoch_order(epoch: tf.Tensor) -> tf.data.Dataset:
            order = tf.random.experimental.stateless_shuffle(tf.range(num_examples, dtype=tf.int64),
                                                             seed=tf.stack([seed_tensor, epoch]))
            return tf.data.Dataset.from_tensor_slices(order)

        indices = tf.data.Dataset.counter().flat_map(epoch_order)
    else:
        indices = tf.data.Dataset.range(min(num_batches, num_examples // batch_size) * batch_size)
    return finish(indices.batch(batch_size, drop_remainder=True).map(gather), prefetch=1)


def finish(ds: tf.data.Dataset, prefetch: int = tf.data.AUTOTUNE) -> tf.data.Dataset:
    """`ds` prefetched, with deterministic element order (the same seed always gives the same batches)."""
    options = tf.data.Options()
    options.deterministic = True
    return ds.prefetch(prefetch).with_options(options)
