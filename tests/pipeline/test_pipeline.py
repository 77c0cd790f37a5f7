"""GPipe equals the un-pipelined model: loss and every gradient, for K in 1..4 and M in {1,2,3,4,8}."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.fill_drain import FillDrain
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.unrolled import Unrolled
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.sequential import Sequential
from tests.helpers import tiers
from tests.helpers.pipeline_models import BATCH, DEVICES, conv_layers, count_ops, mlp_layers, placed_ops

SCHEDULES = ["unrolled", "fill_drain"]


def build(layers, dtype, k=None, m=1, remat="never", balance=None, schedule="unrolled"):
    if k is None:
        p = Sequential.params().set(name="net", dtype=dtype, layers=layers)
    else:
        p = GPipe.params().set(name="net", dtype=dtype, layers=layers, num_stages=k, num_micro_batches=m,
                               remat=remat, balance=balance, devices=DEVICES[:k], schedule=schedule)
    return p.instantiate()


def loss_and_grads(layer, inputs, seed=None):
    @tf.function(autograph=False)
    def step(x):
        ctx = FPropContext(training=seed is not None, seed=seed)
        with tf.GradientTape() as tape:
            out = layer.fprop(layer.theta, x, ctx)
            loss = tf.add_n([tf.reduce_sum(t * t) for t in tf.nest.flatten(out)])
        with placement.colocate_gradients():
            grads = tape.gradient(loss, layer.trainable_variables)
        return loss, grads

    loss, grads = step(inputs)
    return float(loss), {v.name: g.numpy() for v, g in zip(layer.trainable_variables, grads)}


def assert_same(a, b, rtol, atol=0.0):
    np.testing.assert_allclose(a[0], b[0], rtol=rtol, atol=atol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        np.testing.assert_allclose(a[1][name], b[1][name], rtol=rtol, atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def mlp_reference():
    x = tf.constant(np.random.default_rng(1).normal(size=(BATCH, 6)))
    return x, loss_and_grads(build(mlp_layers("float64"), "float64"), x)


@pytest.mark.parametrize("schedule,remat,k,m", tiers.grid(
    corners=("schedule", "remat", "k"), schedule=SCHEDULES, remat=["never", "always", "except_last"],
    k=[1, 2, 3, 4], m=[1, 2, 3, 4, 8]))
def test_mlp_float64_equals_unpipelined(mlp_reference, k, m, remat, schedule):
    x, ref = mlp_reference
    got = loss_and_grads(build(mlp_layers("float64"), "float64", k, m, remat, schedule=schedule), x)
    assert_same(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule,k,m,remat", tiers.sample(
    [(schedule, k, m, remat) for schedule in SCHEDULES
     for k, m, remat in [(2, 4, "never"), (4, 8, "except_last"), (3, 3, "always")]],
    keep=[("unrolled", 4, 8, "except_last"), ("fill_drain", 3, 3, "always")]))
def test_mlp_float32_equals_unpipelined(k, m, remat, schedule):
    x = tf.constant(np.random.default_rng(2).normal(size=(BATCH, 6)).astype(np.float32))
    ref = loss_and_grads(build(mlp_layers("float32"), "float32"), x)
    got = loss_and_grads(build(mlp_layers("float32"), "float32", k, m, remat, schedule=schedule), x)
    assert_same(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule,k,m,remat", tiers.sample(
    [(schedule, k, m, remat) for schedule in SCHEDULES
     for k, m, remat in [(1, 1, "never"), (2, 4, "always"), (3, 8, "except_last"), (4, 2, "never"), (4, 8, "always")]],
    keep=[("unrolled", 4, 8, "always"), ("fill_drain", 1, 1, "never"), ("fill_drain", 3, 8, "except_last")]))
def test_conv_pair_stack_changes_shape_and_equals_unpipelined(k, m, remat, schedule):
    rng = np.random.default_rng(3)
    x = (tf.constant(rng.normal(size=(BATCH, 8, 8, 2))), tf.constant(rng.normal(size=(BATCH, 8, 8, 2))))
    ref = loss_and_grads(build(conv_layers("float64"), "float64"), x)
    got = loss_and_grads(build(conv_layers("float64"), "float64", min(k, 5), m, remat, schedule=schedule), x)
    assert_same(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropout_masks_do_not_depend_on_k_or_remat(schedule):
    x = tf.constant(np.random.default_rng(4).normal(size=(BATCH, 6)))
    seed = tf.constant([5, 6], tf.int64)
    layers = mlp_layers("float64", dropout=0.1, depth=4)
    base = loss_and_grads(build(layers, "float64", 1, 4, "never", schedule="fill_drain"), x, seed)
    for k, remat in [(4, "never"), (4, "always"), (2, "except_last")]:
        got = loss_and_grads(build(layers, "float64", k, 4, remat, schedule=schedule), x, seed)
        assert_same(got, base, rtol=0, atol=1e-13)
    no_dropout = loss_and_grads(build(mlp_layers("float64", depth=4), "float64", 1, 4), x)
    assert abs(no_dropout[0] - base[0]) > 1e-6  # dropout really acted


def test_batch_size_not_divisible_names_valid_m():
    layer = build(mlp_layers("float32", depth=2), "float32", 2, 5)
    with pytest.raises(ParamsError, match=r"batch size 24 is not divisible by num_micro_batches=5; valid values: "
                                          r"\[1, 2, 3, 4, 6, 8, 12, 24\]"):
        layer(tf.zeros([BATCH, 6]))


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ParamsError, match=r"num_stages=3 must be between 1 and the number of layers \(2\)"):
        build(mlp_layers("float32", depth=2), "float32", 3, 1)


def test_bad_balance_and_policy_are_errors():
    with pytest.raises(ParamsError, match=r"balance=\[1, 1\] must have num_stages=2 positive entries summing to"):
        build(mlp_layers("float32", depth=4), "float32", 2, 1, balance=[1, 1])
    with pytest.raises(ParamsError, match="remat='sometimes' is not one of"):
        build(mlp_layers("float32", depth=4), "float32", 2, 1, remat="sometimes")


def test_schedule_is_configured_by_params_and_bad_values_are_errors():
    x = tf.constant(np.random.RandomState(3).randn(BATCH, 6).astype("float32"))
    reference = loss_and_grads(build(mlp_layers("float32", depth=4), "float32"), x)
    tuned = FillDrain.params().set(parallel_iterations=2)
    for schedule in (tuned, Unrolled.params(), "unrolled"):
        layer = build(mlp_layers("float32", depth=4), "float32", 2, 4, "always", schedule=schedule)
        assert isinstance(layer.schedule, (FillDrain, Unrolled))
        assert_same(loss_and_grads(layer, x), reference, rtol=1e-5, atol=1e-6)
    assert build(mlp_layers("float32", depth=4), "float32", 2, 4, schedule=tuned).schedule.p.parallel_iterations == 2
    with pytest.raises(ParamsError, match=r"schedule='loop' is not a schedule: .*FillDrain.params\(\).*'fill_drain'"):
        build(mlp_layers("float32", depth=4), "float32", 2, 1, schedule="loop")
    with pytest.raises(ParamsError, match=r"parallel_iterations=0 must be a whole number >= 1"):
        build(mlp_layers("float32", depth=4), "float32", 2, 1, schedule=FillDrain.params().set(parallel_iterations=0))


@pytest.mark.parametrize("remat", ["never", "always"])
def test_fill_drain_backward_loop_keeps_nothing_per_micro_batch(remat):
    """The backward loop must not stash tensors per iteration: that would keep every micro-batch's weight
    gradients alive to the end of the loop (memory growing with M, as a recomputation differentiated with respect
    to the forward loop's own weight tensors once did)."""
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 4, remat, schedule="fill_drain")

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, layer.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec([BATCH, 6])).graph
    pushes = {}
    for op in graph.get_operations():
        if op.type in ("While", "StatelessWhile"):
            body = graph._get_function(op.get_attr("body").name).graph
            pushes[op.name] = [o.inputs[1].name for o in body.get_operations() if o.type == "TensorListPushBack"]
    forward = [name for name in pushes if not name.endswith("_grad")]
    backward = [name for name in pushes if name.endswith("_grad")]
    assert len(forward) == 1 and len(backward) == 1, list(pushes)
    assert pushes[forward[0]], "the forward loop stashes what the backward needs"
    assert pushes[backward[0]] == [], pushes[backward[0]]


