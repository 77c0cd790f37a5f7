"""Translation inputs from the real TFDS builders (ted_multi_translate, WMT) prepared offline from tiny fake files."""

import itertools
import unicodedata

import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.inputs import tfds_translation
from gpipe_tf.inputs.tfds_prepare import DatasetNotPreparedError
from gpipe_tf.inputs.tfds_translation import TfdsTranslationInput
from tests.helpers import fake_tfds, fake_tfds_translate, guards

LANGUAGES = list(fake_tfds_translate.TED_LANGUAGES)  # en fr de es pt-br
BATCH_KEYS = {"src_ids", "src_paddings", "tgt_in_ids", "tgt_out_ids", "tgt_paddings", "tgt_lang"}
NEWS_SUBSETS = {"train": ["newscommentary_v9"], "validation": ["newstest2013"]}


@pytest.fixture(scope="module")
def ted(tmp_path_factory):
    """(data_dir, vocab_dir, corpus) with fake ted_multi_translate: 31 train, 7 validation, 6 test sentences."""
    root = tmp_path_factory.mktemp("ted")
    corpus = fake_tfds_translate.write_ted_multi(str(root / "source"))
    fake_tfds.prepare_offline(tfds.builder(tfds_translation.TED_MULTI, data_dir=str(root / "data")),
                              str(root / "source"))
    return str(root / "data"), str(root / "vocab"), corpus


@pytest.fixture(scope="module")
def wmt(tmp_path_factory):
    """(data_dir, vocab_dir, {config: written}) with fake wmt14_translate/de-en and a custom WMT config."""
    root = tmp_path_factory.mktemp("wmt")
    data_dir = str(root / "data")
    written = {}
    custom = TfdsTranslationInput.params().set(dataset="wmt_translate/de-en", wmt_subsets=NEWS_SUBSETS,
                                               data_dir=data_dir)
    builders = {"wmt14_translate/de-en": tfds.builder("wmt14_translate/de-en", data_dir=data_dir),
                "custom": tfds_translation.dataset_builder(custom)}
    for name, builder in builders.items():
        source = str(root / name.replace("/", "_"))
        written[name] = fake_tfds_translate.write_wmt(source, builder)
        fake_tfds.prepare_offline(builder, source)
    return data_dir, str(root / "vocab"), written


def _ted_input(ted, **kwargs):
    data_dir, vocab_dir, _ = ted
    settings = dict(data_dir=data_dir, vocab_dir=vocab_dir, languages=LANGUAGES, vocab_size=150, max_length=48,
                    batch_size=1, num_batches=1000, split="validation")
    settings.update(kwargs)
    return TfdsTranslationInput.params().set(**settings).instantiate()


def _normalized(text):
    return " ".join(unicodedata.normalize("NFC", text).split())


def _expected(sentences, directions):
    """(tagged source, target, target language) for every allowed direction each sentence holds."""
    return sorted((f"<2{tgt}> {_normalized(s[src])}", _normalized(s[tgt]), tgt)
                  for s in sentences for src, tgt in directions if src in s and tgt in s)


def _batches(inp):
    return [{k: v.numpy() for k, v in b.items()} for b in inp.dataset()]


# ------------------------------------------------------------------------------------------ ted_multi_translate

def test_ted_eval_gives_every_tagged_pair_and_it_decodes_back(ted):
    inp = _ted_input(ted)
    assert inp.directions == [("en", t) for t in LANGUAGES[1:]] + [(s, "en") for s in LANGUAGES[1:]]
    assert [inp.vocab.id_to_piece(inp.vocab.symbol_id(f"<2{lang}>")) for lang in LANGUAGES] == [
        f"<2{lang}>" for lang in LANGUAGES]
    references = inp.references()
    assert sorted(references) == _expected(ted[2]["validation"], inp.directions)
    # The greeting, NFC-normalized with single spaces and its case kept, tagged with its target language.
    assert ("<2pt-br> Thank you very much.", "Muito obrigado, Chris. É isso.", "pt-br") in references
    assert ("<2en> Vielen Dank.", "Thank you very much.", "en") in references
    batches = _batches(inp)
    assert len(batches) == len(references)
    for batch, (src, tgt, lang) in zip(batches, references):
        assert set(batch) == BATCH_KEYS and batch["tgt_lang"][0].decode() == lang
        assert inp.vocab.unk_id not in batch["src_ids"][0] and inp.vocab.unk_id not in batch["tgt_out_ids"][0]
        assert inp.vocab.decode(batch["src_ids"][0]) == src
        assert inp.vocab.decode(batch["tgt_out_ids"][0]) == tgt
        assert inp.vocab.decode(batch["tgt_in_ids"][0]) == tgt
        assert batch["src_ids"][0][0] == inp.vocab.symbol_id(f"<2{lang}>")
        assert batch["tgt_in_ids"][0][0] == inp.vocab.bos_id
        n = int(batch["tgt_paddings"][0].size - batch["tgt_paddings"][0].sum())
        assert batch["tgt_out_ids"][0][n - 1] == inp.vocab.eos_id and (batch["tgt_out_ids"][0][n:] == 0).all()
        assert (batch["src_paddings"][0] == (batch["src_ids"][0] == 0)).all()


