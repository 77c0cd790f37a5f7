"""Exact resume with AdamW, Adafactor and weight EMA: checkpoint, SIGKILL, restart equals one uninterrupted run.

Each run is a real process (tests/helpers/optimizer_run.py) on a 2-stage float64 pipeline; every floating tensor of the
final checkpoint (weights, optimizer slots, weight averages) must agree to 1e-10. A resume with an optimizer whose
slots differ from the checkpoint's is refused in one line.
"""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.training import checkpoints
from gpipe_tf.training.adafactor import Adafactor
from gpipe_tf.training.optimizers import SGD, Adam, AdamW
from tests.helpers.paths import ROOT


def run(setup, logdir, max_steps, kill_after=None):
    script = os.path.join(ROOT, "tests", "helpers", "optimizer_run.py")
    args = [sys.executable, script, setup, str(logdir), str(max_steps)]
    if kill_after is not None:
        args.append(str(kill_after))
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_trainer_cli.py::test_resume_after_sigkill_is_exact",
    "tests/training/test_weight_ema.py::test_averaging_turned_on_when_resuming_starts_from_the_resumed_run",
))
@pytest.mark.parametrize("setup,slot_prefix", [("adamw", "optimizer/slots/"), ("adafactor", "optimizer/slots/"),
                                               ("adam_ema", "ema/averages/")])
def test_checkpoint_kill_restart_equals_one_uninterrupted_run(tmp_path, setup, slot_prefix):
    reference = run(setup, tmp_path / "ref", 8)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = run(setup, tmp_path / "killed", 8, kill_after=4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not os.path.exists(tmp_path / "killed" / "checkpoints" / "ckpt-8.index")
    resumed = run(setup, tmp_path / "killed", 8)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'killed'}/checkpoints/ckpt-4 at step 4" in resumed.stdout

    ref = tf.train.load_checkpoint(str(tmp_path / "ref" / "checkpoints" / "ckpt-8"))
    got = tf.train.load_checkpoint(str(tmp_path / "killed" / "checkpoints" / "ckpt-8"))
    dtypes = ref.get_variable_to_dtype_map()
    names = [n for n, d in dtypes.items() if d.is_floating]
    assert set(names) <= set(got.get_variable_to_dtype_map())
    assert sum(n.startswith("task/") for n in names) == 8 and any(n.startswith(slot_prefix) for n in names)
    for name in names:
        np.testing.assert_allclose(got.get_tensor(name), ref.get_tensor(name), rtol=0, atol=1e-10, err_msg=name)
    # The runs trained: the compared state is not the initialization.
    start = tf.train.load_checkpoint(str(tmp_path / "ref" / "checkpoints" / "ckpt-4"))
    assert any(not np.array_equal(start.get_tensor(n), ref.get_tensor(n)) for n in names if n.startswith("task/"))


def test_optimizer_slots_other_than_the_checkpoints_are_named_with_both_optimizers_and_the_way_on(tmp_path):
    task = experiment.resolve_params("toy.classifier.BlobsMlp")[0].task.instantiate()

    def with_optimizer(params):
        optimizer = params.instantiate()
        optimizer.build(task.trainable_variables)
        return tf.train.Checkpoint(task=task, optimizer=optimizer)

    path = with_optimizer(Adam.params()).write(str(tmp_path / "checkpoints" / "ckpt-2"))
    factored = Adafactor.params().set(min_dim_size_to_factor=8)  # the matrices' second moments as vr and vc
    for optimizer, name, slots in ((Adafactor.params(), "adafactor", "v"), (factored, "adafactor", "v, vc, vr"),
                                   (SGD.params(), "sgd", "none")):
        assert checkpoints.optimizer_mismatch(with_optimizer(optimizer), path) == (
            f"checkpoint {path} holds the slots of optimizer adam (m, v), this run's optimizer {name} keeps others "
            f"({slots}): the optimizer's slots differ from the checkpoint's, so its state cannot continue here; "
            f"resume with the run's own optimizer (adam: train.optimizer as in {tmp_path}/params.txt), or start a new "
            f"run from these weights with {name}: a new --logdir and --params=train.init_from.checkpoint={path} (a "
            "fine-tune: docs/fine_tuning.md#another-optimizer)")
    # AdamW keeps Adam's slots (its weight decay never enters them): it continues from them.
    assert checkpoints.optimizer_mismatch(with_optimizer(AdamW.params()), path) is None
    assert checkpoints.optimizer_mismatch(tf.train.Checkpoint(task=task), path) is None  # an evaluator's
    # The same optimizer with settings that shape other slots: said so, not "adafactor ... keeps others than adafactor".
    unfactored = with_optimizer(Adafactor.params()).write(str(tmp_path / "af" / "checkpoints" / "ckpt-2"))
    assert checkpoints.optimizer_mismatch(with_optimizer(factored), unfactored) == (
        f"checkpoint {unfactored} holds slots of optimizer adafactor of other names or shapes than this run's: "
        f"train.optimizer's settings differ from those in {tmp_path}/af/params.txt (e.g. a factoring threshold); "
        "resume with that run's settings, or start a new run from these weights: a new --logdir and "
        f"--params=train.init_from.checkpoint={unfactored} (a fine-tune: docs/fine_tuning.md#another-optimizer)")