def test_graph_does_not_grow_with_m():
    layers = mlp_layers("float32", depth=4)
    sizes = []
    for m in (2, 4, 8, 12):
        layer = build(layers, "float32", 2, m, "always", schedule="fill_drain")

        @tf.function(autograph=False)
        def step(x, layer=layer):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x))
            return tape.gradient(loss, layer.trainable_variables)

        sizes.append(count_ops(step.get_concrete_function(tf.TensorSpec([BATCH, 6])).graph))
    assert len(set(sizes)) == 1, sizes


@pytest.mark.parametrize("remat, matmuls", [("never", {"CPU:1": 5, "CPU:2": 6}), ("always", {"CPU:1": 7, "CPU:2": 8})])
def test_fill_drain_keeps_every_stage_state_on_its_device(remat, matmuls):
    """Read from the placed graph: each stage's backward, recomputation, stashes and weight-gradient sums run on its
    device, and inside the loops only boundary activations, their gradients and the loop control cross devices.
    CPU:0 is where the loss is and where the loops' condition runs (this process's own CPU)."""
    layer = GPipe.params().set(name="net", dtype="float32", layers=mlp_layers("float32", depth=4), num_stages=2,
                               num_micro_batches=4, remat=remat, devices=[DEVICES[1], DEVICES[2]],
                               schedule="fill_drain").instantiate()

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        with placement.colocate_gradients():
            return loss, tape.gradient(loss, layer.trainable_variables)

    ops = placed_ops(step, tf.ones([BATCH, 6]), pipeline=layer)
    count = collections.Counter((device, op) for device, op, _, _ in ops)
    # Forward, recomputation (remat) and backward matmuls: stage 0 skips its data input's gradient. The placed
    # graph holds rewritten kernels where the CPU allows (oneDNN's _MklMatMul, grappler's _FusedMatMul).
    matmul_count = collections.Counter(device for device, op, _, _ in ops if op.endswith("MatMul"))
    assert {d: matmul_count[d] for d in ("CPU:0", "CPU:1", "CPU:2")} == {"CPU:0": 0, **matmuls}
    # Stashes for the backward are pushed on the stage devices only.
    assert count[("CPU:1", "TensorListPushBack")] >= 1 and count[("CPU:2", "TensorListPushBack")] >= 1, count
    assert count[("CPU:0", "TensorListPushBack")] == 0, count
    # Float state of the backward loop (each weight's gradient sum: 2 layers x (w, b) per stage, and the boundary
    # gradients) lives on the stage devices.
    float32 = tf.float32.as_datatype_enum
    float_state = collections.Counter(
        device for device, op, name, node in ops
        if op == "Merge" and "while_grad/merge" in name and node.attr["T"].type == float32)
    assert float_state["CPU:0"] == 0 and float_state["CPU:1"] >= 4 and float_state["CPU:2"] >= 4, float_state
    # Each micro-batch, floats cross only from stage to stage (an activation forward, its gradient backward);
    # CPU:0 sends and receives only the loops' control (booleans, counters, control edges).
    crossings = collections.Counter()
    for device, op, _, node in ops:
        # Inside the loops: not a control edge, not a loop's final value (once per step).
        inside = op == "_Send" and "while" in node.input[0] and not any(
            tag in node.input[0] for tag in ("/ctrl/", "/exit/"))
        if inside:
            recv = node.attr["recv_device"].s.decode().split("device:")[-1]
            crossings[(device, recv, tf.as_dtype(node.attr["T"].type).name, node.input[0])] += 1
    floats = {key[:3] for key in crossings if key[2].startswith("float")}
    assert floats == {("CPU:1", "CPU:2", "float32"), ("CPU:2", "CPU:1", "float32")}, crossings
    assert all(dtype in ("bool", "int32") for src, dst, dtype, _ in crossings if "CPU:0" in (src, dst)), crossings
    # Neither loop's condition waits for a stage: inside the loops, nothing goes from a stage to CPU:0.
    to_host = [key for key in crossings if key[1] == "CPU:0"]
    assert to_host == [], to_host