@pytest.mark.parametrize("directions", ["to_english", "from_english", "many_to_many"])
def test_ted_directions_filter_the_pairs(ted, directions):
    languages = ["en", "fr", "de"] if directions == "many_to_many" else LANGUAGES
    inp = _ted_input(ted, languages=languages, directions=directions, split="test", vocab_size=120)
    references = inp.references()
    assert sorted(references) == _expected(ted[2]["test"], inp.directions)
    if directions == "to_english":
        assert {lang for _, _, lang in references} == {"en"}
    elif directions == "from_english":
        english = {_normalized(s["en"]) for s in ted[2]["test"]}
        assert {src.split(" ", 1)[1] for src, _, _ in references} == english
        assert {lang for _, _, lang in references} == set(LANGUAGES) - {"en"}
    else:
        assert {lang for _, _, lang in references} == {"en", "fr", "de"}
        assert not any("pt-br" in src or lang == "es" for src, _, lang in references)


def test_ted_training_batches_have_bounded_shapes_and_repeat_deterministically(ted):
    make = lambda seed: _ted_input(ted, split="train", num_batches=None, batch_size=4, max_length=32,  # noqa: E731
                                   seed=seed, shuffle_buffer=64)
    inp = make(1)
    assert inp.bucket_lengths == (8, 16, 32)
    spec = inp.dataset().element_spec
    assert spec["src_ids"].shape.as_list() == [4, None] and spec["tgt_lang"].shape.as_list() == [4]
    first = _take(inp, 60)  # several epochs of the ~200 pairs
    shapes = {b["src_ids"].shape for b in first} | {b["tgt_in_ids"].shape for b in first}
    assert shapes <= {(4, 8), (4, 16), (4, 32)} and len(shapes) >= 2
    # A train step is traced once per bucket shape, not once per batch.
    traced = tf.function(lambda batch: tf.reduce_sum(batch["src_ids"]) + tf.reduce_sum(batch["tgt_in_ids"]),
                         autograph=False)
    for batch in inp.dataset().take(60):
        traced(batch)
    assert traced.experimental_get_tracing_count() == len({b["src_ids"].shape for b in first})
    for b in first:
        assert b["src_ids"].shape == b["tgt_out_ids"].shape == b["src_paddings"].shape == b["tgt_paddings"].shape
        # Rows are padded to the bucket, and the bucket is the shortest that holds the longest row.
        needed = max((1 - b["src_paddings"]).sum(1).max(), (1 - b["tgt_paddings"]).sum(1).max())
        assert needed <= b["src_ids"].shape[1] and (b["src_ids"].shape[1] == 8 or needed > b["src_ids"].shape[1] / 2)
    assert all(_same(a, b) for a, b in zip(first, _take(make(1), 60)))
    assert not all(_same(a, b) for a, b in zip(first, _take(make(2), 60)))


def test_ted_training_iterator_checkpoint_resumes_exactly(ted, tmp_path):
    inp = _ted_input(ted, split="train", num_batches=None, batch_size=4, max_length=32, shuffle_buffer=64)
    iterator = iter(inp.dataset())
    for _ in range(7):
        next(iterator)
    checkpoint = tf.train.Checkpoint(iterator=iterator)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    after = [{k: v.numpy() for k, v in next(iterator).items()} for _ in range(10)]
    checkpoint.restore(path)
    again = [{k: v.numpy() for k, v in next(iterator).items()} for _ in range(10)]
    assert all(_same(a, b) for a, b in zip(after, again))


def _take(inp, count):
    return [{k: v.numpy() for k, v in b.items()} for b in inp.dataset().take(count)]


def _same(a, b):
    return all(a[k].shape == b[k].shape and (a[k] == b[k]).all() for k in a)


