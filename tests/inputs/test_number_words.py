"""The spelled-out numbers translation corpus, its SentencePiece vocabulary and the batches built from them."""

import collections
import os

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.inputs import numbers_corpus as corpus
from gpipe_tf.inputs.translation_input import NumbersTranslationInput
from gpipe_tf.inputs.vocabulary import Vocabulary

# Small enough to build in well under a second, big enough for every language and direction to appear.
MAX_NUMBER = 600
VOCAB_SIZE = 300
TAGS = [corpus.language_tag(lang) for lang in corpus.LANGUAGES]


@pytest.fixture(scope="module")
def splits():
    """The default split of [0, MAX_NUMBER) with seed 1234."""
    return corpus.split_numbers(MAX_NUMBER, 1234)


@pytest.fixture(scope="module")
def train_texts(splits):
    """Every train number in every language."""
    return [corpus.spell(n, lang) for lang in corpus.LANGUAGES for n in splits["train"]]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory, train_texts):
    """A vocabulary trained on the train texts."""
    return Vocabulary.train(train_texts, VOCAB_SIZE, str(tmp_path_factory.mktemp("vocab") / "spm"), TAGS)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    """One vocab_dir shared by the inputs of this module (so they train the vocabulary once)."""
    return str(tmp_path_factory.mktemp("inputs"))


def make_input(vocab_dir, **overrides):
    """A small NumbersTranslationInput."""
    p = NumbersTranslationInput.params().set(max_number=MAX_NUMBER, pairs_per_number=2, vocab_dir=vocab_dir,
                                             vocab_size=VOCAB_SIZE, batch_size=8)
    return p.set(**overrides).instantiate()


def take(iterator, count):
    """The next `count` batches as dicts of numpy arrays."""
    return [{k: v.numpy() for k, v in next(iterator).items()} for _ in range(count)]