def test_partition_table_lists_stages():
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 1)
    table = layer.partition_table()
    assert layer.balance == [2, 2]
    assert "layer_0 .. layer_1 (2)" in table and "/device:CPU:1" in table and "84" in table


@pytest.mark.parametrize("remat", ["never", "always"])
def test_unrolled_schedule_places_every_matmul_on_its_stage(remat, monkeypatch):
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", "plain")  # the count below is the plain forward's ops
    layer = build(mlp_layers("float32", depth=4), "float32", 2, 4, remat)

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, layer.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec([BATCH, 6])).graph
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    forward = {"never": 4, "always": 8}[remat]  # per micro-batch: forward (+ recompute) matmuls
    # Backward per micro-batch: each layer's weight and input gradient, except the data input's (no gradient).
    assert len(matmuls) == 4 * (forward + 7)
    assert {op.device for op in matmuls} == {"/device:CPU:0", "/device:CPU:1"}
    for op in matmuls:
        stage = int(op.device[-1])
        assert f"_stage{stage}" in op.name, (op.name, op.device)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradient_reaches_a_layer_before_the_pipeline(schedule):
    """The pipeline's input gradient is computed when the input comes from a trainable layer."""
    x = tf.constant(np.random.default_rng(5).normal(size=(BATCH, 6)))
    first = Linear.params().set(name="first", dtype="float64", input_dim=6, output_dim=6).instantiate()
    pipe = build(mlp_layers("float64", depth=4), "float64", 2, 4, "always", schedule=schedule)
    seq = build(mlp_layers("float64", depth=4), "float64")

    def grads(net):
        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(net(first(x))))
            with placement.colocate_gradients():
                return tape.gradient(loss, first.trainable_variables)
        return [g.numpy() for g in step()]

    for a, b in zip(grads(pipe), grads(seq)):
        np.testing.assert_allclose(a, b, rtol=1e-10)


