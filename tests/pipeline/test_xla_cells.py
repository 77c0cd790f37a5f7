"""`jit_compile=True`: every chunk's forward and backward compiled by XLA on its own device give the un-compiled
model's loss and gradients, for every schedule (batched W on and off), remat policy, K and M; the recompute
survives in the compiled backward; each cell runs on its stage's device; dropout masks are the same with and
without XLA."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.schedules import SCHEDULES as SCHEDULE_CLASSES
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from tests.helpers import tiers
from tests.helpers.loss_in_pipeline import DEPTH, assert_same, build, data, loss_and_grads
from tests.helpers.pipeline_models import BATCH, DEVICES, mlp_layers, placed_ops

BATCHED = "+batched_w"  # a schedule name with this suffix: its batch_weight_gradients=True
PLAIN = ["fill_drain", "unrolled", "one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v"]
SCHEDULES = PLAIN + [s + BATCHED for s in PLAIN if s != "unrolled"]  # Unrolled has no batched W


def micro_batches(schedule, k, m):
    """M as the grid names it; for Interleaved, which needs M a multiple of K, the largest multiple of K not above
    it, and K itself where M < K."""
    return max(k, m // k * k) if schedule.startswith("interleaved") else m


def knobs(schedule):
    """The schedule's Params for a grid name (Interleaved with 2 virtual stages)."""
    name = schedule.removesuffix(BATCHED)
    p = SCHEDULE_CLASSES[name].params().set(**({"virtual_stages": 2} if name == "interleaved" else {}))
    return p.set(batch_weight_gradients=True) if schedule.endswith(BATCHED) else p


@pytest.fixture(scope="module")
def reference():
    x, targets, head = data("float64")
    return x, targets, head, loss_and_grads(build(mlp_layers("float64", depth=DEPTH), "float64"), x, targets, head)


@pytest.mark.parametrize("schedule,remat,k,m", tiers.grid(
    corners=("schedule", "remat"), schedule=SCHEDULES, remat=["never", "always"], k=[1, 2, 3, 4], m=[1, 4, 8]))
def test_float64_compiled_cells_equal_unpipelined(reference, schedule, remat, k, m):
    x, targets, head, ref = reference
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", k, micro_batches(schedule, k, m), remat,
                  knobs(schedule), jit_compile=True)
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule,remat,k,m", tiers.sample(
    [(s, remat, 2, 4) for s in SCHEDULES for remat in ("never", "always")] + [("fill_drain", "always", 4, 8),
                                                                              ("zero_bubble_v", "never", 3, 8)],
    keep=[("fill_drain", "always", 4, 8), ("one_f_one_b", "never", 2, 4), ("zero_bubble_v", "always", 2, 4),
          ("zero_bubble" + BATCHED, "never", 2, 4)]))
def test_float32_compiled_cells_equal_unpipelined(schedule, remat, k, m):
    x, targets, head = data("float32", seed=2)
    ref = loss_and_grads(build(mlp_layers("float32", depth=DEPTH), "float32"), x, targets, head)
    layer = build(mlp_layers("float32", depth=DEPTH), "float32", k, micro_batches(schedule, k, m), remat,
                  knobs(schedule), jit_compile=True)
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["fill_drain", pytest.param("one_f_one_b", marks=tiers.EXHAUSTIVE)])
def test_dropout_masks_are_the_same_with_and_without_xla(schedule):
    x, targets, head = data("float64", seed=4)
    seed = tf.constant([5, 6], tf.int64)
    layers = mlp_layers("float64", dropout=0.3, depth=4)
    base = loss_and_grads(build(layers, "float64", 1, 4, "never", schedule), x, targets, head, seed)
    for k, remat in [(1, "never"), (4, "always"), (2, "never")]:
        got = loss_and_grads(build(layers, "float64", k, 4, remat, schedule, jit_compile=True), x, targets, head,
                             seed)
        assert_same(got, base, rtol=1e-10, atol=1e-12)
    no_dropout = loss_and_grads(build(mlp_layers("float64", depth=4), "float64", 1, 4), x, targets, head)
    assert abs(no_dropout[0] - base[0]) > 1e-6  # dropout really acted


