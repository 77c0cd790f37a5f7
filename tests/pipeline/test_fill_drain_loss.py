"""FillDrain runs the task's loss per micro-batch on its last chunk, as GPipe does: the head sees one micro-batch's
outputs at a time, in training and evaluation, and the backward loop keeps the output gradients, never the head's
logits. (The loss and gradients equal the un-pipelined model's: tests/pipeline/test_schedules.py.)"""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import orders, placement
from gpipe_tf.gpipe.fill_drain import FillDrain
from gpipe_tf.gpipe.schedule_base import PipelineLoss
from gpipe_tf.gpipe.unrolled import Unrolled
from gpipe_tf.layers.base_layer import FPropContext
from tests.helpers.loss_in_pipeline import build
from tests.helpers.pipeline_models import BATCH, mlp_layers

WIDTH = 6  # the MLP's output features
CLASSES = 37  # the head's logits: a width no other tensor has


def wide_head(rows_seen):
    """A softmax cross-entropy over CLASSES logits that records the rows of every output it is called on."""
    def fn(head, out, targets, ctx):
        rows_seen.append(out.shape[0])
        logits = tf.matmul(tf.cast(out, head[0].dtype), head[0])
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(targets["label"], logits)
        return {"loss": tf.reduce_sum(xent), "count": tf.cast(tf.size(xent), xent.dtype)}
    return fn


def inputs(dtype="float64"):
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype(dtype))
    targets = {"label": tf.constant(rng.integers(0, CLASSES, size=BATCH).astype(np.int32))}
    head = tf.Variable(rng.normal(size=(WIDTH, CLASSES)).astype(dtype))
    return x, targets, head


def step_fn(layer, head, fn, targets, training):
    """A traced training (loss and gradients) or evaluation (loss) step through `fprop_with_loss`."""
    @tf.function(autograph=False)
    def step(x):
        ctx = FPropContext(training=training)
        with tf.GradientTape() as tape:
            sums = layer.fprop_with_loss(layer.theta, x, PipelineLoss(fn, (head,), targets, tf.constant(0.5)), ctx)
            loss = sums["loss"] / sums["count"]
        if not training:
            return loss, []
        with placement.colocate_gradients():
            return loss, tape.gradient(loss, list(layer.trainable_variables) + [head])
    return step


@pytest.mark.parametrize("schedule,training,m", [("fill_drain", True, 1), ("fill_drain", True, 4),
                                                ("fill_drain", False, 4), ("one_f_one_b", False, 4)])
def test_the_head_sees_one_micro_batch_at_a_time(schedule, training, m):
    """Training and evaluation with FillDrain, and evaluation with a windowed schedule (its forward is FillDrain's
    loop)."""
    x, targets, head = inputs()
    rows = []
    layer = build(mlp_layers("float64", depth=4), "float64", 2, m, "never", schedule)
    loss, _ = step_fn(layer, head, wide_head(rows), targets, training)(x)
    # One trace of the values' shapes (a micro-batch), then the loop body's call.
    assert rows and set(rows) == {BATCH // m}, rows
    # The same loss as the whole batch's head on the un-pipelined model.
    reference = build(mlp_layers("float64", depth=4), "float64")
    logits = tf.matmul(reference.fprop(reference.theta, x, FPropContext()), head)
    expected = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets["label"], logits))
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-10)


def test_unrolled_still_runs_its_head_on_the_whole_batch():
    x, targets, head = inputs()
    rows = []
    layer = build(mlp_layers("float64", depth=4), "float64", 2, 4, "never", "unrolled")
    step_fn(layer, head, wide_head(rows), targets, True)(x)
    assert set(rows) == {BATCH}, rows


@pytest.mark.parametrize("remat", ["never", "always"])
def test_the_loops_keep_output_gradients_not_logits(remat):
    """The forward loop pushes what the backward needs; with the head in it, that is each micro-batch's output
    gradient (WIDTH wide), never a CLASSES-wide tensor of the head. The backward loop pushes nothing."""
    x, targets, head = inputs("float32")
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 4, remat, "fill_drain")
    graph = step_fn(layer, head, wide_head([]), targets, True).get_concrete_function(
        tf.TensorSpec(x.shape, x.dtype)).graph
    pushed = {}
    for op in graph.get_operations():
        if op.type in ("While", "StatelessWhile"):
            body = graph._get_function(op.get_attr("body").name).graph
            pushed[op.name] = [o.inputs[1].shape.as_list() for o in body.get_operations()
                               if o.type == "TensorListPushBack"]
    forward = [shapes for name, shapes in pushed.items() if not name.endswith("_grad")]
    backward = [shapes for name, shapes in pushed.items() if name.endswith("_grad")]
    assert len(forward) == 1 and len(backward) == 1, list(pushed)
    assert [BATCH // 4, WIDTH] in forward[0], forward[0]
    assert not any(shape and shape[-1] == CLASSES for shape in forward[0]), forward[0]
    assert backward[0] == [], backward[0]


def test_the_orders_say_where_the_head_runs():
    """The memory planner reads this: FillDrain's head works on one micro-batch at a time, Unrolled's on all M."""
    assert FillDrain(FillDrain.params()).step_order(2).head_per_micro_batch
    assert not Unrolled(Unrolled.params()).step_order(2).head_per_micro_batch
    # The plan and the speed plan name the schedule by its order's name.
    assert Unrolled(Unrolled.params()).step_order(2).name == "unrolled"
    assert orders.one_f_one_b(2).head_per_micro_batch


def test_the_rescale_of_a_tiny_seed_does_not_underflow_in_float16():
    """A fixed loss scale of 1e-9 over a normalizer seeds the in-loop backward with ~1e-11, zero in float16: the
    factor to the caller's gradient is divided in float32, so it is 1, not 0 / 0."""
    from gpipe_tf.gpipe.loop_parts import rescale
    seed = tf.constant(1e-9 / 24, tf.float32)
    assert float(rescale(seed, seed, tf.float16)) == 1.0
    assert float(rescale(2 * seed, seed, tf.float64)) == 2.0
    assert float(rescale(None, seed, tf.float16)) == 0.0


def test_a_batch_of_padding_only_gets_zero_gradients_not_nan():
    """The task seeds zeros when the normalizer is 0 (divide_no_nan) and its loss is 0 x the sum: the rescale of
    0 by 0 is 0, so every gradient is 0 (NaN before)."""
    x, targets, head = inputs("float32")
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 4, "never", "fill_drain")

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss_fn = PipelineLoss(wide_head([]), (head,), targets, tf.constant(0.0))
            sums = layer.fprop_with_loss(layer.theta, x, loss_fn, FPropContext(training=True))
            loss = sums["loss"] * 0.0
        with placement.colocate_gradients():
            return tape.gradient(loss, list(layer.trainable_variables) + [head])

    for g in step(x):
        np.testing.assert_array_equal(g.numpy(), np.zeros_like(g.numpy()))