def test_checkpoints_do_not_depend_on_k_or_schedule(tmp_path):
    """Variables are named by global layer index, so a run can change K or the schedule and still restore."""
    two = build(mlp_layers("float32", depth=4), "float32", 2, 2, schedule="unrolled")
    path = tf.train.Checkpoint(model=two).write(str(tmp_path / "ckpt"))
    four = build(mlp_layers("float32", depth=4), "float32", 4, 4, schedule="fill_drain")
    for v in four.trainable_variables:
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(model=four).read(path).assert_existing_objects_matched()
    for a, b in zip(two.trainable_variables, four.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not any("gradient_sum" in name for name, _ in tf.train.list_variables(path))


class SquareWeight(BaseLayer):
    """Test layer base: one [dim, dim] weight "w"; subclasses define fprop."""

    @classmethod
    def params(cls):
        p = super().params()
        p.define("dim", 3, "")
        return p

    def __init__(self, params, parent_path=""):
        super().__init__(params, parent_path)
        self.create_variable("w", [self.p.dim, self.p.dim])

    @classmethod
    def num_params(cls, p):
        return p.dim * p.dim


class Duplicate(SquareWeight):
    """Test layer: x -> (tanh(x W), tanh(x W)), the same tensor twice; then a layer consuming the pair."""

    def fprop(self, theta, inputs, ctx):
        if isinstance(inputs, tuple):
            inputs = inputs[0] * 2.0 + inputs[1]
        out = tf.tanh(inputs @ theta["w"])
        return out, out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("remat", ["never", "always"])
def test_a_boundary_holding_one_tensor_twice_is_not_counted_twice(schedule, remat):
    x = tf.constant(np.random.default_rng(6).normal(size=(BATCH, 3)))
    layers = [Duplicate.params() for _ in range(4)]
    ref = loss_and_grads(build(layers, "float64"), x)
    assert_same(loss_and_grads(build(layers, "float64", 2, 4, remat, schedule=schedule), x), ref, rtol=1e-10)


class IdsAndFeatures(SquareWeight):
    """Test layer on a dict {"h": float, "ids": int32}: h -> tanh(h W) masked by the parity of ids; ids -> ids + 1."""

    def fprop(self, theta, inputs, ctx):
        mask = tf.cast(inputs["ids"] % 2, inputs["h"].dtype)[:, None]
        return {"h": tf.tanh(inputs["h"] @ theta["w"]) * (0.5 + mask), "ids": inputs["ids"] + 1}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("remat", ["never", "always", "except_last"])
def test_integer_leaves_cross_stages_with_every_remat_policy(schedule, remat):
    """A boundary holding an int32 leaf beside the float one: the ids pass through (no gradient), loss and gradients
    equal the un-pipelined model's, and the pipeline's integer output is the same."""
    layers = [IdsAndFeatures.params().set(dim=4) for _ in range(4)]
    rng = np.random.RandomState(7)
    inputs = {"h": tf.constant(rng.randn(BATCH, 4)), "ids": tf.constant(rng.randint(0, 5, BATCH), tf.int32)}

    def run(layer):
        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                out = layer.fprop(layer.theta, inputs, FPropContext())
                loss = tf.reduce_sum(out["h"] ** 2)
            with placement.colocate_gradients():
                return loss, out["ids"], tape.gradient(loss, layer.trainable_variables)

        loss, ids, grads = step()
        return loss.numpy(), ids.numpy(), [g.numpy() for g in grads]

    ref = run(build(layers, "float64"))
    got = run(build(layers, "float64", 2, 4, remat, schedule=schedule))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-10)
    np.testing.assert_array_equal(got[1], ref[1])
    assert (got[1] == inputs["ids"].numpy() + 4).all()
    for a, b in zip(got[2], ref[2]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
