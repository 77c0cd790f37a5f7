"""--mode=export: a SavedModel loaded with tf.saved_model.load in a fresh process (no gpipe_tf imported there)
gives the trainer's own results in each compute dtype: a classifier's eval metrics, a translation model's
--mode=decode output. Export faults (a read-only directory, a full disk, partial exports left by killed processes)
are one error line, exit 2, and leave nothing behind."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.training import checkpoints, partial_dir
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.summaries import read_scalars
from tests.helpers import tiers, trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import file_size_limit, one_error_line


def trainer(*args):
    result = trainer_process.run([sys.executable, "trainer.py", *args], cwd=ROOT, capture_output=True, text=True,
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
@pytest.mark.parametrize("model, dtype", tiers.sample(
    [("BlobsMlpGPipe", "float32"), ("BlobsMlpGPipe", "bfloat16"), ("BlobsMlpGPipe", "float16"),
     ("BlobsMlp", "bfloat16")], keep=[("BlobsMlpGPipe", "float16")]))
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


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_export.py::test_classifier_export_matches_the_trainers_eval",
    "tests/cli/test_decode.py::test_decode_mode_writes_hypotheses_and_scalars",
))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_translation_export_matches_greedy_decode(tmp_path, dtype):
    key, logdir = "mt.number_words.NumbersTiny", str(tmp_path / "run")
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
    result = trainer_process.run([*common, "--mode=export"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and f"no checkpoint in {tmp_path}/checkpoints to export" in result.stderr
    missing = str(tmp_path / "nowhere" / "ckpt-5")
    result = trainer_process.run([*common, "--mode=export", f"--checkpoint={missing}"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
    assert result.returncode == 2 and f"--checkpoint='{missing}' names no checkpoint" in result.stderr
    assert not os.path.exists(tmp_path / "export")


# Export faults: real trainer subprocesses on a real checkpoint of BlobsMlp (written in-process: no training needed).

FAULT_KEY = "toy.classifier.BlobsMlp"


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A logdir holding BlobsMlp's ckpt-5 as the trainer lays it out; each test works on its own copy."""
    logdir = str(tmp_path_factory.mktemp("checkpointed") / "run")
    params, _ = experiment.resolve_params(FAULT_KEY)
    logdir_lib.prepare(logdir, params)
    checkpoints.make_manager(tf.train.Checkpoint(task=params.task.instantiate(),
                                                 global_step=tf.Variable(5, dtype=tf.int64)),
                             logdir, 1).save(checkpoint_number=5)
    return logdir


