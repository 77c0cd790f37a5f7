"""Issue 4: a pipelined (K=4, M=4) and an un-pipelined run of the same seed give the same loss curve."""

import numpy as np
import pytest

from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.summaries import read_scalars

# Small sizes keep the test fast; dropout 0 because dropout masks depend on the micro-batch (by design).
KNOBS = ["NumbersTiny.model_dim = 32", "NumbersTiny.num_heads = 2", "NumbersTiny.hidden_dim = 64",
         "NumbersTiny.max_number = 300", "NumbersTiny.vocab_size = 300", "NumbersTiny.batch_size = 16",
         "NumbersTiny.dropout_rate = 0.0"]


def curve(tmp_path, name, k, m):
    logdir = str(tmp_path / name)
    params, _ = experiment.resolve_params(
        "mt.number_words.NumbersTiny", gin_bindings=KNOBS + [f"NumbersTiny.num_stages = {k}",
                                                        f"NumbersTiny.num_micro_batches = {m}"],
        overrides=f"train.max_steps=20,train.summary_interval_steps=1,input.train.vocab_dir='{tmp_path}'")
    logdir_lib.prepare(logdir, params)
    Controller(params, logdir, log=lambda s: None).train()
    return np.array([v for _, v in read_scalars(f"{logdir}/train")["loss"]])


@pytest.mark.exhaustive(covered_by=(
    "tests/tasks/test_translation_task.py::test_pipelined_equals_unpipelined_loss_and_gradients",
))
def test_pipelined_and_unpipelined_loss_curves_match(tmp_path):
    plain, pipelined = curve(tmp_path, "plain", 1, 1), curve(tmp_path, "pipelined", 4, 4)
    assert len(plain) == len(pipelined) == 20
    assert plain[-1] < plain[0]  # it trains
    np.testing.assert_allclose(pipelined, plain, rtol=1e-4)
