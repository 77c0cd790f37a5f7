"""A device that runs out of memory ends training with one line naming the device, the pipeline stage, the planner's
predicted peak there and its suggestion, never TensorFlow's ResourceExhaustedError traceback.

The end-to-end test runs out of memory for real: an experiment of a user module puts on stage 1 a layer that also
fills a 64 GiB buffer (its size computed at run time, so TensorFlow cannot fold it into a constant), in a trainer
whose address space is capped at 16 GiB, so the allocator fails at once on any machine.
"""

import os
import sys
import textwrap

import pytest

from tests.helpers import tiers, trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import address_space_limit, one_error_line

# TensorFlow's own message for an allocation that failed on a stage's device (from a real run).
REAL_MESSAGE = ("OOM when allocating tensor with shape[16384,1048576] and type float on "
                "/job:localhost/replica:0/task:0/device:CPU:1 by allocator mklcpu\n\t [[{{node MatMul}}]]")

# TensorFlow's message for a folded constant of stage 1 that its allocator could not hold (from a real run).
CONSTANT_MESSAGE = """Graph execution error:

Detected at node while/gpipe0_stage1/Fill defined at (most recent call last):
<stack traces unavailable>
2 root error(s) found.
  (0) INVALID_ARGUMENT:  Cannot parse tensor from proto: goo.gle/debugonly
dtype: DT_FLOAT
tensor_shape {
  dim {
    size: 17179869184
  }
}
float_val: 1

\t [[{{node while/gpipe0_stage1/Fill}}]]
  (1) CANCELLED:  Function was cancelled before it was started
0 successful operations.
0 derived errors ignored. [Op:__inference__train_step_1492]"""

USER_MODULE = textwrap.dedent('''\
    """A pipelined MLP whose stage 1 asks its device for far more memory than it has."""

    import tensorflow as tf

    from gpipe_tf import model_registry
    from gpipe_tf.layers.linear import Linear
    from gpipe_tf.params.toy.classifier import BlobsMlpGPipe


    class Ballast(Linear):
        """A Linear layer that also fills a transient buffer of 2**30 floats per example."""

        folded = True

        def fprop(self, theta, inputs, ctx):
            n = tf.cast(tf.shape(inputs)[0], tf.int64) * 2 ** 30
            if not self.folded:  # a size TensorFlow cannot know before the step runs: allocated by the Fill op
                n += tf.cast(inputs[0, 0] * 0.0, tf.int64)
            return super().fprop(theta, inputs, ctx) + 0.0 * tf.reduce_sum(tf.fill([n], 1.0))


    class RuntimeBallast(Ballast):
        """Ballast whose buffer size is known only when the step runs."""

        folded = False


    @model_registry.register
    class HeavyMlp(BlobsMlpGPipe):
        """BlobsMlpGPipe with a Ballast as the last Linear layer (stage 1 of 2)."""

        max_steps = 3
        ballast = "Ballast"

        def task(self):
            p = super().task()
            layers = list(p.network.layers)
            layers[4] = layers[4].copy().set(cls=globals()[self.ballast])
            p.network.set(layers=layers, balance=[2, 4])
            return p
    ''')


def test_explain_names_the_stage_of_the_device_and_a_change():
    from gpipe_tf import experiment
    from gpipe_tf.memory import out_of_memory

    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    line = out_of_memory.explain(REAL_MESSAGE, params)
    assert line.startswith("out of memory on /job:localhost/replica:0/task:0/device:CPU:1 while allocating a "
                           "float32 tensor [16384x1048576], 64.0 GiB (task.network stage 1 of 2); the planner "
                           "predicts a peak of "), line
    assert "smallest change that fits 85% of that peak on every device: " in line, line
    assert "(--params=task.network." in line and "give --device_memory=SIZE" in line, line
    on_host = out_of_memory.explain(REAL_MESSAGE.replace("CPU:1", "CPU:7"), params)
    assert "no pipeline stage runs there" in on_host, on_host
    other = out_of_memory.explain("Ran out of memory in the queue", params)
    assert other.startswith("out of memory: Ran out of memory in the queue"), other


@pytest.mark.parametrize("message, expected", [
    (REAL_MESSAGE, {"shape": [16384, 1048576], "dtype": "float32", "bytes": 2 ** 36,
                    "device": "/job:localhost/replica:0/task:0/device:CPU:1"}),
    ("OOM when allocating tensor with shape[] and type bfloat16 on /device:GPU:0 by allocator GPU_0_bfc",
     {"shape": [], "dtype": "bfloat16", "bytes": 2, "device": "/device:GPU:0"}),
    ("resource exhausted: a queue is full", None),
])
def test_parse_reads_tensorflows_message(message, expected):
    from gpipe_tf.memory.out_of_memory import parse

    assert parse(message) == expected


