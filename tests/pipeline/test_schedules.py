"""Every schedule with the loss in the pipeline equals the un-pipelined model: FillDrain, OneForwardOneBackward,
ZeroBubble, ZeroBubbleV and Interleaved, K in 1..4, M in {1, 2, 4, 8}, both remat policies, float64 and float32,
the MLP and the conv stack."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.interleaved import Interleaved
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.schedule_base import PipelineLoss
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from tests.helpers import tiers
from tests.helpers.loss_in_pipeline import (
    DEPTH,
    INTERLEAVED,
    assert_same,
    build,
    data,
    head_fn,
    loss_and_grads,
    schedule_params,
)
from tests.helpers.pipeline_models import BATCH, DEVICES, conv_layers, count_ops, mlp_layers, placed_ops


@pytest.fixture(scope="module")
def reference():
    x, targets, head = data("float64")
    return x, targets, head, loss_and_grads(build(mlp_layers("float64", depth=DEPTH), "float64"), x, targets, head)


@pytest.mark.parametrize("schedule,remat,k,m", tiers.grid(
    corners=("schedule", "remat", "k"), schedule=["fill_drain", "one_f_one_b", "zero_bubble", "zero_bubble_v"],
    remat=["never", "always"], k=[1, 2, 3, 4], m=[1, 2, 4, 8]))
def test_mlp_float64_loss_in_pipeline_equals_unpipelined(reference, k, m, remat, schedule):
    x, targets, head, ref = reference
    got = loss_and_grads(build(mlp_layers("float64", depth=DEPTH), "float64", k, m, remat, schedule), x, targets,
                         head)
    assert_same(got, ref, rtol=1e-10, atol=1e-12)




# Default tier: both remat policies at K=1 and K=4, both v, and K=3's odd multiple.
@pytest.mark.parametrize("v,remat,km", tiers.sample(
    [(v, remat, km) for v in (2, 3) for remat in ("never", "always") for km in INTERLEAVED],
    keep=[(2, "never", (1, 1)), (3, "always", (1, 8)), (3, "never", (4, 4)), (2, "always", (4, 8)),
          (2, "never", (3, 3))]))
def test_mlp_float64_interleaved_equals_unpipelined(reference, km, remat, v):
    x, targets, head, ref = reference
    k, m = km
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", k, m, remat, schedule_params("interleaved", v))
    assert layer.plan.num_chunks == v * k
    assert [layer.plan.devices[0][s] for s in range(v * k)] == [DEVICES[s % k] for s in range(v * k)]
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule,v,k,m,remat", tiers.sample(
    [(schedule, v, k, m, remat) for schedule, v in [("one_f_one_b", None), ("interleaved", 2), ("fill_drain", None),
                                                   ("zero_bubble", None), ("zero_bubble_v", None)]
     for k, m, remat in [(2, 4, "never"), (4, 8, "always"), (2, 8, "always")]],
    keep=[("one_f_one_b", None, 2, 4, "never"), ("interleaved", 2, 4, 8, "always"),
          ("fill_drain", None, 2, 8, "always"), ("zero_bubble", None, 4, 8, "always"),
          ("zero_bubble_v", None, 2, 4, "never")]))
def test_mlp_float32_equals_unpipelined(k, m, remat, schedule, v):
    x, targets, head = data("float32", seed=2)
    ref = loss_and_grads(build(mlp_layers("float32", depth=DEPTH), "float32"), x, targets, head)
    got = loss_and_grads(build(mlp_layers("float32", depth=DEPTH), "float32", k, m, remat,
                               schedule_params(schedule, v)), x, targets, head)
    assert_same(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule,v,k,m,remat", tiers.sample(
    [(schedule, v, k, m, remat) for schedule, v in [("one_f_one_b", None), ("interleaved", 2), ("zero_bubble", None),
                                                   ("zero_bubble_v", None)]
     for k, m, remat in [(1, 1, "never"), (2, 4, "always"), (2, 2, "never"), (3, 3, "always")]],
    keep=[("one_f_one_b", None, 3, 3, "always"), ("interleaved", 2, 2, 4, "always"),
          ("zero_bubble", None, 1, 1, "never"), ("zero_bubble_v", None, 2, 2, "never")]))
def test_conv_pair_stack_changes_shape_and_equals_unpipelined(k, m, remat, schedule, v):
    if schedule in ("interleaved", "zero_bubble_v") and 2 * k > 5:
        k = 2  # the stack has 5 layers: at most 2 devices of 2 chunks
        m = 2 * m if m % 2 and schedule == "interleaved" else m
    rng = np.random.default_rng(3)
    x = (tf.constant(rng.normal(size=(BATCH, 8, 8, 2))), tf.constant(rng.normal(size=(BATCH, 8, 8, 2))))
    targets = {"y": tf.constant(rng.normal(size=(BATCH,))), "w": tf.constant(rng.uniform(size=(BATCH,)))}
    head = tf.Variable(rng.normal(size=(2 * 2 * 5,)))
    ref = loss_and_grads(build(conv_layers("float64"), "float64"), x, targets, head)
    got = loss_and_grads(build(conv_layers("float64"), "float64", k, m, remat, schedule_params(schedule, v)), x,
                         targets, head)
    assert_same(got, ref, rtol=1e-10, atol=1e-12)


def test_dropout_is_identical_across_schedules_and_k():
    x, targets, head = data("float64", seed=4)
    seed = tf.constant([5, 6], tf.int64)
    layers = mlp_layers("float64", dropout=0.1, depth=4)
    base = loss_and_grads(build(layers, "float64", 1, 4, "never", "fill_drain"), x, targets, head, seed)
    for k, remat, schedule in [(4, "never", "one_f_one_b"), (2, "always", "one_f_one_b"), (4, "always", "fill_drain"),
                               (4, "never", "zero_bubble"), (2, "always", "zero_bubble"),
                               (2, "never", "zero_bubble_v"), (1, "always", "zero_bubble_v"),
                               (2, "never", Interleaved.params().set(virtual_stages=2)),
                               (4, "always", Interleaved.params().set(virtual_stages=2))]:
        got = loss_and_grads(build(layers, "float64", k, 4, remat, schedule), x, targets, head, seed)
        assert_same(got, base, rtol=0, atol=1e-13)
    no_dropout = loss_and_grads(build(mlp_layers("float64", depth=4), "float64", 1, 4), x, targets, head)
    assert abs(no_dropout[0] - base[0]) > 1e-6  # dropout really acted


def test_input_gradient_reaches_a_layer_before_the_pipeline():
    x, targets, head = data("float64", seed=5)
    scale = tf.Variable(np.linspace(0.5, 1.5, 6))

    def run(schedule):
        layer = build(mlp_layers("float64", depth=4), "float64", 2, 4, "never", schedule)

        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = PipelineLoss(head_fn, (head,), targets)
                total = layer.fprop_with_loss(layer.theta, x * scale, loss, FPropContext(training=True))["loss"]
            with placement.colocate_gradients():
                return tape.gradient(total, scale)
        return step().numpy()

    ref = run("fill_drain")
    assert np.abs(ref).max() > 1e-3
    np.testing.assert_allclose(run("one_f_one_b"), ref, rtol=1e-10)
    np.testing.assert_allclose(run("zero_bubble"), ref, rtol=1e-10)
    np.testing.assert_allclose(run("zero_bubble_v"), ref, rtol=1e-10)
    np.testing.assert_allclose(run(Interleaved.params().set(virtual_stages=2)), ref, rtol=1e-10)


def _one_f_one_b_step(m, remat="never", devices=DEVICES[:2]):
    x, targets, head = data("float32", seed=6)
    layer = GPipe.params().set(name="net", dtype="float32", layers=mlp_layers("float32", depth=4), num_stages=2,
                               num_micro_batches=m, remat=remat, devices=devices,
                               schedule="one_f_one_b").instantiate()

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = PipelineLoss(head_fn, (head,), targets)
            total = layer.fprop_with_loss(layer.theta, x, loss, FPropContext(training=True))["loss"]
        with placement.colocate_gradients():
            return tape.gradient(total, list(layer.trainable_variables) + [head])
    return step, x, layer


def test_one_f_one_b_graph_does_not_grow_with_m():
    counts = []
    for m in (2, 8):
        step, x, _ = _one_f_one_b_step(m)
        counts.append(count_ops(step.get_concrete_function(x).graph))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("remat, matmuls", [("never", {"CPU:1": 5, "CPU:2": 6}), ("always", {"CPU:1": 7, "CPU:2": 8})])
def test_one_f_one_b_keeps_every_stage_on_its_device(remat, matmuls):
    """Read from the placed graph: stages on CPU:1 and CPU:2, the loop's control on CPU:0 (this process's CPU).
    Each stage's forward, recomputation and backward run on its device, the loss on the last stage's; inside the
    loop only boundary activations and their gradients cross between stages, and no stage sends to CPU:0."""
    step, x, layer = _one_f_one_b_step(4, remat, devices=[DEVICES[1], DEVICES[2]])
    ops = placed_ops(step, x, pipeline=layer)
    matmul_count = collections.Counter(device for device, op, _, _ in ops if op.endswith("MatMul"))
    # As fill-drain's: forward, recomputation and backward matmuls; stage 0 skips its data input's gradient.
    assert {d: matmul_count[d] for d in ("CPU:0", "CPU:1", "CPU:2")} == {"CPU:0": 0, **matmuls}
    crossings = collections.Counter()
    for device, op, _, node in ops:
        inside = op == "_Send" and "while" in node.input[0] and not any(tag in node.input[0]
                                                                        for tag in ("/ctrl/", "/exit/"))
        if inside:
            recv = node.attr["recv_device"].s.decode().split("device:")[-1]
            crossings[(device, recv, tf.as_dtype(node.attr["T"].type).name)] += 1
    floats = {key for key in crossings if key[2].startswith("float")}
    assert floats == {("CPU:1", "CPU:2", "float32"), ("CPU:2", "CPU:1", "float32")}, crossings
    assert [key for key in crossings if key[1] == "CPU:0"] == [], crossings


def test_interleaved_errors_name_the_fix():
    with pytest.raises(ParamsError,
                       match=r"num_micro_batches=3 is not a multiple of num_stages=2.*OneForwardOneBackward"):
        build(mlp_layers("float32", depth=8), "float32", 2, 3, "never", Interleaved.params().set(virtual_stages=2))
    with pytest.raises(ParamsError, match=r"virtual_stages=0 must be a whole number >= 1"):
        build(mlp_layers("float32", depth=8), "float32", 2, 2, "never", Interleaved.params().set(virtual_stages=0))
    with pytest.raises(ParamsError, match=r"num_stages=4 x schedule.virtual_stages=3 = 12 chunks.*"
                                          r"num_stages <= 2"):
        build(mlp_layers("float32", depth=8), "float32", 4, 4, "never", Interleaved.params().set(virtual_stages=3))
    with pytest.raises(ParamsError, match=r"num_stages x virtual_stages=4"):
        GPipe.params().set(name="net", layers=mlp_layers("float32", depth=8), num_stages=2, num_micro_batches=2,
                           balance=[4, 4], devices=DEVICES[:2], schedule="interleaved").instantiate()


def test_loss_without_a_loss_entry_is_an_error():
    x, targets, head = data("float32", seed=7)
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 2, "never", "one_f_one_b")

    def bad(h, out, tgt, ctx):
        return {"total": tf.reduce_sum(out)}
    with pytest.raises(ValueError, match=r"returned \['total'\]: it must return a 'loss' entry"):
        layer.fprop_with_loss(layer.theta, x, PipelineLoss(bad, (), {}), FPropContext(training=True))


def _while_inputs(graph):
    """The number of inputs of every while loop in `graph` and the functions it calls."""
    graphs = [graph] + [fn.graph for fn in graph._functions.values() if hasattr(fn, "graph")]
    return sorted(len(op.inputs) for g in graphs for op in g.get_operations() if op.type in ("While", "StatelessWhile"))


def test_the_loop_builds_its_token_rings_from_the_order_data(reference):
    # 1F1B at K=2 states windows (2, 1): three tokens. An order with windows (3, 3), a forward wait of lag 2 and a
    # backward wait of lag 2 gives the loop 3 + 2 + 2 more loop variables, and the same loss and gradients (the
    # order changes no math).
    from gpipe_tf.gpipe import orders

    x, targets, head, ref = reference
    widths = []
    for custom in (None, orders.ScheduleOrder("wide", 2, in_flight=(3, 3), forward_waits=((1, 0, 2),),
                                              backward_waits=((0, 1, 2),), loss_per_micro_batch=True,
                                              backward_reversed=False)):
        layer = build(mlp_layers("float64", depth=DEPTH), "float64", 2, 4, "never", "one_f_one_b")
        if custom is not None:
            layer.schedule.step_order = lambda k, custom=custom: custom
        got = loss_and_grads(layer, x, targets, head)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-10)
        for g, r in zip(got[1], ref[1]):
            np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)

        @tf.function(autograph=False)
        def step(x, layer=layer):
            loss = PipelineLoss(head_fn, (head,), targets)
            return layer.fprop_with_loss(layer.theta, x, loss, FPropContext(training=True))["loss"]
        widths.append(_while_inputs(step.get_concrete_function(x).graph))
    assert len(widths[0]) == len(widths[1]) == 1 and widths[1][0] - widths[0][0] == 7, widths


def test_zero_bubble_adds_a_weight_ring_per_stage_to_one_f_one_bs_loop(reference):
    # ZB-H1 at K=2: 1F1B's tokens (windows 2, 1) now wait for the input gradients only, and a weight ring of the
    # same windows waits for the weight-gradient sums: 3 more loop variables, and the same loss and gradients.
    x, targets, head, ref = reference
    widths = []
    for name in ("one_f_one_b", "zero_bubble"):
        layer = build(mlp_layers("float64", depth=DEPTH), "float64", 2, 4, "never", name)

        @tf.function(autograph=False)
        def step(x, layer=layer):
            loss = PipelineLoss(head_fn, (head,), targets)
            return layer.fprop_with_loss(layer.theta, x, loss, FPropContext(training=True))["loss"]
        widths.append(_while_inputs(step.get_concrete_function(x).graph))
    assert len(widths[0]) == len(widths[1]) == 1 and widths[1][0] - widths[0][0] == 3, widths


def test_zero_bubble_v_places_its_chunks_in_a_v(reference):
    # ZB-V at K=3: chunks 0..5 on devices 0, 1, 2, 2, 1, 0 (the loss on device 0, beside chunk 0), and each
    # chunk's layers on its device; the same loss and gradients as the un-pipelined model.
    x, targets, head, ref = reference
    layer = build(mlp_layers("float64", depth=DEPTH), "float64", 3, 4, "never", "zero_bubble_v")
    assert layer.plan.chunk_devices == (0, 1, 2, 2, 1, 0)
    assert list(layer.plan.devices[0]) == [DEVICES[d] for d in (0, 1, 2, 2, 1, 0)]
    for stage, names in enumerate(layer.stage_layers):
        for name in names:
            assert [v.device.split("device:")[-1] for v in layer.children[name].trainable_variables] == \
                [DEVICES[(0, 1, 2, 2, 1, 0)[stage]].split("device:")[-1]] * 2, (stage, name)
    assert_same(loss_and_grads(layer, x, targets, head), ref, rtol=1e-10, atol=1e-12)