def test_ted_long_examples_are_dropped_and_pairs_can_be_sampled(ted):
    full = _ted_input(ted, max_length=48).references()
    short = _ted_input(ted, max_length=8).references()
    assert 0 < len(short) < len(full) and set(short) <= set(full)
    vocab = _ted_input(ted, max_length=8).vocab
    assert all(len(vocab.encode(s)) <= 8 and len(vocab.encode(t)) + 1 <= 8 for s, t, _ in short)
    sampled = _ted_input(ted, pairs_per_example=1).references()
    assert len(sampled) == len(ted[2]["validation"]) and set(sampled) <= set(full)


def test_ted_bad_params_and_vocabulary_reuse(ted):
    with pytest.raises(ParamsError, match="bucket_lengths"):
        _ted_input(ted, bucket_lengths=(16, 8, 48))
    with pytest.raises(ParamsError, match="unknown: \\['xx'\\]"):
        _ted_input(ted, languages=["en", "xx"])
    with pytest.raises(ParamsError, match="needs 'en'"):
        _ted_input(ted, languages=["fr", "de"], directions="to_english")
    with pytest.raises(ConfigError, match="bad split 'dev'"):
        _ted_input(ted, split="dev")
    with pytest.raises(ConfigError, match="num_batches set"):
        _ted_input(ted, num_batches=None).references()
    with pytest.raises(ParamsError, match="not a TFDS dataset"):
        _ted_input(ted, dataset="no_such_dataset")
    first = _ted_input(ted)
    with pytest.MonkeyPatch.context() as patch:
        guards.forbid_vocabulary_training(patch)
        again = _ted_input(ted, split="test")
    assert again.vocab.model_path == first.vocab.model_path
    assert _ted_input(ted, vocab_size=140).vocab.model_path != first.vocab.model_path
    with pytest.raises(ConfigError, match="'<2es>' is not a user symbol"):
        _ted_input(ted, languages=["en", "fr", "de", "es"], vocab_model=_ted_input(
            ted, languages=["en", "fr", "de"], vocab_size=120).vocab.model_path)


def test_not_prepared_error_names_the_dataset_data_dir_and_the_fix(tmp_path, monkeypatch):
    guards.forbid_downloads(monkeypatch)
    with pytest.raises(DatasetNotPreparedError) as info:
        TfdsTranslationInput.params().set(data_dir=str(tmp_path), vocab_dir=str(tmp_path)).instantiate()
    message = str(info.value)
    assert "'ted_multi_translate'" in message and str(tmp_path) in message
    assert f"tfds build ted_multi_translate --data_dir={tmp_path}" in message
    with pytest.raises(DatasetNotPreparedError, match="'wmt14_translate/de-en'.*tfds build wmt14_translate/de-en"):
        TfdsTranslationInput.params().set(dataset="wmt14_translate/de-en", data_dir=str(tmp_path),
                                          vocab_dir=str(tmp_path)).instantiate()
    with pytest.raises(DatasetNotPreparedError, match="dataset_builder"):
        TfdsTranslationInput.params().set(dataset="wmt_translate/de-en", wmt_subsets=NEWS_SUBSETS,
                                          data_dir=str(tmp_path), vocab_dir=str(tmp_path)).instantiate()
    assert isinstance(info.value, ConfigError)


# ---------------------------------------------------------------------------------------------------------- WMT

def _wmt_input(wmt, **kwargs):
    data_dir, vocab_dir, _ = wmt
    settings = dict(dataset="wmt14_translate/de-en", data_dir=data_dir, vocab_dir=vocab_dir, vocab_size=120,
                    max_length=32, batch_size=1, num_batches=1000, split="test")
    settings.update(kwargs)
    return TfdsTranslationInput.params().set(**settings).instantiate()


def test_wmt14_pairs_in_both_directions(wmt):
    written = wmt[2]["wmt14_translate/de-en"]
    to_english = _wmt_input(wmt, directions="to_english")
    assert to_english.languages == ("de", "en") and to_english.directions == [("de", "en")]
    assert sorted(to_english.references()) == sorted((f"<2en> {de}", en, "en") for de, en in written["test"])
    from_english = _wmt_input(wmt, directions="from_english", split="validation")
    assert sorted(from_english.references()) == sorted(
        (f"<2de> {en}", de, "de") for de, en in written["validation"])
    both = _wmt_input(wmt, split="train")  # three sub-datasets: europarl, commoncrawl, news commentary
    assert len(both.references()) == 2 * len(written["train"]) == 2 * 3 * 6
    for batch, (src, tgt, _) in zip(_batches(both), both.references()):
        assert both.vocab.decode(batch["src_ids"][0]) == src and both.vocab.decode(batch["tgt_out_ids"][0]) == tgt