@pytest.fixture
def run_copy(checkpointed, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(checkpointed, logdir)
    return logdir


def export_run(logdir, *args, preexec_fn=None):
    return trainer_process.run([sys.executable, "trainer.py", f"--model={FAULT_KEY}", f"--logdir={logdir}",
                                "--mode=export", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                               preexec_fn=preexec_fn)


def leftovers(directory):
    """Partial exports (`*.partial-PID`) in `directory`."""
    return sorted(name for name in os.listdir(directory) if ".partial-" in name)


_libc = ctypes.CDLL(None, use_errno=True)
_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 24, 1, 2


def _obeying_permissions():
    """preexec_fn: the child obeys file permissions even as root, so a 0555 directory is read-only to it.

    Root passes permission checks by two capabilities; dropped from the bounding set before exec, the trainer
    process never has them (a non-root user never has them either: nothing to drop)."""
    if os.geteuid() != 0:
        return
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


@pytest.mark.parametrize("where", ["export_dir", "logdir"])
def test_export_into_a_read_only_directory_is_one_line_naming_it(run_copy, tmp_path, where):
    read_only = str(tmp_path / "read_only") if where == "export_dir" else run_copy
    os.makedirs(read_only, exist_ok=True)
    target = os.path.join(read_only, "served") if where == "export_dir" else os.path.join(run_copy, "export", "5")
    mode = os.stat(read_only).st_mode
    os.chmod(read_only, 0o555)
    try:
        result = export_run(run_copy, *([f"--export_dir={target}"] if where == "export_dir" else []),
                            preexec_fn=_obeying_permissions)
    finally:
        os.chmod(read_only, mode)
    line = one_error_line(result)
    assert f"cannot write to {target}: Permission denied" in line, line
    assert f"make {read_only} writable" in line and "--export_dir=" in line, line
    assert not os.path.exists(target) and leftovers(read_only) == []


# Fails at the 4 KiB probe / inside tf.saved_model.save.
@pytest.mark.parametrize("limit", tiers.sample([4000, 16384], keep=[16384]))
def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(run_copy, tmp_path, limit):
    target = str(tmp_path / "served")
    line = one_error_line(export_run(run_copy, f"--export_dir={target}", preexec_fn=file_size_limit(limit)),
                          only=False)  # TensorFlow warns of the failed write
    assert f"cannot write to {target}: File too large; free disk space" in line, line
    assert not os.path.exists(target) and leftovers(tmp_path) == []
    # The same command with room to write exports.
    assert export_run(run_copy, f"--export_dir={target}").returncode == 0
    assert os.path.isfile(os.path.join(target, "saved_model.pb")) and leftovers(tmp_path) == []


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_partial_exports_left_by_dead_processes_are_removed_and_running_ones_kept(run_copy, tmp_path):
    exports = os.path.join(run_copy, "export")
    dead = _dead_pid()
    stale = [os.path.join(exports, f"5.partial-{dead}"), os.path.join(exports, f"3.partial-{dead}"),
             str(tmp_path / f"served.partial-{dead}")]
    for path in stale:
        os.makedirs(os.path.join(path, "variables"))
        with open(os.path.join(path, "variables", "variables.data-00000-of-00001"), "wb") as f:
            f.write(b"half a SavedModel")
    # Two exports in progress: one of a running process (that has not locked it yet), one locked by a running
    # process under a pid that is not running here (as from another machine sharing the directory).
    locked = os.path.join(exports, f"7.partial-{_dead_pid()}")
    os.makedirs(locked)
    holder = subprocess.Popen(
   [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
    "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", locked],
   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live = [os.path.join(exports, f"5.partial-{holder.pid}"), locked]
        os.makedirs(live[0])
        assert holder.stdout.readline() == "locked\n"

        # --export_dir: the stale partial of that target goes; the logdir's partials are not its business.
        served = str(tmp_path / "served")
        result = export_run(run_copy, f"--export_dir={served}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"removed 1 partial export(s) of processes that ended: {stale[2]}" in result.stdout
        assert leftovers(tmp_path) == [] and os.path.isfile(os.path.join(served, "saved_model.pb"))
        assert leftovers(exports) == sorted(os.path.basename(p) for p in stale[:2] + live)

        # The default target: every stale partial export of the logdir goes, those in progress stay.
        result = export_run(run_copy)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"removed 2 partial export(s) of processes that ended: {stale[1]}, {stale[0]}" in result.stdout
        assert sorted(os.listdir(exports)) == sorted(["5"] + [os.path.basename(p) for p in live])
        assert os.path.isfile(os.path.join(exports, "5", "saved_model.pb"))
    finally:
        holder.stdin.close()
        holder.wait()


def test_file_system_errors_of_the_writer_are_config_errors_and_others_propagate(tmp_path):
    target = str(tmp_path / "out")

    def no_space(partial):
        os.makedirs(os.path.join(partial, "variables"))
        raise tf.errors.ResourceExhaustedError(
            None, None, f"{{{{function_node __wrapped__SaveV2}}}} {partial}/variables/x.tempstate1; No space left "
            "on device [Op:SaveV2]")

    with pytest.raises(ConfigError) as raised:
        partial_dir.write_atomically(target, no_space, fix="free disk space")
    assert str(raised.value) == f"cannot write to {target}: No space left on device; free disk space"

    def bug(partial):
        raise tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]")

    with pytest.raises(tf.errors.InvalidArgumentError):
        partial_dir.write_atomically(target, bug, fix="free disk space")
    assert os.listdir(tmp_path) == []
