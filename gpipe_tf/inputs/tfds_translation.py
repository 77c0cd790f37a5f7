"""Multilingual translation batches from TFDS: TED talks in 60 languages (`ted_multi_translate`) and WMT.

A `ted_multi_translate` example is one sentence of a TED talk with its translations into any of 60 languages
(a dict language -> text; most talks have 20-50 of them); a WMT example is one sentence pair of a fixed
language pair such as de-en. Each example becomes one translation per allowed direction among the chosen
`languages` that it holds ('to_from_english', 'many_to_many', ...: see language_pairs), and, as in the numbers
input, the source starts with the target-language tag ("<2fr> thank you" -> "merci"), so one model serves
every direction. The batches are NumbersTranslationInput's, so TranslationTask trains on them unchanged.

Shapes: an example needing n positions (its tagged source, or its target plus bos/eos) goes to the shortest of
`bucket_lengths` that is >= n and is padded to it, both source and target; examples longer than max_length are
dropped (from every split). Batches hold batch_size examples of one bucket, so there are only
len(bucket_lengths) shapes and the train step is traced that many times, not once per batch.

Text: each side is NFC-normalized with runs of whitespace made single spaces (nothing else: TED is already
tokenized and keeps its case), then encoded with a SentencePiece vocabulary learned from the first
`vocab_max_sentences` texts of the train split (TFDS shuffles examples when it prepares them, so those are a
sample of the whole split) and cached in vocab_dir under a name that hashes the setting (see
vocabulary.load_or_train). Encoding runs in tf.data, a few hundred sentences per SentencePiece call.

Determinism and checkpoints: file order, the shuffle buffer and the sampled directions are seeded from `seed`,
so the same seed gives the same batches. Unlike the numbers input, the data is streamed (TED has millions of
sentence pairs): a checkpointed iterator stores the shuffle buffer (text) and each bucket's partial batch.

The dataset must already be prepared in `data_dir` (this project's machines have no internet); a missing one
raises `DatasetNotPreparedError` at construction, saying how to prepare it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.translate import wmt

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs import language_pairs
from gpipe_tf.inputs.text_base import (
    ENCODE_BATCH,
    bucket_batches,
    check_bucket_lengths,
    default_bucket_lengths,
    define_streaming_params,
    encode_padded,
    finish,
    normalize,
)
from gpipe_tf.inputs.tfds_prepare import ensure_prepared, num_split_examples, prepare_hint, tfds_builder
from gpipe_tf.inputs.translation_base import TranslationInput

__all__ = ["TfdsTranslationInput", "TED_MULTI", "dataset_builder", "default_bucket_lengths", "normalize"]

TED_MULTI = "ted_multi_translate"
_CUSTOM_WMT = "wmt_translate"

# Part of the cached vocabulary's name: bump it when the training text changes for the same setting.
_VOCAB_FORMAT = 1


def _custom_wmt_builder(dataset: str, subsets: dict[str, list[str]],
                        data_dir: str | None) -> tfds.core.DatasetBuilder:
    family, _, pair = dataset.partition("/")
    languages = pair.split("-")
    if family != _CUSTOM_WMT or len(languages) != 2 or not all(languages):
        raise ParamsError(f"wmt_subsets needs dataset='{_CUSTOM_WMT}/<xx>-<yy>' (e.g. '{_CUSTOM_WMT}/de-en'), "
                          f"got {dataset!r}")
    unknown = sorted({name for names in subsets.values() for name in names} - set(wmt.DATASET_MAP))
    if unknown or not subsets:
        raise ParamsError(f"wmt_subsets={subsets!r}: unknown WMT sub-datasets {unknown}; choose from "
                          "tfds.translate.wmt.DATASET_MAP, e.g. 'newscommentary_v9', 'newstest2013'")
    # The config name (and so the prepared folder) is fixed by the subsets: equal settings share the data.
    digest = hashlib.sha256(repr(sorted((k, list(v)) for k, v in subsets.items())).encode("utf-8")).hexdigest()
    config = wmt.WmtConfig(language_pair=tuple(languages), subsets={k: list(v) for k, v in subsets.items()},
                           version="1.0.0", name=f"subsets_{digest[:8]}",
                           description=f"WMT {pair} from the sub-datasets {subsets}")
    return tfds.builder(_CUSTOM_WMT, config=config, data_dir=data_dir)


def dataset_builder(params: InstantiableParams) -> tfds.core.DatasetBuilder:
    """The TFDS builder that a TfdsTranslationInput with these Params reads, prepared or not.

    `dataset_builder(p).download_and_prepare()` prepares the data where the network is reachable; this is how
    to prepare a custom WMT config (`wmt_subsets`), which `tfds build` cannot name.
    """
    p = params
    if p.wmt_subsets is not None:
        return _custom_wmt_builder(p.dataset, dict(p.wmt_subsets), p.data_dir)
    return tfds_builder(p.dataset, p.data_dir)


class TfdsTranslationInput(TranslationInput):
    """Translation batches from a TFDS translation dataset, bucketed by length (see the module doc).

    Batches are TranslationInput's, with B = batch_size and S = T = one of bucket_lengths. The vocabulary learns
    from the first vocab_max_sentences texts of the train split. num_batches=None trains: files and directions
    are shuffled and the split repeats forever. An int reads the split once in file order and gives at most
    that many batches (each bucket's last partial batch is dropped), matching `references()`.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: TED talks to and from English in all of TED's languages, 32k ids, up to 128 tokens."""
        p = super().params()
        p.define("dataset", TED_MULTI, f"TFDS dataset: {TED_MULTI!r}, a WMT config such as "
                 f"'wmt14_translate/de-en', or '{_CUSTOM_WMT}/<xx>-<yy>' with wmt_subsets.")
        p.define("wmt_subsets", None, f"Only with dataset='{_CUSTOM_WMT}/<xx>-<yy>': {{split: [WMT sub-dataset "
                 "names]}, e.g. {'train': ['newscommentary_v9'], 'validation': ['newstest2013']} (names from "
                 "tfds.translate.wmt.DATASET_MAP); TFDS prepares it as config '<xx>-<yy>.subsets_<digest>'.")
        p.define("split", "train", "TFDS split: 'train', 'validation', 'test' or a slice such as 'train[:90%]'.")
        p.define("data_dir", None, "TFDS data_dir holding the prepared dataset; None = TFDS's default.")
        p.define("download", False, "Let TFDS download (and prepare) a missing dataset; needs internet.")
        p.define("languages", None, "Language codes to translate between, in tag order (TED's own codes, e.g. "
                 "'pt-br', 'zh-cn'); None = all of the dataset's languages.")
        p.define("directions", "to_from_english", f"Which directions among `languages`: one of "
                 f"{language_pairs.DIRECTIONS}.")
        p.define("pairs_per_example", None, "Directions per multilingual example (per TED sentence), sampled "
                 "without replacement, anew each epoch when training; None = every allowed direction it holds.")
        define_streaming_params(p, "L of source and target (target + bos/eos)", "sentence pairs")
        return p.set(vocab_size=32000, vocab_max_sentences=1_000_000)

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        self.bucket_lengths = self._check_lengths()
        if p.pairs_per_example is not None and p.pairs_per_example < 1:
            raise ParamsError(f"pairs_per_example={p.pairs_per_example} must be >= 1 or None (every direction)")
        self._builder = dataset_builder(p)
        hint = prepare_hint(p.dataset, p.data_dir)
        if p.wmt_subsets is not None:
            # `tfds build` cannot name a custom config.
            hint = ("On a machine with internet, run tfds_translation.dataset_builder(p).download_and_prepare() "
                    f"with these Params p (or set download=True there) and copy the '{_CUSTOM_WMT}' folder of "
                    "its data_dir here.")
        ensure_prepared(self._builder, p.data_dir, p.download, hint)
        self.num_source_examples = num_split_examples(self._builder, p.dataset, p.split)
        self.dataset_languages, self._variable_languages = self._feature_languages()
        self.languages = tuple(p.languages) if p.languages is not None else self.dataset_languages
        unknown = sorted(set(self.languages) - set(self.dataset_languages))
        if unknown or len(set(self.languages)) != len(self.languages) or len(self.languages) < 2:
            raise ParamsError(f"languages={list(self.languages)} must be at least 2 distinct codes of {p.dataset} "
                              f"({list(self.dataset_languages)}); unknown: {unknown}")
        try:
            self.directions = language_pairs.directions(self.languages, p.directions)
        except ValueError as e:
            raise ParamsError(str(e)) from None
        index = {lang: i for i, lang in enumerate(self.languages)}
        self._allowed = np.zeros([len(self.languages)] * 2, bool)  # [source, target] position in `languages`
        for source, target in self.directions:
            self._allowed[index[source], index[target]] = True
        train = self._builder.info.splits["train"]
        setting = (_VOCAB_FORMAT, self._builder.info.full_name, train.num_examples, train.num_bytes,
                   list(self.languages))
        self.vocab = self._load_vocabulary(self._builder.name, setting, self._vocab_texts, self.languages)
        self._references: list[tuple[str, str, str]] | None = None

    def _check_lengths(self) -> tuple[int, ...]:
        p = self.p
        if p.max_length < 2:
            raise ParamsError(f"max_length={p.max_length} must be >= 2 (a target needs bos or eos and a token)")
        return check_bucket_lengths(p.max_length, p.bucket_lengths)

    def _feature_languages(self) -> tuple[tuple[str, ...], bool]:
        """The dataset's languages, and whether examples hold a variable set of them (TED) or all (WMT)."""
        features = self._builder.info.features
        translations = features["translations"] if "translations" in features else None
        if isinstance(translations, tfds.features.TranslationVariableLanguages):
            return tuple(translations.languages), True
        if isinstance(features, tfds.features.Translation):
            return tuple(features.languages), False
        raise ParamsError(f"dataset={self.p.dataset!r} is not a translation dataset (its features are neither "
                          "Translation nor TranslationVariableLanguages)")

    def _translations(self, example: dict[str, Any]) -> tuple[tf.Tensor, tf.Tensor]:
        """(language codes [n], texts [n]) of an example, only those in `languages`."""
        if self._variable_languages:
            langs, texts = example["translations"]["language"], example["translations"]["translation"]
        else:
            langs = tf.constant(self.dataset_languages)
            texts = tf.stack([example[lang] for lang in self.dataset_languages])
        known = tf.reduce_any(tf.equal(langs[:, tf.newaxis], tf.constant(self.languages)[tf.newaxis, :]), axis=1)
        return tf.boolean_mask(langs, known), tf.boolean_mask(texts, known)

    def _vocab_texts(self) -> list[str]:
        ds = self._builder.as_dataset(split="train", shuffle_files=False,
                                      read_config=tfds.ReadConfig(try_autocache=False))
        ds = ds.map(lambda ex: self._translations(ex)[1]).unbatch()
        if self.p.vocab_max_sentences is not None:
            ds = ds.take(self.p.vocab_max_sentences)
        return [normalize(text.decode("utf-8")) for batch in ds.batch(4096).as_numpy_iterator() for text in batch]

    def _pairs(self, index: tf.Tensor, example: dict[str, Any]) -> tf.data.Dataset:
        """One element per allowed direction the example holds: target language, source text, target text."""
        langs, texts = self._translations(example)
        positions = tf.argmax(tf.cast(tf.equal(langs[:, tf.newaxis], tf.constant(self.languages)[tf.newaxis, :]),
                                      tf.int32), axis=1)
        # [n, n]: may entry i translate into entry j? Then (i, j) rows in order (source-major).
        pairs = tf.where(tf.gather(tf.gather(tf.constant(self._allowed), positions), positions, axis=1))
        if self.p.pairs_per_example is not None:
            seed = tf.stack([tf.constant(self.p.seed, tf.int64), index])
            order = tf.random.experimental.stateless_shuffle(tf.range(tf.shape(pairs)[0]), seed=seed)
            pairs = tf.gather(pairs, order[:self.p.pairs_per_example])
        return tf.data.Dataset.from_tensor_slices({
            "tgt_lang": tf.gather(langs, pairs[:, 1]),
            "src_text": tf.gather(texts, pairs[:, 0]),
            "tgt_text": tf.gather(texts, pairs[:, 1]),
        })

    def _encode_numpy(self, tgt_langs: np.ndarray, src_texts: np.ndarray,
                      tgt_texts: np.ndarray) -> tuple[np.ndarray, ...]:
        sources = [language_pairs.tagged_source(lang.decode("utf-8"), normalize(text.decode("utf-8")))
                   for lang, text in zip(tgt_langs, src_texts)]
        targets = [normalize(text.decode("utf-8")) for text in tgt_texts]
        # Ids beyond max_length + 1 are never used: such an example is dropped, and its length says so.
        width = self.p.max_length + 1
        out: list[np.ndarray] = [np.array([s.encode("utf-8") for s in sources], object),
                                 np.array([t.encode("utf-8") for t in targets], object)]
        for texts in (sources, targets):
            out += encode_padded(self.vocab, texts, width)
        return tuple(out)

    def _encode(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        outputs = tf.numpy_function(self._encode_numpy, [batch["tgt_lang"], batch["src_text"], batch["tgt_text"]],
                                    [tf.string, tf.string, tf.int32, tf.int32, tf.int32, tf.int32], stateful=False)
        names = ("src_text", "tgt_text", "src_ids", "src_length", "tgt_ids", "tgt_length")
        encoded = dict(zip(names, outputs))
        for name in ("src_ids", "tgt_ids"):
            encoded[name] = tf.ensure_shape(encoded[name], [None, self.p.max_length + 1])
        for name in ("src_text", "tgt_text", "src_length", "tgt_length"):
            encoded[name] = tf.ensure_shape(encoded[name], [None])
        return dict(encoded, tgt_lang=batch["tgt_lang"])

    def _fits(self, example: dict[str, tf.Tensor]) -> tf.Tensor:
        # A target takes one more position than its tokens (bos in tgt_in_ids, eos in tgt_out_ids). A source is
        # at least its tag and one token; an empty target would teach the model to stop at once.
        src, tgt = example["src_length"], example["tgt_length"]
        return (src >= 2) & (src <= self.p.max_length) & (tgt >= 1) & (tgt + 1 <= self.p.max_length)

    def _to_example(self, example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        src = example["src_ids"][:example["src_length"]]
        tgt = example["tgt_ids"][:example["tgt_length"]]
        return {
            "src_ids": src,
            "tgt_in_ids": tf.concat([[self.vocab.bos_id], tgt], 0),
            "tgt_out_ids": tf.concat([tgt, [self.vocab.eos_id]], 0),
            "tgt_lang": example["tgt_lang"],
            "src_text": example["src_text"],
            "tgt_text": example["tgt_text"],
        }

    def _to_batch(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        out = dict(batch)
        # Real tokens never have the pad id, and every target row ends with eos, so padding is where ids are 0.
        out["src_paddings"] = tf.cast(tf.equal(out["src_ids"], self.vocab.pad_id), tf.float32)
        out["tgt_paddings"] = tf.cast(tf.equal(out["tgt_out_ids"], self.vocab.pad_id), tf.float32)
        return out

    def _batches(self, keep_text: bool) -> tf.data.Dataset:
        p = self.p
        training = p.num_batches is None
        read_config = tfds.ReadConfig(shuffle_seed=p.seed, shuffle_reshuffle_each_iteration=True,
                                      try_autocache=False)  # an in-memory cache would bloat iterator checkpoints
        ds = self._builder.as_dataset(split=p.split, shuffle_files=training, read_config=read_config)
        if training:
            ds = ds.repeat()
        # Counting after repeat samples each epoch's directions anew.
        ds = ds.enumerate().flat_map(self._pairs)
        if training and p.shuffle_buffer > 1:
            # Before encoding: the buffer holds text, and neighbouring pairs (one TED sentence) get mixed.
            ds = ds.shuffle(p.shuffle_buffer, seed=p.seed, reshuffle_each_iteration=True)
        ds = ds.batch(ENCODE_BATCH).map(self._encode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.unbatch().filter(self._fits).map(self._to_example)
        if not keep_text:
            ds = ds.map(lambda ex: {k: v for k, v in ex.items() if not k.endswith("_text")})
        ds = bucket_batches(ds, lambda ex: tf.maximum(tf.shape(ex["src_ids"])[0], tf.shape(ex["tgt_in_ids"])[0]),
                            self.bucket_lengths, p.batch_size)
        ds = ds.map(self._to_batch)
        if not training:
            ds = ds.take(p.num_batches)
        return finish(ds)

    def dataset(self) -> tf.data.Dataset:
        """The batches; see the class doc string."""
        return self._batches(keep_text=False)

    def references(self) -> list[tuple[str, str, str]]:
        """(tagged source text, target text, target language) per example, in the order batches yield them.

        Row j of batch b is entry b * batch_size + j. Only for evaluation inputs (num_batches set); the texts are
        normalized as the model sees them, so decode(ids) of a batch row gives them back. Read once, then cached.
        """
        if self.p.num_batches is None:
            raise ConfigError("references() needs an evaluation input (num_batches set); this one repeats forever")
        if self._references is None:
            self._references = [
                (src.decode("utf-8"), tgt.decode("utf-8"), lang.decode("utf-8"))
                for batch in self._batches(keep_text=True).as_numpy_iterator()
                for src, tgt, lang in zip(batch["src_text"], batch["tgt_text"], batch["tgt_lang"])]
        return list(self._references)
