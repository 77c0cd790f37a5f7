"""Language-model inputs: the offline numbers corpus, and TFDS lm1b through its real builder on tiny fake files."""


import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.inputs import numbers_corpus
from gpipe_tf.inputs.language_model_input import NumbersLanguageModelInput
from gpipe_tf.inputs.text_base import normalize
from gpipe_tf.inputs.tfds_language_model import TfdsLanguageModelInput
from gpipe_tf.inputs.tfds_prepare import DatasetNotPreparedError
from gpipe_tf.inputs.translation_input import NumbersTranslationInput
from tests.helpers import fake_tfds_text, guards

BATCH_KEYS = {"inputs", "labels", "weights"}
MAX_NUMBER = 600
VOCAB_SIZE = 300


def take(dataset, count):
    """The first `count` batches of `dataset` as dicts of numpy arrays."""
    return [{k: v.numpy() for k, v in batch.items()} for batch in dataset.take(count)]


def check_next_token_batch(batch, vocab, batch_size):
    """The LanguageModelInput contract: bos + ids -> ids + eos, weights 1.0 exactly on the real labels."""
    assert set(batch) == BATCH_KEYS and batch["inputs"].shape == batch["labels"].shape == batch["weights"].shape
    assert batch["inputs"].shape[0] == batch_size and batch["inputs"].dtype == batch["labels"].dtype == np.int32
    for inputs, labels, weights in zip(batch["inputs"], batch["labels"], batch["weights"]):
        n = int(weights.sum())
        assert (weights[:n] == 1.0).all() and (weights[n:] == 0.0).all()
        assert inputs[0] == vocab.bos_id and labels[n - 1] == vocab.eos_id
        np.testing.assert_array_equal(inputs[1:n], labels[:n - 1])
        assert (inputs[n:] == vocab.pad_id).all() and (labels[n:] == vocab.pad_id).all()
        assert vocab.unk_id not in labels[:n] and vocab.pad_id not in labels[:n]


# ------------------------------------------------------------------------------------------------ numbers corpus

@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    """One vocab_dir shared by the numbers inputs of this module."""
    return str(tmp_path_factory.mktemp("numbers_vocab"))


def numbers_input(vocab_dir, **overrides):
    """A small NumbersLanguageModelInput."""
    p = NumbersLanguageModelInput.params().set(max_number=MAX_NUMBER, vocab_size=VOCAB_SIZE, vocab_dir=vocab_dir,
                                               batch_size=8)
    return p.set(**overrides).instantiate()


def test_numbers_eval_batches_are_the_tagged_sentences_of_the_split_in_order(vocab_dir):
    inp = numbers_input(vocab_dir, split="dev", num_batches=3)
    batches = take(inp.dataset(), 10)
    assert len(batches) == 3 and len(inp.sentences()) == 24
    dev = numbers_corpus.split_numbers(MAX_NUMBER, 1234)["dev"]
    # Number by number, each in every language, tagged with it.
    assert inp.sentences()[:12] == [numbers_corpus.tagged_source(lang, numbers_corpus.spell(n, lang))
                                    for n in dev[:2] for lang in numbers_corpus.LANGUAGES][:12]
    decoded = [inp.vocab.decode(row) for b in batches for row in b["labels"]]
    assert decoded == inp.sentences()
    for batch in batches:
        check_next_token_batch(batch, inp.vocab, 8)
        assert batch["inputs"].shape == (8, 16)
        tags = {inp.vocab.id_to_piece(i) for i in batch["labels"][:, 0]}
        assert tags <= {numbers_corpus.language_tag(lang) for lang in numbers_corpus.LANGUAGES}


def test_numbers_training_is_deterministic_reshuffled_and_shares_the_translation_vocabulary(vocab_dir):
    inp = numbers_input(vocab_dir)
    assert inp.num_examples == len(numbers_corpus.split_numbers(MAX_NUMBER, 1234)["train"]) * 10
    first = take(inp.dataset(), 20)
    again = take(numbers_input(vocab_dir).dataset(), 20)
    other = take(numbers_input(vocab_dir, seed=2).dataset(), 20)
    assert all((a["inputs"] == b["inputs"]).all() for a, b in zip(first, again))
    assert any((a["inputs"] != b["inputs"]).any() for a, b in zip(first, other))
    for batch in first:
        check_next_token_batch(batch, inp.vocab, 8)
    # The same corpus settings learn the same vocabulary: one cached file for translation and language modelling.
    translation = NumbersTranslationInput.params().set(max_number=MAX_NUMBER, vocab_size=VOCAB_SIZE,
                                                       vocab_dir=vocab_dir, batch_size=8).instantiate()
    assert translation.vocab.model_path == inp.vocab.model_path


