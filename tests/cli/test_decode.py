"""--mode=decode: translations and scores written per dataset; BLEU, chrF and exact match against references."""

import os
import re
import sys

import pytest

from gpipe_tf.training.decoder import score
from gpipe_tf.training.summaries import read_scalars
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT


def test_score_counts_exact_matches_per_language():
    fr = "mille deux cent trente quatre"  # BLEU needs 4-grams: one-word sentences score 0 even when equal
    scores = score([fr, "drei", "vier"], [fr, "drei", "fünf"], ["fr", "de", "de"])
    assert scores["exact_match"] == pytest.approx(2 / 3)
    assert scores["exact_match/fr"] == 1.0 and scores["exact_match/de"] == 0.5
    assert scores["bleu/fr"] == pytest.approx(100.0) and 0.0 <= scores["bleu"] <= 100.0


def test_chrf_beside_bleu_scores_one_word_sentences():
    # issue 35 item 18: German numbers are single words, so BLEU (1- to 4-grams) is 0 even for exact translations.
    de = ["dreihundertvierundzwanzig", "siebzehn", "neunhundert"]
    fr = ["trois cent vingt-quatre mille", "dix-sept mille deux cents"]
    scores = score(de + fr, de[:2] + ["neunhundertzwei"] + fr, ["de"] * 3 + ["fr"] * 2)
    assert scores["exact_match/de"] == pytest.approx(2 / 3) and scores["bleu/de"] == 0.0
    exact = score(de, de, ["de"] * 3)
    assert exact["chrf/de"] == pytest.approx(100.0) and exact["chrf"] == pytest.approx(100.0)
    assert exact["bleu/de"] == 0.0
    assert 0.0 < scores["chrf/de"] < 100.0  # a near miss ("neunhundert" for "neunhundertzwei") earns partial credit
    assert scores["chrf/fr"] == pytest.approx(100.0) and scores["bleu/fr"] == pytest.approx(100.0)
    assert scores["chrf/de"] < scores["chrf"] < 100.0  # the overall score is the corpus's, over both languages


def test_decode_mode_writes_hypotheses_and_scalars(tmp_path):
    logdir = str(tmp_path)
    result = trainer_process.run(
        [sys.executable, "trainer.py", "--model=mt.number_words.NumbersTiny", f"--logdir={logdir}", "--mode=decode",
         "--params=input.test.num_batches=1,input.dev.num_batches=1,eval.beam_size=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "decode test at step 0: 64 sentences" in result.stdout
    assert re.search(r"decode test at step 0: 64 sentences, BLEU=[\d.]+, chrF=[\d.]+, exact match=", result.stdout)
    assert "decode test at step 0: 1 batches ..." in result.stdout.splitlines()  # the progress line before it
    rows = open(os.path.join(logdir, "decode_test", "hypotheses.tsv"), encoding="utf-8").read().splitlines()
    assert rows[0].split("\t") == ["source", "hypothesis", "reference", "target_language"] and len(rows) == 65
    assert all(row.split("\t")[0].startswith("<2") for row in rows[1:])
    scalars = read_scalars(os.path.join(logdir, "decode_test"))
    languages = {row.split("\t")[3] for row in rows[1:]}
    assert {"bleu", "chrf", "exact_match"} | {f"{metric}/{lang}" for metric in ("bleu", "chrf", "exact_match")
                                              for lang in languages} <= set(scalars), sorted(scalars)


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_decode.py::test_decode_mode_writes_hypotheses_and_scalars",
))
def test_trained_tiny_model_decodes_known_strings(tmp_path):
    """Train a small pipelined model on 30 numbers in English and French, then decode its training sentences."""
    import tensorflow as tf

    from gpipe_tf import experiment
    from gpipe_tf.training import logdir as logdir_lib
    from gpipe_tf.training.controller import Controller

    knobs = ["NumbersTiny.model_dim = 64", "NumbersTiny.num_heads = 2", "NumbersTiny.hidden_dim = 128",
             "NumbersTiny.max_number = 30", "NumbersTiny.vocab_size = 120", "NumbersTiny.batch_size = 16",
             "NumbersTiny.dropout_rate = 0.0", "NumbersTiny.label_smoothing = 0.0", "NumbersTiny.warmup_steps = 50"]
    params, _ = experiment.resolve_params(
        "mt.number_words.NumbersTiny", gin_bindings=knobs,
        overrides=(f"train.max_steps=400,input.train.languages=['en', 'fr'],input.train.pairs_per_number=2,"
                   f"input.train.vocab_dir='{tmp_path}'"))
    logdir_lib.prepare(str(tmp_path / "run"), params)
    controller = Controller(params, str(tmp_path / "run"), log=lambda s: None)
    controller.train()
    train_input = params.input.train.copy().set(num_batches=1).instantiate()
    vocab = train_input.vocab
    batch = next(iter(train_input.dataset()))
    ids = tf.function(lambda b: controller.task.decode(b, 16, beam_size=2, bos_id=vocab.bos_id,
                                                       eos_id=vocab.eos_id), autograph=False)(batch)
    translations = {src: vocab.decode(row) for (src, _, _), row in zip(train_input.references(), ids.numpy().tolist())}
    expected = {src: ref for src, ref, _ in train_input.references()[:16]}
    assert len(expected) == 16 and translations == expected