def test_a_folded_constant_too_large_is_read_with_its_stage():
    from gpipe_tf import experiment
    from gpipe_tf.memory.out_of_memory import explain, parse_constant

    assert parse_constant(CONSTANT_MESSAGE) == {"shape": [2 ** 34], "dtype": "float32", "device": None,
                                                "bytes": 2 ** 36, "pipeline": 0, "stage": 1}
    assert parse_constant("Cannot parse the flags") is None
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    line = explain(CONSTANT_MESSAGE, params)
    assert line.startswith("out of memory while creating a float32 constant [17179869184], 64.0 GiB that TensorFlow "
                           "folded from a fixed-shape op (reported as 'Cannot parse tensor from proto') "
                           "(task.network stage 1 of 2); the planner predicts a peak of "), line


def test_same_device_matches_short_and_full_names():
    from gpipe_tf.memory.out_of_memory import same_device

    assert same_device("/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1")
    assert not same_device("/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:0")
    assert not same_device("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0")
    assert not same_device("/device:GPU:1", "/device:CPU:1")


@pytest.mark.parametrize("ballast, allocation", tiers.sample([
    ("RuntimeBallast", "on /job:localhost/replica:0/task:0/device:CPU:1 while allocating a float32 tensor"),
    ("Ballast", "while creating a float32 constant"),
], keep=[("RuntimeBallast", "on /job:localhost/replica:0/task:0/device:CPU:1 while allocating a float32 tensor")],
    ids=["runtime", "constant"]))
def test_training_that_runs_out_of_memory_ends_with_one_line(tmp_path, ballast, allocation):
    (tmp_path / "heavyexp.py").write_text(USER_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    logdir = tmp_path / "run"
    result = trainer_process.run(
        [sys.executable, "trainer.py", "--module=heavyexp", "--model=heavyexp.HeavyMlp", f"--logdir={logdir}",
         f"--gin_param=HeavyMlp.ballast='{ballast}'", "--device_memory=64KiB"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600, preexec_fn=address_space_limit(16 * 2 ** 30))
    # Warned before the first step: the planner alone already says 64 KiB is too little.
    assert "warning: the planner predicts task.network needs " in result.stdout, result.stdout
    assert "more than --device_memory=64KiB" in result.stdout, result.stdout
    line = one_error_line(result, code=1, only=False)
    assert line.startswith(f"trainer.py: error: out of memory {allocation} [17179869184], 64.0 GiB"), line
    assert "(task.network stage 1 of 2); the planner predicts a peak of " in line, line
    assert "fits --device_memory=64KiB" in line, line


def test_find_message_takes_either_kind_of_out_of_memory_from_a_chain():
    import tensorflow as tf

    from gpipe_tf.memory.out_of_memory import find_message

    def chained(inner):
        try:
            try:
                raise inner
            except Exception as e:
                raise RuntimeError("while tracing") from e
        except RuntimeError as outer:
            return outer

    assert find_message(chained(tf.errors.ResourceExhaustedError(None, None, REAL_MESSAGE))) == REAL_MESSAGE
    assert find_message(chained(tf.errors.InvalidArgumentError(None, None, CONSTANT_MESSAGE))) == CONSTANT_MESSAGE
    assert find_message(chained(tf.errors.InvalidArgumentError(None, None, "Incompatible shapes"))) is None
    assert find_message(ValueError("no TensorFlow error")) is None


def test_plan_warnings_name_the_devices_over_budget_and_the_change():
    from gpipe_tf import experiment
    from gpipe_tf.memory.head import task_head
    from gpipe_tf.memory.out_of_memory import plan_warnings
    from gpipe_tf.memory.plan import plan_pipeline

    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    plan = plan_pipeline(params.task.network, params.train, "task.network",
                         head=task_head(params.task, "task.network"))
    assert plan_warnings(params, plan["max_peak"], "X") == []
    budget = int(plan["max_peak"] * 0.9)
    [line] = plan_warnings(params, budget, "90%")
    assert line.startswith("warning: the planner predicts task.network needs "), line
    assert "more than --device_memory=90%; " in line, line
    assert "smallest change that fits --device_memory=90%: " in line or "no single change" in line, line