def assert_same_batches(a, b):
    """Asserts two lists of numpy batches are equal, key by key."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


# ------------------------------------------------------------------------------------------------------ corpus

def test_splits_are_disjoint_cover_all_numbers_and_are_deterministic(splits):
    sets = {name: set(numbers) for name, numbers in splits.items()}
    assert set(splits) == {"train", "dev", "test"}
    assert not sets["train"] & sets["dev"] and not sets["train"] & sets["test"] and not sets["dev"] & sets["test"]
    assert sets["train"] | sets["dev"] | sets["test"] == set(range(MAX_NUMBER))
    assert all(numbers == sorted(numbers) for numbers in splits.values())
    assert 0.7 < len(splits["train"]) / MAX_NUMBER < 0.9 and len(splits["dev"]) > 30 and len(splits["test"]) > 30
    assert corpus.split_numbers(MAX_NUMBER, 1234) == splits
    assert corpus.split_numbers(MAX_NUMBER, 5) != splits
    # A number's split does not depend on max_number: a bigger corpus never moves test numbers into train.
    smaller = corpus.split_numbers(MAX_NUMBER // 2, 1234)
    assert all(set(smaller[name]) <= sets[name] for name in smaller)
    with pytest.raises(ValueError, match="summing to 1"):
        corpus.split_numbers(10, 1, fractions=(0.5, 0.2, 0.2))


def test_pairs_are_deterministic_many_to_many_and_tagged(splits):
    numbers = splits["train"]
    pairs = corpus.make_pairs(numbers, corpus.LANGUAGES, seed=7, pairs_per_number=3)
    assert pairs == corpus.make_pairs(numbers, corpus.LANGUAGES, seed=7, pairs_per_number=3)
    assert pairs != corpus.make_pairs(numbers, corpus.LANGUAGES, seed=8, pairs_per_number=3)
    assert len(pairs) == 3 * len(numbers)
    assert len({src for src, _, _, _ in pairs}) >= 8 and len({tgt for _, tgt, _, _ in pairs}) >= 8
    assert all(src != tgt for src, tgt, _, _ in pairs)
    for i, (src, tgt, src_text, tgt_text) in enumerate(pairs):
        number = numbers[i // 3]
        assert (src_text, tgt_text) == (corpus.spell(number, src), corpus.spell(number, tgt))
    # The 3 examples of a number go in 3 different directions.
    directions = collections.Counter((i // 3, src, tgt) for i, (src, tgt, _, _) in enumerate(pairs))
    assert max(directions.values()) == 1
    assert corpus.tagged_source("fr", "twenty-one") == "<2fr> twenty-one"


def test_to_from_english_keeps_english_on_one_side():
    pairs = corpus.make_pairs(range(50), corpus.LANGUAGES, seed=1, pairs_per_number=4, directions="to_from_english")
    assert all(("en" in (src, tgt)) and src != tgt for src, tgt, _, _ in pairs)
    assert {src for src, _, _, _ in pairs} | {tgt for _, tgt, _, _ in pairs} == set(corpus.LANGUAGES)
    with pytest.raises(ValueError, match="needs 'en'"):
        corpus.make_pairs([1], ["fr", "de"], seed=1, pairs_per_number=1, directions="to_from_english")
    with pytest.raises(ValueError, match="pairs_per_number"):
        corpus.make_pairs([1], ["fr", "de"], seed=1, pairs_per_number=3)


def test_spelling_is_normalized_and_languages_are_distinct():
    assert corpus.normalize("  Vingt\tEt\n UN ") == "vingt et un"
    assert corpus.normalize("ZE\u0301RO") == "zéro"  # an accent given as a combining mark becomes one code point
    assert corpus.spell(1984, "fr") == "mille neuf cent quatre-vingt-quatre"
    assert corpus.spell(0, "fr") == "zéro"
    assert len(corpus.LANGUAGES) >= 8
    numbers = range(0, 10_000, 97)
    spelled = {lang: [corpus.spell(n, lang) for n in numbers] for lang in corpus.LANGUAGES}
    for i, a in enumerate(corpus.LANGUAGES):
        for b in corpus.LANGUAGES[i + 1:]:
            same = sum(x == y for x, y in zip(spelled[a], spelled[b]))
            assert same <= 1, f"{a} and {b} spell {same} of {len(numbers)} numbers the same way"
    for lang in corpus.LANGUAGES:
        assert len(set(spelled[lang])) == len(numbers), f"{lang} spells two numbers the same way"
    with pytest.raises(ValueError, match="not supported by num2words"):
        corpus.spell(3, "xx")


# -------------------------------------------------------------------------------------------------- vocabulary

def test_vocabulary_round_trips_corpus_text_with_single_token_tags(vocab, splits):
    assert vocab.size == VOCAB_SIZE
    assert (vocab.pad_id, vocab.eos_id, vocab.bos_id, vocab.unk_id) == (0, 1, 2, 3)
    assert vocab.user_symbols == TAGS
    for lang in corpus.LANGUAGES:
        tag_id = vocab.symbol_id(corpus.language_tag(lang))
        assert vocab.encode(corpus.language_tag(lang)) == [tag_id]
        assert vocab.id_to_piece(tag_id) == corpus.language_tag(lang)
        # Dev numbers were not in the training text: the vocabulary still covers them.
        for number in splits["dev"][:20] + [0, 7, 99, 599]:
            text = corpus.spell(number, lang)
            ids = vocab.encode(text)
            assert vocab.unk_id not in ids
            assert vocab.decode(ids) == text
            tagged = corpus.tagged_source(lang, text)
            assert vocab.encode(tagged) == [tag_id] + ids
            assert vocab.decode(vocab.encode(tagged)) == tagged
    # Model output decodes as is: bos and padding are skipped, and text ends at the first eos.
    ids = vocab.encode("vingt et un")
    assert vocab.decode([vocab.bos_id] + ids + [vocab.eos_id] + ids + [0, 0]) == "vingt et un"


def test_vocabulary_is_saved_reloaded_and_trained_deterministically(vocab, train_texts, tmp_path):
    assert os.path.isfile(vocab.model_path) and os.path.isfile(vocab.model_path[:-len(".model")] + ".vocab")
    reloaded = Vocabulary.load(vocab.model_path)
    texts = train_texts[::37] + [corpus.tagged_source("pl", "dwa")]
    assert reloaded.encode_batch(texts) == vocab.encode_batch(texts)
    assert reloaded.size == vocab.size and reloaded.user_symbols == vocab.user_symbols
    again = Vocabulary.train(train_texts, VOCAB_SIZE, str(tmp_path / "again"), TAGS)
    with open(vocab.model_path, "rb") as a, open(again.model_path, "rb") as b:
        assert a.read() == b.read()
    # A subsample keeps every language (a stride over this language-major text would not).
    sub = Vocabulary.train(train_texts, VOCAB_SIZE, str(tmp_path / "sub"), TAGS, max_sentences=len(train_texts) // 3)
    assert all(sub.unk_id not in sub.encode(corpus.spell(n, lang)) for lang in corpus.LANGUAGES for n in range(50))


def test_vocabulary_errors(train_texts, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100000 is too large"):
        Vocabulary.train(train_texts[:200], 100_000, str(tmp_path / "big"), TAGS)
    with pytest.raises(ValueError, match="whitespace"):
        Vocabulary.train(train_texts[:200], 100, str(tmp_path / "bad"), ["<2 fr>"])
    # A SentencePiece model with its own default ids (unk 0, bos 1, eos 2) is refused, not silently misread.
    spm.SentencePieceTrainer.train(sentence_iterator=iter(train_texts[:500]), model_prefix=str(tmp_path / "other"),
                                   vocab_size=60, model_type="bpe", minloglevel=2)
    with pytest.raises(ValueError, match="pad=0, eos=1, bos=2, unk=3"):
        Vocabulary.load(str(tmp_path / "other.model"))
    with pytest.raises(FileNotFoundError):
        Vocabulary.load(str(tmp_path / "missing.model"))


# ------------------------------------------------------------------------------------------------------- input

def test_batches_have_static_shapes_and_consistent_ids(vocab_dir):
    inp = make_input(vocab_dir, batch_size=16)
    ds = inp.dataset()
    length = inp.p.max_length
    expected = {"src_ids": ([16, length], tf.int32), "src_paddings": ([16, length], tf.float32),
                "tgt_in_ids": ([16, length], tf.int32), "tgt_out_ids": ([16, length], tf.int32),
                "tgt_paddings": ([16, length], tf.float32), "tgt_lang": ([16], tf.string)}
    assert {k: (spec.shape.as_list(), spec.dtype) for k, spec in ds.element_spec.items()} == expected
    vocab = inp.vocab
    references = set(inp.references())
    langs = set()
    for batch in take(iter(ds), 5):
        for name in ("src", "tgt"):
            paddings = batch[f"{name}_paddings"]
            assert set(np.unique(paddings)) <= {0.0, 1.0}
            # Padding is a suffix: once padded, padded to the end.
            assert (np.diff(paddings, axis=1) >= 0).all()
        assert (batch["src_ids"][batch["src_paddings"] == 1.0] == vocab.pad_id).all()
        assert (batch["src_ids"][batch["src_paddings"] == 0.0] != vocab.pad_id).all()
        for key in ("tgt_in_ids", "tgt_out_ids"):
            assert (batch[key][batch["tgt_paddings"] == 1.0] == vocab.pad_id).all()
            assert (batch[key][batch["tgt_paddings"] == 0.0] != vocab.pad_id).all()
        for row in range(16):
            size = int((1 - batch["tgt_paddings"][row]).sum())
            tgt_in, tgt_out = batch["tgt_in_ids"][row, :size], batch["tgt_out_ids"][row, :size]
            assert tgt_in[0] == vocab.bos_id and tgt_out[-1] == vocab.eos_id
            np.testing.assert_array_equal(tgt_in[1:], tgt_out[:-1])
            lang = batch["tgt_lang"][row].decode()
            langs.add(lang)
            assert batch["src_ids"][row, 0] == vocab.symbol_id(corpus.language_tag(lang))
            source = vocab.decode(batch["src_ids"][row])
            assert (source, vocab.decode(tgt_out), lang) in references
    assert len(langs) >= 5


def test_training_batches_are_deterministic_and_reshuffled_per_epoch(vocab_dir):
    inp = make_input(vocab_dir, batch_size=2)
    assert inp.num_examples % 2 == 0
    per_epoch = inp.num_examples // 2
    first = take(iter(inp.dataset()), 2 * per_epoch)
    assert_same_batches(first[:50], take(iter(make_input(vocab_dir, batch_size=2).dataset()), 50))
    other_seed = take(iter(make_input(vocab_dir, batch_size=2, seed=2).dataset()), 50)
    assert any((a["src_ids"] != b["src_ids"]).any() for a, b in zip(first, other_seed))

    def examples(batches):
        return [(tuple(row), lang) for b in batches for row, lang in zip(b["tgt_out_ids"], b["tgt_lang"])]

    epoch0, epoch1 = examples(first[:per_epoch]), examples(first[per_epoch:])
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)
    assert len(set(epoch0)) > 0.9 * len(epoch0)  # a permutation of the examples, not a sample with repeats


def test_finite_input_follows_references_in_order(vocab_dir):
    inp = make_input(vocab_dir, split="dev", num_batches=3, batch_size=4)
    batches = take(iter(inp.dataset()), 3)
    with pytest.raises(StopIteration):
        it = iter(inp.dataset())
        take(it, 4)
    references = inp.references()
    assert len(references) == 12
    decoded = [(inp.vocab.decode(b["src_ids"][r]), inp.vocab.decode(b["tgt_out_ids"][r]), b["tgt_lang"][r].decode())
               for b in batches for r in range(4)]
    assert decoded == references
    # The dev split holds dev numbers only.
    dev_numbers = corpus.split_numbers(MAX_NUMBER, 1234)["dev"]
    dev_text = {corpus.spell(n, lang) for n in dev_numbers for lang in corpus.LANGUAGES}
    assert all(target in dev_text for _, target, _ in references)


def test_long_examples_are_dropped_from_training_and_rejected_in_eval(vocab_dir):
    short = make_input(vocab_dir, max_length=4)
    assert short.num_dropped > 0 and short.num_examples > 0
    batch = take(iter(short.dataset()), 1)[0]
    assert batch["src_ids"].shape == (8, 4)
    with pytest.raises(ConfigError, match=r"(?s)example \d+ \(number \d+.*Raise the input param max_length to "
                                          r"at least \d+"):
        make_input(vocab_dir, split="test", max_length=4, num_batches=1)


def test_iterator_checkpoint_resumes_exactly(vocab_dir, tmp_path):
    inp = make_input(vocab_dir, batch_size=64)
    per_epoch = inp.num_examples // 64
    iterator = iter(inp.dataset())
    take(iterator, per_epoch - 2)
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt"))
    expected = take(iterator, 6)  # crosses into the next epoch
    restored = iter(make_input(vocab_dir, batch_size=64).dataset())
    tf.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert_same_batches(take(restored, 6), expected)


def test_vocabulary_is_trained_once_from_train_split_and_reused(vocab_dir, tmp_path):
    train = make_input(vocab_dir)
    test = make_input(vocab_dir, split="test", num_batches=1)
    assert test.vocab.model_path == train.vocab.model_path
    assert os.path.dirname(train.vocab.model_path) == vocab_dir
    elsewhere = make_input(str(tmp_path), split="dev", num_batches=1)
    with open(train.vocab.model_path, "rb") as a, open(elsewhere.vocab.model_path, "rb") as b:
        assert a.read() == b.read()
    given = make_input(None, vocab_model=train.vocab.model_path, split="dev", num_batches=1)
    assert given.references() == elsewhere.references()


def test_bad_params_are_rejected(vocab_dir, vocab):
    with pytest.raises(ParamsError, match="vocab_model .* or vocab_dir"):
        make_input(None)
    with pytest.raises(ParamsError, match="split='valid'"):
        make_input(vocab_dir, split="valid")
    with pytest.raises(ConfigError, match="'<2ro>' is not a user symbol"):
        make_input(None, vocab_model=vocab.model_path, languages=["en", "ro"])
    with pytest.raises(ConfigError, match="fewer than batch_size"):
        make_input(vocab_dir, split="dev", batch_size=10_000)
