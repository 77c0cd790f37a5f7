"""Batched weight gradients (B/W split, `batch_weight_gradients=True`): the deferred matmul's gradient parts, the
order data, and every windowed schedule equal to the un-pipelined model with W batched over the micro-batches; and
the default "auto", which batches the weights whose stash is no larger than the weight."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import batched_weights, orders, schedules
from gpipe_tf.gpipe.schedules import SCHEDULES
from gpipe_tf.gpipe.timeline import predict
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers import weight_gradients
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from gpipe_tf.memory.stash import stashed_micro_batches
from tests.helpers import tiers
from tests.helpers.deferred_matmul import sin_loss_gradients
from tests.helpers.loss_in_pipeline import DEPTH, INTERLEAVED, assert_same, build, data, head_fn, loss_and_grads
from tests.helpers.pipeline_models import DEVICES, mlp_layers

WINDOWED = ("one_f_one_b", "zero_bubble", "zero_bubble_v")
KNOBBED = WINDOWED + ("interleaved", "fill_drain")  # the schedules with batch_weight_gradients


def batched(name, **knobs):
    return SCHEDULES[name].params().set(batch_weight_gradients=True, **knobs)


# ---------------------------------------------------------------------------------------- the deferred matmul
@pytest.mark.parametrize("shape", [(5, 3), (2, 4, 3)])
def test_a_watched_matmul_leaves_its_weight_gradient_to_the_stash(shape):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=shape))
    w = tf.constant(rng.normal(size=(3, 4)))
    out = sin_loss_gradients(x, w)
    dx, batched_w = out["dx"], out["batched_w"]
    assert out["dw"] is None and [int(j) for j in out["weights"]] == [0]
    y = np.tensordot(x.numpy(), w.numpy(), axes=[[-1], [0]])
    dy = np.cos(y)
    np.testing.assert_allclose(dx.numpy(), np.tensordot(dy, w.numpy().T, axes=[[-1], [0]]), rtol=1e-12)
    np.testing.assert_allclose(batched_w.numpy(), x.numpy().reshape(-1, 3).T @ dy.reshape(-1, 4), rtol=1e-12)


def test_other_uses_of_a_watched_weight_keep_their_gradient_on_the_tape():
    rng = np.random.default_rng(1)
    x, w = tf.constant(rng.normal(size=(5, 3))), tf.constant(rng.normal(size=(3, 4)))
    out = sin_loss_gradients(x, w, extra_use=True)
    dw, batched_w = out["dw"], out["batched_w"]
    np.testing.assert_allclose(dw.numpy(), 2 * w.numpy(), rtol=1e-12)  # the sum(w^2) part only
    dy = np.cos(x.numpy() @ w.numpy())
    np.testing.assert_allclose(batched_w.numpy(), x.numpy().T @ dy, rtol=1e-12)


def test_outside_a_stash_or_for_an_unwatched_weight_matmul_is_the_plain_product():
    rng = np.random.default_rng(2)
    x, w, other = (tf.constant(rng.normal(size=s)) for s in [(5, 3), (3, 4), (3, 4)])
    stash = weight_gradients.WeightStash()
    with tf.GradientTape() as tape:
        tape.watch([w, other])
        with stash.watching([other]):
            y = weight_gradients.matmul(x, w)
    np.testing.assert_allclose(tape.gradient(y, w).numpy(), x.numpy().T @ np.ones((5, 4)), rtol=1e-12)
    assert stash.records == []


# -------------------------------------------------------------------------------------------- the order data
def test_batched_order_runs_w_after_each_stages_last_backward():
    order = orders.with_batched_weights(orders.zero_bubble(2))
    assert order.batched_weights and order.weight_window is None and order.phases == ("F", "B", "W")
    assert order.dependencies("W", 1, 0, 4) == [("B", 1, 3)]
    assert order.dependencies("W", 1, 2, 4) == [("B", 1, 3), ("W", 1, 1)]
    assert ("W", 0, 0) not in order.dependencies("F", 0, 3, 4)  # no weight window: forwards never wait for W
    drain = orders.with_batched_weights(orders.fill_drain(2))
    assert drain.dependencies("W", 0, 3, 4) == [("B", 0, 0), ("W", 0, 2)]  # GPipe's drain ends at micro-batch 0
    timeline = predict(order, 4, [1.0, 1.0])
    for s in range(2):
        last_b = max(c.end for c in timeline.cells if c.stage == s and c.phase == "B")
        assert min(c.start for c in timeline.cells if c.stage == s and c.phase == "W") >= last_b
    assert stashed_micro_batches(order, 8) == [8, 8]
    with pytest.raises(ParamsError, match="weight_window=.*batched_weights=True"):
        orders.ScheduleOrder("x", 2, in_flight=(2, 1), weight_window=(2, 1), batched_weights=True)


@pytest.mark.parametrize("name", KNOBBED)
def test_the_knob_is_true_false_or_auto_and_shows_in_the_order_and_the_name(name):
    assert schedules.step_order(batched(name), 2).batched_weights
    assert not schedules.step_order(name, 2).batched_weights  # "auto" keeps the schedule's order
    assert SCHEDULES[name].params().batch_weight_gradients == "auto"
    assert "batch_weight_gradients=True" in schedules.schedule_name(batched(name))
    off = SCHEDULES[name].params().set(batch_weight_gradients=False)
    assert "batch_weight_gradients=False" in schedules.schedule_name(off)
    assert "batch_weight_gradients" not in schedules.schedule_name(name)
    with pytest.raises(ParamsError, match=r"batch_weight_gradients='yes' must be True, False or 'auto': use True "):
        SCHEDULES[name].params().set(batch_weight_gradients="yes").instantiate("net")


def _call(rows, in_dim, out_dim, weight=0):
    return weight_gradients.MatmulCall(weight, rows, in_dim, out_dim, tf.float32)


def test_auto_batches_a_weight_when_its_operands_over_all_micro_batches_fit_in_the_weight():
    # 2048 x 2048, 2 rows per micro-batch, M=8: 8 * 2 * 4096 = 65,536 elements of x and dy against 4,194,304.
    assert batched_weights.worth_batching([_call(2, 2048, 2048)], 8)
    # A Transformer's FFN at 256 rows, M=8: 8 * 256 * 2560 = 5,242,880 against 1,048,576.
    assert not batched_weights.worth_batching([_call(256, 512, 2048)], 8)
    # The bound itself, and a weight used twice counts both uses.
    assert batched_weights.worth_batching([_call(3, 48, 48)], 8)
    assert not batched_weights.worth_batching([_call(3, 48, 48), _call(3, 48, 48)], 8)
    assert not batched_weights.worth_batching([_call(None, 2048, 2048)], 8)  # rows unknown when traced


def mixed_layers():
    """Two 48 x 48 weights that "auto" batches at 3 rows and M=8 (8 * 3 * 96 = 48 * 48), between two it does not."""
    from gpipe_tf.layers.linear import Linear

    return [Linear.params().set(input_dim=i, output_dim=o, activation="tanh")
            for i, o in [(6, 48), (48, 48), (48, 48), (48, 6)]]


@pytest.mark.parametrize("schedule", ["fill_drain", "one_f_one_b", "zero_bubble", "zero_bubble_v"])
def test_auto_batches_the_weights_whose_stash_fits_and_keeps_the_math(schedule, caplog):
    x, targets, head = data("float64")
    ref = loss_and_grads(build(mixed_layers(), "float64"), x, targets, head)
    caplog.set_level("INFO")
    layer = build(mixed_layers(), "float64", 2, 8, "never", schedule)  # BATCH 24 / M 8 = 3 rows
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-10, atol=1e-12)
    assert "batch_weight_gradients='auto' batches the weight gradients of 2 of 4 matmul weights" in caplog.text
    outside = [op for op in _step_graph(layer, x, targets, head).get_operations()
               if op.type == "MatMul" and op.get_attr("transpose_a")]
    assert len(outside) == 2 and all("batched_weight_gradients" in op.name for op in outside), outside
    assert all(op.inputs[0].shape[-1] == 48 and op.inputs[1].shape[-1] == 48 for op in outside)


@pytest.mark.parametrize("schedule,whole_step", [("fill_drain", False), ("zero_bubble", False),
                                                 ("fill_drain", True), ("zero_bubble", True)])
def test_auto_batches_nothing_under_xla(schedule, whole_step):
    # XLA stage cells (the pipeline's jit_compile), or the whole step compiled (train.jit_compile).
    x, targets, head = data("float64")
    layer = build(mixed_layers(), "float64", 2, 8, "never", schedule, jit_compile=not whole_step)
    outside = [op for op in _step_graph(layer, x, targets, head, jit_compile=whole_step).get_operations()
               if op.type == "MatMul" and op.get_attr("transpose_a")]
    assert not outside


# ------------------------------------------------------------------------------------ equal to the reference
@pytest.fixture(scope="module")
def reference():
    x, targets, head = data("float64")
    return x, targets, head, loss_and_grads(build(mlp_layers("float64", depth=DEPTH), "float64"), x, targets, head)


@pytest.mark.parametrize("schedule,remat,k,m", tiers.grid(
    corners=("schedule", "remat", "k"), schedule=["fill_drain", "one_f_one_b", "zero_bubble", "zero_bubble_v"],
    remat=["never", "always"], k=[1, 2, 3, 4], m=[1, 2, 4, 8]))
def test_mlp_float64_with_batched_w_equals_unpipelined(reference, k, m, remat, schedule):
    x, targets, head, ref = reference
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", k, m, remat, batched(schedule))
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("remat,km", tiers.sample(
    [(remat, km) for remat in ("never", "always") for km in INTERLEAVED],
    keep=[("never", (1, 1)), ("always", (1, 8)), ("always", (4, 4)), ("never", (4, 8))]))
def test_mlp_float64_interleaved_with_batched_w(reference, remat, km):
    x, targets, head, ref = reference
    k, m = km
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", k, m, remat, batched("interleaved"))
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-10, atol=1e-12)


def transformer_layers(num=4):
    return [TransformerEncoderLayer.params().set(model_dim=8, num_heads=2, hidden_dim=12) for _ in range(num)]


@pytest.mark.parametrize("schedule,k,m,remat", tiers.sample(
    [("zero_bubble", 2, 4, "never"), ("zero_bubble_v", 2, 2, "always"), ("fill_drain", 2, 4, "never"),
     ("fill_drain", 3, 2, "always")], keep=[("zero_bubble_v", 2, 2, "always")]))
def test_transformer_stack_with_batched_w_equals_unpipelined(schedule, k, m, remat):
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(8, 5, 8)))
    targets = {"y": tf.constant(rng.normal(size=(8,))), "w": tf.constant(rng.uniform(size=(8,)))}
    head = tf.Variable(rng.normal(size=(40,)))
    ref = loss_and_grads(build(transformer_layers(), "float64"), x, targets, head)
    got = loss_and_grads(build(transformer_layers(), "float64", k, m, remat, batched(schedule)), x, targets, head)
    assert_same(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule,batch,jit,remat", [
    ("fill_drain", True, False, "never"), ("fill_drain", False, False, "never"), ("zero_bubble", True, False, "never"),
    ("zero_bubble", False, False, "never"), ("fill_drain", True, True, "always"), ("zero_bubble", True, True, "never"),
    ("zero_bubble", False, True, "never"),
    pytest.param("fill_drain", True, True, "never", marks=tiers.EXHAUSTIVE),
    pytest.param("zero_bubble", True, True, "always", marks=tiers.EXHAUSTIVE)])
def test_no_loop_computes_a_weight_gradient_matmul_the_step_computes_each_once(schedule, batch, jit, remat):
    """With batched W each Linear weight (DEPTH of them) gets one X^T dY matmul, outside every loop, on its stage's
    device, and no loop body (nor XLA cell, with jit_compile) holds one; per micro-batch, the loop bodies (or the
    cells and their gradients) hold them all."""
    x, targets, head = data("float64")
    knobs = SCHEDULES[schedule].params().set(batch_weight_gradients=batch)
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", 2, 4, remat, knobs, jit_compile=jit)
    graph = _step_graph(layer, x, targets, head)

    def weight_matmuls(ops):
        return [op for op in ops if op.type == "MatMul" and op.get_attr("transpose_a")]
    in_loops = weight_matmuls([op for fn in graph._functions.values() for op in fn.graph.get_operations()])
    outside = weight_matmuls(graph.get_operations())
    if not batch:
        assert len(in_loops) == DEPTH and not outside
        return
    assert not in_loops and len(outside) == DEPTH
    assert all("batched_weight_gradients" in op.name for op in outside)
    assert {op.device.split("device:")[-1] for op in outside} == {d.split("device:")[-1] for d in DEVICES[:2]}


def _step_graph(layer, x, targets, head, jit_compile=False):
    from gpipe_tf.gpipe.schedule_base import PipelineLoss
    from gpipe_tf.layers.base_layer import FPropContext

    @tf.function(autograph=False, jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            loss = PipelineLoss(head_fn, (head,), targets, tf.constant(1.0, tf.float32))
            total = layer.fprop_with_loss(layer.theta, x, loss, FPropContext(training=True))["loss"]
        return tape.gradient(total, layer.trainable_variables)

    return step.get_concrete_function(x).graph


@pytest.mark.parametrize("schedule", ["fill_drain", "zero_bubble"])
def test_the_graph_with_batched_w_does_not_grow_with_m(schedule):
    from tests.helpers.pipeline_models import count_ops

    x, targets, head = data("float64")
    counts = []
    for m in (2, 8):
        layer = build(mlp_layers("float64", depth=DEPTH), "float64", 2, m, "never", batched(schedule))
        counts.append(count_ops(_step_graph(layer, x, targets, head)))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("schedule", ["fill_drain", "zero_bubble", "zero_bubble_v"])
def test_a_devices_batched_w_gather_one_weight_after_another(schedule):
    """Each batched W's blocks (the gathers or stacks that copy its micro-batches' x and dy) wait for the previous
    W on the device, across its chunks: the device's W form one chain, so one weight's copies are alive at a time
    (made at once, every weight's copies of a whole stash could be)."""
    x, targets, head = data("float64")
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", 2, 4, "never", batched(schedule))
    graph = _step_graph(layer, x, targets, head)
    scope = {op.name: op for op in graph.get_operations() if "batched_weight_gradients" in op.name}
    w_ops = {name for name, op in scope.items() if op.type == "MatMul" and op.get_attr("transpose_a")}
    blocks = [op for op in scope.values() if op.type in ("TensorListGather", "TensorListStack")]
    assert len(w_ops) == DEPTH and len(blocks) == 2 * DEPTH

    def awaited(op, seen):
        """The W ops `op` waits for, through data and control edges inside the scope."""
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent.name in scope and parent.name not in seen:
                seen.add(parent.name)
                awaited(parent, seen)
        return seen & w_ops

    def device(op):
        return op.device.split("device:")[-1]

    for d in {device(scope[name]) for name in w_ops}:
        n = sum(device(scope[name]) == d for name in w_ops)
        # The k-th W of the device's chain (from 0) waits for the k before it: both its blocks do.
        counts = sorted(len(awaited(op, set())) for op in blocks if device(op) == d)
        assert counts == sorted(2 * list(range(n))), (d, counts)
