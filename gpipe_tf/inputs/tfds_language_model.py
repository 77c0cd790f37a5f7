"""Language-model batches from a TFDS text dataset: the One Billion Word benchmark (`lm1b`) by default.

An example is one text of the dataset's `text_feature` (lm1b: one sentence of news, already tokenized); it becomes
LanguageModelInput's next-token example (bos + ids -> ids + eos). Any TFDS dataset with a Text feature works the
same way (e.g. wiki40b/en, whose texts are whole articles: raise max_length).

Shapes, text and vocabulary follow the TFDS translation input (and share its code, see text_base):
* a sentence needing n positions (its tokens + bos/eos) goes to the shortest of `bucket_lengths` >= n and is
  padded to it; longer sentences and empty ones are dropped; batches hold one bucket, so the train step is
  traced once per bucket;
* text is NFC-normalized with single spaces, case kept, and encoded a few hundred sentences per SentencePiece
  call in tf.data with a vocabulary learned from the first `vocab_max_sentences` texts of the train split (TFDS
  shuffles examples when it prepares them, so those are a sample) and cached in vocab_dir.

Splits: lm1b has only 'train' and 'test' (the benchmark's held-out set); slices such as 'test[:50%]' make a dev
set. Determinism and checkpoints are the translation input's: seeded file order and shuffle buffer, and a
checkpointed iterator stores the shuffle buffer (text) and each bucket's partial batch.

The dataset must already be prepared in `data_dir` (`tfds build lm1b --data_dir=DIR` where there is internet);
a missing one raises DatasetNotPreparedError at construction, saying how to prepare it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs.language_model_input import LanguageModelInput
from gpipe_tf.inputs.text_base import (
    ENCODE_BATCH,
    bucket_batches,
    check_bucket_lengths,
    define_streaming_params,
    encode_padded,
    finish,
    normalize,
)
from gpipe_tf.inputs.tfds_prepare import ensure_prepared, num_split_examples, prepare_hint, tfds_builder

__all__ = ["TfdsLanguageModelInput", "LM1B"]

LM1B = "lm1b"

# Part of the cached vocabulary's name: bump it when the training text changes for the same setting.
_VOCAB_FORMAT = 1


class TfdsLanguageModelInput(LanguageModelInput):
    """Next-token batches from a TFDS text dataset, bucketed by length (see the module doc).

    Batches are LanguageModelInput's, with B = batch_size and T = one of bucket_lengths. num_batches=None trains:
    files and sentences are shuffled and the split repeats forever. An int reads the split once in file order and
    gives at most that many batches (each bucket's last partial batch is dropped).
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: lm1b, a 32k vocabulary, sentences of up to 127 tokens."""
        p = super().params()
        p.define("dataset", LM1B, "TFDS dataset (or 'name/config') with a Text feature.")
        p.define("text_feature", "text", "Name of the dataset's Text feature that holds the sentences.")
        p.define("split", "train", "TFDS split: lm1b has 'train' and 'test'; slices such as 'test[:50%]' work.")
        p.define("data_dir", None, "TFDS data_dir holding the prepared dataset; None = TFDS's default.")
        p.define("download", False, "Let TFDS download (and prepare) a missing dataset; needs internet.")
        define_streaming_params(p, "T (the sentence's tokens + bos/eos)", "sentences")
        return p.set(vocab_size=32000, vocab_max_sentences=1_000_000)

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        if p.max_length < 2:
            raise ParamsError(f"max_length={p.max_length} must be >= 2 (bos or eos and a token)")
        self.bucket_lengths = check_bucket_lengths(p.max_length, p.bucket_lengths)
        self._builder = tfds_builder(p.dataset, p.data_dir)
        ensure_prepared(self._builder, p.data_dir, p.download, prepare_hint(p.dataset, p.data_dir))
        self.num_source_examples = num_split_examples(self._builder, p.dataset, p.split)
        features = self._builder.info.features
        if p.text_feature not in features or not isinstance(features[p.text_feature], tfds.features.Text):
            raise ParamsError(f"dataset={p.dataset!r} has no Text feature {p.text_feature!r}; its features: "
                              f"{list(features.keys())}")
        train = self._builder.info.splits["train"]
        setting = (_VOCAB_FORMAT, self._builder.info.full_name, train.num_examples, train.num_bytes, p.text_feature)
        self.vocab = self._load_vocabulary(self._builder.name, setting, self._vocab_texts)

    def _texts(self, split: str, training: bool) -> tf.data.Dataset:
        """The split's texts (tf.string scalars), files shuffled by seed when training."""
        p = self.p
        read_config = tfds.ReadConfig(shuffle_seed=p.seed, shuffle_reshuffle_each_iteration=True,
                                      try_autocache=False)  # an in-memory cache would bloat iterator checkpoints
        ds = self._builder.as_dataset(split=split, shuffle_files=training, read_config=read_config)
        return ds.map(lambda example: example[p.text_feature])

    def _vocab_texts(self) -> list[str]:
        ds = self._texts("train", training=False)
        if self.p.vocab_max_sentences is not None:
            ds = ds.take(self.p.vocab_max_sentences)
        return [normalize(text.decode("utf-8")) for batch in ds.batch(4096).as_numpy_iterator() for text in batch]

    def _encode_numpy(self, texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Ids beyond max_length are never used: such a sentence needs max_length + 1 positions and is dropped.
        return encode_padded(self.vocab, [normalize(text.decode("utf-8")) for text in texts], self.p.max_length)

    def _encode(self, texts: tf.Tensor) -> dict[str, tf.Tensor]:
        ids, lengths = tf.numpy_function(self._encode_numpy, [texts], [tf.int32, tf.int32], stateful=False)
        return {"ids": tf.ensure_shape(ids, [None, self.p.max_length]), "length": tf.ensure_shape(lengths, [None])}

    def _fits(self, example: dict[str, tf.Tensor]) -> tf.Tensor:
        # An empty sentence would only teach eos; bos or eos takes one more position than the tokens.
        return (example["length"] >= 1) & (example["length"] + 1 <= self.p.max_length)

    def _to_example(self, example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        ids = example["ids"][:example["length"]]
        return {"inputs": tf.concat([[self.vocab.bos_id], ids], 0), "labels": tf.concat([ids, [self.vocab.eos_id]], 0)}

    def dataset(self) -> tf.data.Dataset:
        """The batches; see the class doc string."""
        p = self.p
        training = p.num_batches is None
        ds = self._texts(p.split, training)
        if training:
            ds = ds.repeat()
            if p.shuffle_buffer > 1:
                ds = ds.shuffle(p.shuffle_buffer, seed=p.seed, reshuffle_each_iteration=True)
        ds = ds.batch(ENCODE_BATCH).map(self._encode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.unbatch().filter(self._fits).map(self._to_example)
        ds = bucket_batches(ds, lambda ex: tf.shape(ex["inputs"])[0], self.bucket_lengths, p.batch_size)
        ds = ds.map(lambda batch: self._next_token_batch(batch["inputs"], batch["labels"]))
        if not training:
            ds = ds.take(p.num_batches)
        return finish(ds)