def test_custom_wmt_config_from_chosen_subsets(wmt):
    written = wmt[2]["custom"]
    inp = _wmt_input(wmt, dataset="wmt_translate/de-en", wmt_subsets=NEWS_SUBSETS, split="validation",
                     directions="to_english", vocab_size=80)  # 6 training pairs make at most ~100 ids
    assert inp.num_source_examples == len(written["validation"]) == 6
    assert sorted(inp.references()) == sorted((f"<2en> {de}", en, "en") for de, en in written["validation"])
    with pytest.raises(ParamsError, match="unknown WMT sub-datasets \\['nope'\\]"):
        _wmt_input(wmt, dataset="wmt_translate/de-en", wmt_subsets={"train": ["nope"]})
    with pytest.raises(ParamsError, match="wmt_subsets needs dataset='wmt_translate/<xx>-<yy>'"):
        _wmt_input(wmt, wmt_subsets=NEWS_SUBSETS)


def test_default_bucket_lengths_and_normalize():
    assert tfds_translation.default_bucket_lengths(256) == (8, 16, 32, 64, 128, 256)
    assert tfds_translation.default_bucket_lengths(100) == (8, 16, 32, 64, 100)
    assert tfds_translation.default_bucket_lengths(8) == (8,)
    assert tfds_translation.normalize("  E\u0301 \t isso ") == "É isso"


def test_batches_feed_the_pipelined_translation_task_unchanged(ted):
    """A 2-stage, 2-micro-batch TranslationTask takes the batches as they come (one trace: ~5 s)."""
    from gpipe_tf.layers.base_layer import FPropContext
    from gpipe_tf.tasks.translation import TranslationTask

    inp = _ted_input(ted, split="train", num_batches=None, batch_size=4, max_length=16, bucket_lengths=(16,),
                     shuffle_buffer=64)
    p = TranslationTask.params().set(
        name="t", vocab_size=inp.vocab.size, model_dim=16, num_heads=2, hidden_dim=32, num_encoder_layers=1,
        num_decoder_layers=1)
    task = p.set(network=TranslationTask.network_params(p, num_stages=2, num_micro_batches=2)).instantiate()
    step = tf.function(lambda batch: task.loss_and_gradients(batch, FPropContext(training=False))[::2], autograph=False)
    for batch in itertools.islice(inp.dataset(), 3):
        loss, grads = step(batch)
        assert tf.math.is_finite(loss) and len(grads) == len(task.trainable_variables)
    assert step.experimental_get_tracing_count() == 1


def test_ted_multi_big_inputs_read_the_prepared_data(ted):
    """TedMultiBig's input Params, pointed at the fake data, build working inputs (the 400M model is not built)."""
    from gpipe_tf import experiment

    data_dir, vocab_dir, corpus = ted
    params, _ = experiment.resolve_params("mt.ted_multi.TedMultiBig", gin_bindings=[
        f"TedMultiBig.data_dir = '{data_dir}'", f"TedMultiBig.vocab_dir = '{vocab_dir}'"])
    for name, split in (("train", "train"), ("dev", "validation"), ("test", "test")):
        p = params.input.get(name)
        assert p.cls is TfdsTranslationInput and (p.dataset, p.split, p.data_dir) == ("ted_multi_translate", split,
                                                                                         data_dir)
        assert (p.languages, p.directions, p.max_length) == (None, "to_from_english", 256)
        assert p.vocab_size == params.task.vocab_size == 64000 and (p.num_batches is None) == (name == "train")
    # Tiny text cannot fill 64k ids; the other settings are the experiment's.
    inp = params.input.dev.copy().set(vocab_size=200, batch_size=2).instantiate()
    assert len(inp.languages) == 60 and len(inp.directions) == 118
    # Each bucket's last partial batch is dropped: the pairs that come out are the expected ones, at most 10 x 2.
    references = inp.references()
    assert 10 <= len(references) <= 20 and set(references) <= set(_expected(corpus["validation"], inp.directions))
    batch = next(iter(inp.dataset()))
    assert [inp.vocab.decode(row) for row in batch["src_ids"].numpy()] == [src for src, _, _ in references[:2]]
    assert set(batch) == BATCH_KEYS and batch["src_ids"].shape[0] == 2 and batch["src_ids"].shape[1] in (
        inp.bucket_lengths)
