"""--mode=decode: translations and scores written per dataset; BLEU and exact match against references."""

import os
import subprocess
import sys

import pytest

from gpipe_tf.training.decoder import score
from gpipe_tf.training.summaries import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_score_counts_exact_matches_per_language():
    fr = "mille deux cent trente quatre"  # BLEU needs 4-grams: one-word sentences score 0 even when equal
    scores = score([fr, "drei", "vier"], [fr, "drei", "fünf"], ["fr", "de", "de"])
    assert scores["exact_match"] == pytest.approx(2 / 3)
    assert scores["exact_match/fr"] == 1.0 and scores["exact_match/de"] == 0.5
    assert scores["bleu/fr"] == pytest.approx(100.0) and 0.0 <= scores["bleu"] <= 100.0


def test_decode_mode_writes_hypotheses_and_scalars(tmp_path):
    logdir = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "trainer.py", "--model=mt.numbers.NumbersTiny", f"--logdir={logdir}", "--mode=decode",
         "--params=input.test.num_batches=1,input.dev.num_batches=1,eval.beam_size=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "decode test at step 0: 64 sentences" in result.stdout
    rows = open(os.path.join(logdir, "decode_test", "hypotheses.tsv"), encoding="utf-8").read().splitlines()
    assert rows[0].split("\t") == ["source", "hypothesis", "reference", "target_language"] and len(rows) == 65
    assert all(row.split("\t")[0].startswith("<2") for row in rows[1:])
    scalars = read_scalars(os.path.join(logdir, "decode_test"))
    assert {"bleu", "exact_match", "exact_match/fr"} <= set(scalars)
