"""A pipelined training step keeps nothing on its devices between steps: its loops' gradient sums start from zeros
made when the step runs (`loop_parts.step_zeros`), not from constants that Grappler folds into the compiled
function, which held one weight-sized buffer per weight (under 10 MiB each) for the function's lifetime. Measured
with TensorFlow's BFC allocator, which must be chosen before TensorFlow starts: in a fresh process."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from gpipe_tf.gpipe import loop_parts

SCRIPT = r"""
import json, sys
import tensorflow as tf
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
from gpipe_tf import experiment
from gpipe_tf.training.learner import Learner
params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", gin_bindings=[
    "BlobsMlpGPipe.hidden_dims=(512, 512)", "BlobsMlpGPipe.input_dim=512", "BlobsMlpGPipe.batch_size=16"],
    overrides="task.network.num_stages=2,task.network.num_micro_batches=4,task.network.schedule=" + sys.argv[1]
              + ",train.optimizer=gpipe_tf.training.optimizers.SGD")
task = params.task.instantiate()
learner = Learner(task, params.train)
batch = next(iter(params.input.train.instantiate().dataset()))
current = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]
before = current()
for _ in range(2):
    float(learner.train_step(batch, tf.constant(False))["loss"])
weights = sum(v.shape.num_elements() * 4 for v in task.trainable_variables)
print(json.dumps({"kept": current() - before, "weights": weights}))
"""


@pytest.mark.parametrize("schedule", ["fill_drain", "one_f_one_b"])
def test_a_training_step_keeps_no_weight_sized_constants(schedule):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", SCRIPT, schedule], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # Before: every weight's zeros stayed (kept == weights); the step's own outputs are gone once it returns.
    assert figures["kept"] < figures["weights"] // 4, figures


def test_step_zeros_are_zeros_of_the_shape_and_dtype():
    z = loop_parts.step_zeros([3, 2], tf.bfloat16)
    assert z.dtype == tf.bfloat16 and z.shape == [3, 2]
    assert not bool(tf.reduce_any(tf.cast(z, tf.float32) != 0.0))