def stage_cell(remat):
    """A 2-stage pipeline of 2 Linear layers per stage, and stage 1's cells with the arguments of one micro-batch."""
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 2, remat, jit_compile=True)
    x = tf.zeros([BATCH, 6])
    job, _ = layer._job(layer.theta, x, FPropContext(training=True))
    weights = list(job.chunk_weights[1])
    return job.compiled_chunks[1], weights, x[:BATCH // 2], [tf.ones([BATCH // 2, 6])]


def test_the_compiled_backward_keeps_the_recompute():
    """XLA drops a recompute ordered only by control dependencies; the backward cell computes its forward as the
    input of the gradients it returns. Two Linear layers: 2 matmuls forward, 4 for the gradients of input and
    weights, and 2 more for the recompute."""
    cell, weights, x, dys = stage_cell("always")
    forward = cell.forward_cell.experimental_get_compiler_ir(weights, x, None, False, 0)(stage="optimized_hlo")
    backward = cell.backward_cell.experimental_get_compiler_ir(weights, x, None, True, dys, 0)(stage="optimized_hlo")
    assert forward.count(" dot(") == 2
    assert backward.count(" dot(") == 6


def test_a_routing_backward_cell_leaves_the_weight_gradients_out():
    """Batched W: the backward cell of the same stage, its 2 matmuls routed, recomputes (2 dots) and computes the
    input gradients (2) but no weight gradient; the inputs and output gradients it returns per matmul give the
    weight gradients the plain backward cell computes."""
    cell, weights, x, dys = stage_cell("always")
    calls = cell.matmul_calls(weights, x, None)
    rows = BATCH // 2
    # The stage's weights are [b, w] per layer: the matmuls use weights 1 and 3.
    assert [(c.weight, c.rows, c.input_dim, c.output_dim) for c in calls] == [(1, rows, 6, 6), (3, rows, 6, 6)]
    placeholders = [tf.zeros([c.rows, d]) for c in calls for d in (c.input_dim, c.output_dim)]
    routed_ir = cell.backward_cell.experimental_get_compiler_ir(weights + placeholders, x, None, True, dys, 4)
    assert routed_ir(stage="optimized_hlo").count(" dot(") == 4
    plain = cell.backward_cell(weights, x, None, True, dys, 0)
    routed = cell.backward_cell(weights + placeholders, x, None, True, dys, 4)
    np.testing.assert_allclose(routed[0].numpy(), plain[0].numpy(), rtol=1e-6)  # the input gradient
    pairs = routed[1 + len(weights):]
    np.testing.assert_allclose(pairs[0].numpy(), x.numpy())  # the first matmul's input is the stage's input
    for n, j in enumerate((1, 3)):  # X^T dY of each matmul is its weight's gradient, which the cell left out
        np.testing.assert_allclose((tf.transpose(pairs[2 * n]) @ pairs[2 * n + 1]).numpy(), plain[1 + j].numpy(),
                                   rtol=1e-5, atol=1e-6)
        assert not np.any(routed[1 + j].numpy())
    for j in (0, 2):  # the biases keep their gradients
        np.testing.assert_allclose(routed[1 + j].numpy(), plain[1 + j].numpy(), rtol=1e-6)


def test_each_cell_runs_compiled_on_its_stage_device():
    layer = build(mlp_layers("float32", depth=8), "float32", 4, 4, "always", "one_f_one_b", jit_compile=True)
    x, targets, head = data("float32")
    ops = placed_ops(lambda: loss_and_grads(layer, x, targets, head), pipeline=layer)
    compiled = collections.defaultdict(set)
    for device, _, name, node in ops:
        if "_XlaMustCompile" in node.attr and node.attr["_XlaMustCompile"].b:
            stage = next(s for s, scope in enumerate(layer.stage_scopes) if scope in name)
            compiled[stage].add(device)
    # Each stage's forward and backward cells, on that stage's device and no other.
    assert dict(compiled) == {s: {d.split("device:")[-1]} for s, d in enumerate(DEVICES)}


def test_an_unrolled_schedule_compiles_one_program_per_chunk_and_direction(monkeypatch):
    layer = build(mlp_layers("float64", depth=4), "float64", 2, 4, "always", "unrolled", jit_compile=True)
    x, targets, head = data("float64")
    jobs = []
    original = GPipe._job

    def spy(self, theta, inputs, ctx):
        job, inputs = original(self, theta, inputs, ctx)
        jobs.append(job)
        return job, inputs

    monkeypatch.setattr(GPipe, "_job", spy)
    loss_and_grads(layer, x, targets, head)
    (job,) = jobs
    # 4 micro-batches through 2 chunks: one trace (one XLA program) per chunk and direction.
    assert [c.forward_cell.experimental_get_tracing_count() for c in job.compiled_chunks] == [1, 1]
    assert [c.backward_cell.experimental_get_tracing_count() for c in job.compiled_chunks] == [1, 1]


def test_jit_compile_errors_name_the_value_and_the_fix():
    with pytest.raises(ParamsError, match=r"net.jit_compile='yes' must be True or False"):
        build(mlp_layers("float32", depth=2), "float32", 2, 1, jit_compile="yes")


def test_bfloat16_trains_to_the_same_accuracy_with_xla(tmp_path):
    from tests.pipeline.test_precision import train_and_evaluate

    accuracy = {}
    for jit in (False, True):
        params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
        p = params.copy()
        p.task.fprop_dtype = "bfloat16"
        p.task.network.jit_compile = jit
        p.train.max_steps = 100
        _, lines = train_and_evaluate(str(tmp_path / str(jit)), p.freeze())
        line = next(line for line in lines if line.startswith("eval dev at step 100:") and "accuracy=" in line)
        accuracy[jit] = float(line.split("accuracy=")[1].split()[0])
    assert accuracy[False] > 0.9, accuracy
    assert abs(accuracy[True] - accuracy[False]) <= 0.01, accuracy


@pytest.mark.parametrize("fprop_dtype", ["bfloat16", "float16"])
def test_half_precision_cells_match_tensorflow_kernels(fprop_dtype):
    """Float32 weights, half-precision compute: the compiled cells' loss and float32 gradients against the same
    pipeline on TensorFlow's kernels, within the half precision's rounding."""
    x, targets, head = data("float32", seed=5)
    results = []
    for jit in (False, True):
        layer = GPipe.params().set(name="net", dtype="float32", fprop_dtype=fprop_dtype,
                                   layers=mlp_layers("float32", depth=4), num_stages=2, num_micro_batches=4,
                                   remat="always", devices=DEVICES[:2], jit_compile=jit).instantiate()
        results.append(loss_and_grads(layer, x, targets, head))
    plain, compiled = results
    assert all(g.dtype == np.float32 for g in compiled[1])
    tolerance = 2 ** -7 if fprop_dtype == "bfloat16" else 2 ** -10  # a few units in the last place
    assert_same(compiled, plain, rtol=8 * tolerance, atol=8 * tolerance)
