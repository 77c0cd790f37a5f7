"""--mode=export: a SavedModel loaded with tf.saved_model.load in a fresh process (no gpipe_tf imported there)
gives the trainer's own results: a pipelined classifier's eval metrics, a translation model's --mode=decode output."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.training import checkpoints
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.summaries import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer(*args):
    result = subprocess.run([sys.executable, "trainer.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def fresh_process(script, cwd):
    """Runs `script` in a new Python process outside the repository: only TensorFlow and NumPy are there."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


SERVE_LOGITS = """
import sys, numpy as np, tensorflow as tf
assert "gpipe_tf" not in sys.modules
serve = tf.saved_model.load("{export}").signatures["serving_default"]
inputs = np.load("inputs.npy")
np.save("logits.npy", np.concatenate([serve(inputs=tf.constant(x))["logits"].numpy() for x in inputs]))
assert "gpipe_tf" not in sys.modules
"""

# How far the served logits may be from a float64 forward pass of the checkpoint's weights, relative to the largest
# logit, and the served loss from the trainer's eval loss (relative): the compute dtype's unit roundoff (6e-8,
# 4.9e-4, 3.9e-3) grown through 4 layers of 16-64 products each. Measured: 2.5e-7, 6.2e-4, 4.8e-3 of the logits.
TOLERANCE = {"float32": 1e-5, "float16": 2.5e-3, "bfloat16": 2e-2}
ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def reference_logits(checkpoint, inputs):
    """A BlobsMlp's inference forward pass in float64 NumPy, on the weights read from the checkpoint's file:
    Linear+ReLU for each hidden layer (dropout is off in inference), then the softmax layer's projection."""
    reader = tf.train.load_checkpoint(checkpoint)

    def var(path):
        return reader.get_tensor(f"task/{path}/.ATTRIBUTES/VARIABLE_VALUE").astype(np.float64)

    linear = sorted({int(m.group(1)) for name in reader.get_variable_to_shape_map()
                     for m in [re.fullmatch(r"task/network/children/layer_(\d+)/vars/w/.*", name)] if m})
    assert len(linear) >= 2, linear  # fc0, fc1, ...; the layers between them are dropout
    h = inputs.astype(np.float64)
    for j in linear:
        h = np.maximum(h @ var(f"network/children/layer_{j}/vars/w") + var(f"network/children/layer_{j}/vars/b"), 0)
    return h @ var("softmax/vars/w") + var("softmax/vars/b")


# The pipelined classifier in each compute dtype, and the un-pipelined one in bfloat16 (which exported before, but
# computed in float32: the weights it served were never cast).
@pytest.mark.parametrize("model, dtype", [("BlobsMlpGPipe", "float32"), ("BlobsMlpGPipe", "bfloat16"),
                                          ("BlobsMlpGPipe", "float16"), ("BlobsMlp", "bfloat16")])
def test_classifier_export_matches_the_trainers_eval(tmp_path, model, dtype):
    key, logdir = f"toy.classifier.{model}", str(tmp_path / "run")
    # train_and_eval: the trainer evaluates its final step 30 with the model (pipelined: K=2, M=4) in `dtype`.
    precision = f"task.fprop_dtype={dtype}"
    trainer(f"--model={key}", f"--logdir={logdir}", "--mode=train_and_eval", "--max_steps=30", "--quiet",
            f"--params=train.save_interval_steps=10,train.max_checkpoints_to_keep=5,{precision}")
    exported = trainer(f"--model={key}", f"--logdir={logdir}", "--mode=export", f"--params={precision}")
    export_dir = os.path.join(logdir, "export", "30")
    assert f"to {export_dir}: serving_default inputs float32 [None, 16] -> logits float32 [None, 8]" in exported.stdout
    assert sorted(os.listdir(os.path.join(logdir, "export"))) == ["30"]

    # The dev set the evaluator read, as the fresh process gets it: plain arrays, batch by batch.
    params, _ = experiment.resolve_params(key)
    batches = list(params.input.dev.instantiate().dataset().as_numpy_iterator())
    np.save(tmp_path / "inputs.npy", np.stack([b["inputs"] for b in batches]))
    fresh_process(SERVE_LOGITS.format(export=export_dir), tmp_path)
    logits = np.load(tmp_path / "logits.npy").astype(np.float64)
    labels = np.concatenate([b["labels"] for b in batches])
    assert logits.shape == (len(labels), 8)

    # The served model is the checkpoint's, computed in `dtype`: close to a float64 forward pass of its weights,
    # and for a half dtype further from it than float32 rounding goes (the export computes as the trainer did).
    reference = reference_logits(os.path.join(logdir, "checkpoints", "ckpt-30"),
                                 np.concatenate([b["inputs"] for b in batches]))
    scale = np.abs(reference).max()
    error = np.abs(logits - reference).max() / scale
    assert error <= TOLERANCE[dtype], (dtype, error)
    if dtype != "float32":
        assert error > 1e-4, (dtype, error)  # float32's rounding: 2.5e-7

    # Independent metrics from the served logits equal the trainer's --mode=eval (pipelined, M=4) scalars.
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    served = {"accuracy": np.mean(logits.argmax(-1) == labels),
              "loss": -np.mean(log_probs[np.arange(len(labels)), labels])}
    scalars = read_scalars(os.path.join(logdir, "eval_dev"))
    assert scalars["loss"] == [(30, pytest.approx(served["loss"], rel=TOLERANCE[dtype], abs=1e-6))]
    # An example whose two best logits are within two roundings of the compute dtype may be counted either way.
    top2 = np.sort(logits, -1)[:, -2:]
    ambiguous = np.mean(top2[:, 1] - top2[:, 0] <= 2 * ROUNDOFF[dtype] * scale)
    assert scalars["accuracy"] == [(30, pytest.approx(served["accuracy"], abs=ambiguous + 1e-6))]
    assert 0.5 < served["accuracy"] <= 1.0  # a trained model: chance is 1/8
    print(f"{model} {dtype}: served vs float64 reference {error:.2e} of max |logit| {scale:.2f}; served loss "
          f"{served['loss']:.6f} vs eval {scalars['loss'][0][1]:.6f}; accuracy {served['accuracy']:.4f} vs eval "
          f"{scalars['accuracy'][0][1]:.4f} ({ambiguous:.4f} ambiguous)")
    if (model, dtype) != ("BlobsMlpGPipe", "float32"):
        return

    # --checkpoint exports an older checkpoint to --export_dir; it differs from step 30's model.
    older = str(tmp_path / "older")
    result = trainer(f"--model={key}", f"--logdir={logdir}", "--mode=export", f"--export_dir={older}",
                     f"--checkpoint={checkpoints.checkpoint_dir(logdir)}/ckpt-10", f"--params={precision}")
    assert f"ckpt-10 (step 10) to {older}:" in result.stdout
    fresh_process(SERVE_LOGITS.format(export=older), tmp_path)
    assert not np.allclose(np.load(tmp_path / "logits.npy"), logits, atol=1e-3)