def test_numbers_long_sentences_and_bad_params(vocab_dir):
    short = numbers_input(vocab_dir, max_length=4)
    assert short.num_dropped > 0 and all(len(short.vocab.encode(s)) + 1 <= 4 for s in short.sentences())
    with pytest.raises(ConfigError, match=r"(?s)example \d+ \(number \d+ in \w+.*at least \d+"):
        numbers_input(vocab_dir, split="test", max_length=4, num_batches=1)
    with pytest.raises(ParamsError, match="not supported by num2words"):
        numbers_input(vocab_dir, languages=["en", "xx"])
    with pytest.raises(ParamsError, match="max_length=1"):
        numbers_input(vocab_dir, max_length=1)


# ----------------------------------------------------------------------------------------------------------- lm1b

@pytest.fixture(scope="module")
def lm1b(tmp_path_factory):
    """(data_dir, vocab_dir, corpus) with fake lm1b prepared by the real builder: 40 train, 12 test sentences."""
    root = tmp_path_factory.mktemp("lm1b")
    corpus = fake_tfds_text.prepare_lm1b(str(root / "data"), str(root / "source"))
    return str(root / "data"), str(root / "vocab"), corpus


def lm1b_input(lm1b, **overrides):
    """A small TfdsLanguageModelInput on the fake lm1b."""
    data_dir, vocab_dir, _ = lm1b
    settings = dict(data_dir=data_dir, vocab_dir=vocab_dir, vocab_size=100, max_length=32, batch_size=1,
                    num_batches=1000, split="test")
    settings.update(overrides)
    return TfdsLanguageModelInput.params().set(**settings).instantiate()


def test_lm1b_eval_gives_every_nonempty_sentence_normalized(lm1b):
    inp = lm1b_input(lm1b)
    assert inp.num_source_examples == 12 and inp.vocab.size == 100
    batches = take(inp.dataset(), 1000)
    for batch in batches:
        check_next_token_batch(batch, inp.vocab, 1)
    decoded = sorted(inp.vocab.decode(b["labels"][0]) for b in batches)
    # The empty line is dropped; the double space is normalized away.
    assert decoded == sorted(normalize(s) for s in lm1b[2]["test"] if s)
    assert "They counted fifty votes ." in decoded
    halves = [lm1b_input(lm1b, split=split) for split in ("test[:50%]", "test[50%:]")]
    assert [h.num_source_examples for h in halves] == [6, 6]
    assert sum(len(take(h.dataset(), 100)) for h in halves) == len(batches)


def test_lm1b_training_batches_are_bucketed_and_deterministic(lm1b):
    def make(seed):
        return lm1b_input(lm1b, split="train", num_batches=None, batch_size=4, max_length=16, seed=seed,
                          shuffle_buffer=16)

    inp = make(1)
    assert inp.bucket_lengths == (8, 16)
    assert inp.dataset().element_spec["inputs"].shape.as_list() == [4, None]
    first = take(inp.dataset(), 30)  # several epochs of the 34 non-empty sentences
    assert {b["inputs"].shape for b in first} == {(4, 8), (4, 16)}
    for batch in first:
        check_next_token_batch(batch, inp.vocab, 4)
        # The bucket is the shortest that holds the batch's longest sentence.
        assert batch["inputs"].shape[1] == 8 or batch["weights"].sum(1).max() > 8
    traced = tf.function(lambda batch: tf.reduce_sum(batch["inputs"]), autograph=False)
    for batch in inp.dataset().take(30):
        traced(batch)
    assert traced.experimental_get_tracing_count() == 2  # once per bucket, not per batch
    assert all((a["inputs"] == b["inputs"]).all() for a, b in zip(first, take(make(1).dataset(), 30)))
    assert not all(a["inputs"].shape == b["inputs"].shape and (a["inputs"] == b["inputs"]).all()
                   for a, b in zip(first, take(make(2).dataset(), 30)))


def test_lm1b_errors_name_the_fix(lm1b, tmp_path, monkeypatch):
    guards.forbid_downloads(monkeypatch)
    with pytest.raises(DatasetNotPreparedError, match=f"'lm1b'.*tfds build lm1b --data_dir={tmp_path}"):
        TfdsLanguageModelInput.params().set(data_dir=str(tmp_path), vocab_dir=str(tmp_path)).instantiate()
    with pytest.raises(ParamsError, match="no Text feature 'sentence'.*'text'"):
        lm1b_input(lm1b, text_feature="sentence")
    with pytest.raises(ConfigError, match="bad split 'validation'"):
        lm1b_input(lm1b, split="validation")
    with pytest.raises(ParamsError, match="bucket_lengths"):
        lm1b_input(lm1b, bucket_lengths=(8, 12))
