"""`train.jit_compile`: the whole step as one XLA program trains as the un-compiled step does, on one device, and
what XLA would silently get wrong is refused while the step is traced."""

from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe import schedules
from gpipe_tf.gpipe.schedule_base import PipelineLoss
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.training import xla_step
from gpipe_tf.training.learner import Learner
from tests.helpers import tiers
from tests.helpers.loss_in_pipeline import build, data, head_fn
from tests.helpers.pipeline_models import DEVICES, mlp_layers

ONE_DEVICE = [DEVICES[0], DEVICES[0]]  # two stages on one device


def losses(key, overrides, steps):
    """The losses of `steps` training steps of experiment `key` (same seeds every time)."""
    params, _ = experiment.resolve_params(key, overrides=overrides)
    task = params.task.instantiate()
    learner = Learner(task, params.train)
    batches = iter(params.input.train.instantiate().dataset())
    return [float(learner.train_step(next(batches), tf.constant(False))["loss"]) for _ in range(steps)]


# The default experiment's compiled step takes XLA 40 s to build on a 2-core machine: the exhaustive tier's.
@pytest.mark.parametrize("key,overrides", [
    pytest.param("mt.number_words.NumbersTiny", "task.network.num_stages=1,task.network.num_micro_batches=1",
                 marks=tiers.EXHAUSTIVE),
    ("toy.classifier.BlobsMlp", ""),
    ("toy.classifier.BlobsMlpGPipe", f"task.network.devices={ONE_DEVICE},task.network.jit_compile=True"),
])
def test_the_compiled_step_trains_as_the_uncompiled_one(key, overrides):
    plain = losses(key, overrides, 20)
    compiled = losses(key, ",".join(filter(None, [overrides, "train.jit_compile=True"])), 20)
    np.testing.assert_allclose(compiled, plain, rtol=1e-4, atol=1e-4)
    assert plain[-1] < plain[0]  # it trained


def test_variables_on_several_devices_are_refused():
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides="train.jit_compile=True")
    task = params.task.instantiate()
    with pytest.raises(ConfigError, match=r"variables are on 2 devices \(/device:CPU:0, /device:CPU:1\): put every "
                                          r"stage on one device .*task.network.jit_compile=True"):
        Learner(task, params.train)


def test_stages_on_two_workers_are_two_devices():
    """Each TensorFlow worker's CPU:0 is a device of its own: stages on two workers are refused too."""
    on = [SimpleNamespace(device=f"/job:worker/replica:0/task:{t}/device:CPU:0") for t in (0, 1)]
    with pytest.raises(ConfigError, match=r"on 2 devices \(/job:worker/replica:0/task:0/device:CPU:0, "
                                          r"/job:worker/replica:0/task:1/device:CPU:0\)"):
        xla_step.check_one_device(on, [])
    xla_step.check_one_device(on[:1] + [SimpleNamespace(device=on[0].device)], [])  # one worker: accepted


def test_remat_ordered_by_control_dependencies_is_refused():
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe",
                                          overrides=f"task.network.devices={ONE_DEVICE},train.jit_compile=True")
    task = params.task.instantiate()
    with pytest.raises(ConfigError, match=r"task.network.remat='always': XLA drops a recompute .* set "
                                          r"task.network.jit_compile=True .* or task.network.remat='never'"):
        Learner(task, params.train)


def test_a_dynamic_size_tensor_array_is_refused_before_it_runs():
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides=(
        f"task.network.devices={ONE_DEVICE},task.network.remat='never',train.jit_compile=True"))
    p = params.copy()
    p.task.network.schedule = schedules.schedule_params("one_f_one_b").set(batch_weight_gradients=True)
    learner = Learner(p.task.instantiate(), p.train)
    batch = next(iter(p.input.train.instantiate().dataset()))
    with pytest.raises(ConfigError, match=r"writes a TensorArray of dynamic size .*batch_weight_gradients"):
        learner.train_step(batch, tf.constant(False))
    assert int(learner.global_step.numpy()) == 0  # refused while traced: nothing ran


def test_jit_compile_must_be_a_bool():
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlp")
    p = params.copy()
    p.train.jit_compile = "yes"
    with pytest.raises(ParamsError, match=r"train.jit_compile='yes' must be True or False"):
        Learner(p.task.instantiate(), p.train)


def step_of(layer, head, targets):
    """The loss-in-pipeline gradient step of `layer`: a function of the batch alone."""
    def step(x):
        with tf.GradientTape() as tape:
            loss = PipelineLoss(head_fn, (head,), targets, tf.constant(1.0))
            total = layer.fprop_with_loss(layer.theta, x, loss, FPropContext(training=True))["loss"]
        return tape.gradient(total, layer.trainable_variables)
    return step


@pytest.mark.parametrize("schedule,plain_dots,remat_dots", [("unrolled", 22, 30), ("one_f_one_b", 11, 15)])
def test_the_whole_compiled_step_keeps_the_recompute(schedule, plain_dots, remat_dots):
    """4 Linear layers on one stage, the data batch needing no gradient. Per micro-batch: 4 forward matmuls, 3 for
    input gradients, 4 for weight gradients; remat adds 4. Unrolled repeats them for M=2 micro-batches, a loop
    (1F1B) holds them once. Without the stage cells' data dependency XLA merged the recompute into the forward."""
    x, targets, head = data("float32")
    dots = {}
    for remat in ("never", "always"):
        layer = build(mlp_layers("float32", depth=4), "float32", 1, 2, remat, schedule, jit_compile=True)
        step = tf.function(step_of(layer, head, targets), jit_compile=True, autograph=False)
        hlo = step.experimental_get_compiler_ir(x)(stage="optimized_hlo")
        dots[remat] = hlo.count(" dot(")
    assert dots == {"never": plain_dots, "always": remat_dots}