SERVE_TRANSLATIONS = """
import glob, json, sys, numpy as np, sentencepiece as spm, tensorflow as tf
assert "gpipe_tf" not in sys.modules
serve = tf.saved_model.load("{export}").signatures["serving_default"]
ids = serve(src_ids=tf.constant(np.load("src_ids.npy")))["output_ids"].numpy()
vocab = spm.SentencePieceProcessor(model_file=glob.glob("{export}/assets/*.model")[0])
PAD, EOS, BOS = 0, 1, 2
texts = []
for row in ids.tolist():
    row = row[:row.index(EOS)] if EOS in row else row
    texts.append(vocab.decode([i for i in row if i not in (PAD, BOS)]))
print(json.dumps(texts))
"""

TINY_MT = ["--gin_param=NumbersTiny.model_dim=32", "--gin_param=NumbersTiny.num_heads=2",
           "--gin_param=NumbersTiny.hidden_dim=64", "--gin_param=NumbersTiny.batch_size=16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_translation_export_matches_greedy_decode(tmp_path, dtype):
    key, logdir = "mt.numbers.NumbersTiny", str(tmp_path / "run")
    overrides = "eval.beam_size=1,eval.datasets=['test'],input.test.num_batches=1"
    if dtype != "float32":
        overrides += f",task.fprop_dtype={dtype}"
    params, _ = experiment.resolve_params(key, gin_bindings=[flag.split("=", 1)[1] for flag in TINY_MT],
                                          overrides=overrides)
    # A checkpoint of the model as the trainer lays it out (task + global step), without spending a minute on
    # compiling the train step: the weights are the seeded initial ones, whose translations are long and varied.
    task = params.task.instantiate()
    logdir_lib.prepare(logdir, params)
    checkpoints.make_manager(tf.train.Checkpoint(task=task, global_step=tf.Variable(7, dtype=tf.int64)),
                             logdir, 1).save(checkpoint_number=7)

    common = [f"--model={key}", f"--logdir={logdir}", *TINY_MT, f"--params={overrides}"]
    trainer(*common, "--mode=decode", "--quiet")
    with open(os.path.join(logdir, "decode_test", "hypotheses.tsv"), encoding="utf-8") as f:
        decoded = [line.split("\t")[1] for line in f.read().splitlines()[1:]]
    exported = trainer(*common, "--mode=export")
    export_dir = os.path.join(logdir, "export", "7")
    assert "src_ids int32 [None, None] -> output_ids int32 [None, 16]" in exported.stdout

    batch = next(params.input.test.instantiate().dataset().as_numpy_iterator())
    np.save(tmp_path / "src_ids.npy", batch["src_ids"])
    served = json.loads(fresh_process(SERVE_TRANSLATIONS.format(export=export_dir), tmp_path).splitlines()[-1])
    assert len(served) == len(decoded) == 16
    assert served == decoded
    assert len(set(decoded)) > 1 and all(decoded)  # not a degenerate output that any model would match


def test_export_without_a_checkpoint_and_of_an_unknown_checkpoint_are_clear_errors(tmp_path):
    common = [sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlp", f"--logdir={tmp_path}"]
    result = subprocess.run([*common, "--mode=export"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and f"no checkpoint in {tmp_path}/checkpoints to export" in result.stderr
    missing = str(tmp_path / "nowhere" / "ckpt-5")
    result = subprocess.run([*common, "--mode=export", f"--checkpoint={missing}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and f"--checkpoint='{missing}' names no checkpoint" in result.stderr
    assert not os.path.exists(tmp_path / "export")

