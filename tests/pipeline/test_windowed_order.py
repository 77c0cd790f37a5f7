"""What the windowed loop lets a device run early, read from the loop body's graph: under an order whose weight
gradients run with their backward (1F1B, Interleaved), a chunk's backward of micro-batch i + 1 waits until micro-batch
i's weight gradients are in the sums, so no second weight gradient of a layer is computed early (one weight
gradient per layer at a time is what the memory plan counts); a split order's backward (zero bubble's B) does not
wait for the previous W, which is its point; and ZB-V's forwards wait for their device's other chunk's backward."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.schedule_base import PipelineLoss
from gpipe_tf.layers.base_layer import FPropContext
from tests.helpers.loss_in_pipeline import build, head_fn, schedule_params
from tests.helpers.pipeline_models import BATCH, mlp_layers

WIDTH = 6


@pytest.fixture(autouse=True)
def plain_layout(monkeypatch):
    """The graphs below are read op by op: the plain forward's ops, whatever the machine's layout rule."""
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", "plain")


def loop_body(schedule, order=None):
    """The windowed loop's body graph of a traced K=2, M=4 training step (under `order` instead of the schedule's
    own, if given)."""
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 4, "never", schedule_params(schedule, 2))
    if order is not None:
        layer.schedule.step_order = lambda k: order
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype("float32"))
    head = tf.Variable(rng.normal(size=(WIDTH,)).astype("float32"))
    targets = {"y": tf.constant(rng.normal(size=BATCH).astype("float32")), "w": tf.ones([BATCH])}

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            sums = layer.fprop_with_loss(layer.theta, x, PipelineLoss(head_fn, (head,), targets, tf.constant(1.0)),
                                         FPropContext(training=True))
        with placement.colocate_gradients():
            return tape.gradient(sums["loss"], layer.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    bodies = [graph._get_function(op.get_attr("body").name).graph for op in graph.get_operations()
              if op.type in ("While", "StatelessWhile")]
    assert len(bodies) == 1, bodies
    return bodies[0]


def ancestors(op):
    """Every op `op` waits for in its graph, by data or control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def sum_inputs_and_weight_matmuls(body):
    """{the loop variable holding a weight's gradient sum: the backward matmuls that compute that weight's
    gradient}: a sum is a body input that an add takes beside a backward MatMul's output."""
    found = {}
    for op in body.get_operations():
        if op.type not in ("AddV2", "Add") or "backward" not in op.name:
            continue
        a, b = (t.op for t in op.inputs)
        for summed, matmul in ((a, b), (b, a)):
            if summed.type == "Placeholder" and matmul.type == "MatMul":
                found.setdefault(summed, []).append(matmul)
    return found


def backward_input_gradient_matmuls(body):
    """The gradient MatMuls that no weight-gradient sum takes: the input gradients (B)."""
    weight = {m for ms in sum_inputs_and_weight_matmuls(body).values() for m in ms}
    return [op for op in body.get_operations()
            if op.type == "MatMul" and op.name.startswith("gradient_tape") and op not in weight]


@pytest.mark.parametrize("schedule", ["one_f_one_b", "interleaved"])
def test_an_unsplit_backward_waits_for_the_previous_weight_gradients(schedule):
    body = loop_body(schedule)
    found = sum_inputs_and_weight_matmuls(body)
    assert len(found) >= 4, found  # two chunks or more, a weight per layer
    for summed, matmuls in found.items():
        for matmul in matmuls:
            assert summed in ancestors(matmul), (summed.name, matmul.name)


def test_zero_bubbles_input_gradient_does_not_wait_for_the_previous_weight_gradients():
    body = loop_body("zero_bubble")
    sums = set(sum_inputs_and_weight_matmuls(body))
    assert sums
    matmuls = backward_input_gradient_matmuls(body)
    assert matmuls
    for matmul in matmuls:
        assert not sums & ancestors(matmul), matmul.name


def forward_copy_waits(body):
    """{chunk: how many ring tokens of the previous iteration (loop inputs) its forward's input copy waits
    for}: the copy's control inputs that are the body's placeholders."""
    found = {}
    for op in body.get_operations():
        if op.type == "Identity" and "/forward/" in op.name and op.control_inputs:
            scope = op.name.split("/forward/")[0].rsplit("_stage", 1)[-1]  # e.g. '0_1' of while/gpipe4_stage0_1
            waits = sum(1 for c in op.control_inputs if c.type == "Placeholder")
            found[scope] = max(found.get(scope, 0), waits)
    return found


def test_zero_bubble_vs_forwards_wait_for_the_other_chunks_backward_on_their_device():
    # ZB-V at K=2 without its backward waits: each chunk's forward waits for its in-flight ring and its weight
    # ring; with them (the schedule's order) each of the 4 chunks also waits for a ring its device's other chunk's
    # backward fills.
    import dataclasses

    from gpipe_tf.gpipe import orders
    windows_only = forward_copy_waits(loop_body("zero_bubble_v", dataclasses.replace(orders.zero_bubble_v(2),
                                                                                     backward_waits=())))
    with_waits = forward_copy_waits(loop_body("zero_bubble_v"))
    assert len(windows_only) == len(with_waits) == 4, (windows_only, with_waits)
    assert set(windows_only.values()) == {2}, windows_only
    assert {scope: n - windows_only[scope] for scope, n in with_waits.items()} == dict.fromkeys(with_waits, 1)
