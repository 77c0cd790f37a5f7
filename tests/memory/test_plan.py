"""The per-device plan: stash counts by schedule, optimizer memory by name, sizes, and a hand-computed stage."""

import pytest
import tensorflow as tf

from gpipe_tf import experiment, inspection
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.pipeline import find_pipelines
from gpipe_tf.gpipe.schedules import SCHEDULES
from gpipe_tf.hyperparams import Params
from gpipe_tf.layers.linear import Linear
from gpipe_tf.memory import plan, sizes, stage
from gpipe_tf.memory.stash import stashed_micro_batches
from gpipe_tf.training import optimizers


def _order(name, k, **fields):
    return SCHEDULES[name].params().set(**fields).instantiate().step_order(k)


def test_stash_counts_come_from_each_schedules_order_data():
    assert stashed_micro_batches(_order("fill_drain", 4), 8) == [8, 8, 8, 8]
    assert stashed_micro_batches(_order("unrolled", 2), 3) == [3, 3]
    assert stashed_micro_batches(_order("one_f_one_b", 4), 8) == [4, 3, 2, 1]
    assert stashed_micro_batches(_order("one_f_one_b", 4), 2) == [2, 2, 2, 1]
    # Interleaved, K=2, v=2: chunks 0..3 hold 4, 3, 2, 1 (chunk c on device c mod 2).
    assert stashed_micro_batches(_order("interleaved", 2, virtual_stages=2), 8) == [4, 3, 2, 1]
    # Zero bubble: 1F1B's window (its loop runs each micro-batch's W right after its B).
    assert stashed_micro_batches(_order("zero_bubble", 2), 8) == [2, 1]
    # ZeroBubbleV, K=2: chunks 0..3 on devices 0, 1, 1, 0, windows 4, 3, 2, 1; the V's backward waits keep each
    # device at 2K = 4 half-stages: 3 + 1 and 2 + 2.
    assert stashed_micro_batches(_order("zero_bubble_v", 2), 8) == [3, 2, 2, 1]


def _named(name, **fields):
    p = Params()
    p.define("name", name, "")
    for key, value in fields.items():
        p.define(key, value, "")
    return p


def test_optimizer_memory_by_name():
    assert plan.optimizer_memory(optimizers.SGD.params()).slots == 0
    assert plan.optimizer_memory(optimizers.SGD.params().set(momentum=0.9)).slots == 1
    assert plan.optimizer_memory(optimizers.Adam.params()).slots == 2
    assert plan.optimizer_memory(optimizers.RMSProp.params()).slots == 1
    assert plan.optimizer_memory(optimizers.RMSProp.params().set(centered=True, momentum=0.9)).slots == 3
    assert plan.optimizer_memory(_named("adamw")).slots == 2
    assert plan.optimizer_memory(_named("adafactor", beta1=0.0)).slots == 0
    assert plan.optimizer_memory(_named("adafactor", beta1=0.9)).slots == 1
    with pytest.raises(ConfigError, match="'lamb' has no memory model"):
        plan.optimizer_memory(_named("lamb"))


@pytest.mark.parametrize("text,expected", [("16GiB", 16 * 2 ** 30), ("8 GB", 8 * 10 ** 9), ("512MiB", 512 * 2 ** 20),
                                           ("1.5GiB", 3 * 2 ** 29), ("1000000", 10 ** 6), ("64kb", 64000)])
def test_sizes(text, expected):
    assert sizes.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "-3GiB", "16XB", "0", "GiB", ""])
def test_bad_sizes_name_the_value_and_the_units(text):
    with pytest.raises(ConfigError) as raised:
        sizes.parse_bytes(text)
    assert f"--device_memory={text!r} is not a memory size" in str(raised.value)
    assert "GiB" in str(raised.value)


def test_one_stage_by_hand():
    # Two Linear(16 -> 16, relu) layers, micro-batch [8, 16] float32, fill-drain M=4 stashes 4, no remat, Adam.
    layers = [Linear.params().set(input_dim=16, output_dim=16, activation="relu") for _ in range(2)]
    spec = tf.TensorSpec([8, 16])
    traces = stage.trace_layers(layers, spec, ["a", "b"])
    setting = stage.StageSetting(micro_batches=4, stashed=4, remat=False, first=False, last=False,
                                 optimizer=plan.optimizer_memory(optimizers.Adam.params()))
    mem = stage.stage_memory(traces, spec, setting)
    weights = 2 * (16 * 16 + 16) * 4
    tensor = 8 * 16 * 4  # one micro-batch's [8, 16] float32
    assert (mem.weights, mem.gradient_sums, mem.optimizer_slots) == (weights, weights, 2 * weights)
    assert mem.stashed_activations == 4 * (tensor + 2 * tensor)  # input copy and the two ReLU outputs
    # The received input is the stashed copy; output and its gradient; the input gradient sent back.
    assert mem.boundary_buffers == 2 * tensor + tensor
    assert mem.backward_working == weights // 2 + tensor + 2 * weights  # one layer's gradients, b1 m and b2 v
    assert mem.optimizer_update == 3 * weights
    backward = mem.stashed_activations + mem.backward_working
    assert mem.peak == 4 * weights + mem.boundary_buffers + max(backward, mem.optimizer_update)


def test_remat_keeps_inputs_and_recomputes_one_micro_batch():
    layers = [Linear.params().set(input_dim=16, output_dim=16, activation="relu") for _ in range(2)]
    spec = tf.TensorSpec([8, 16])
    traces = stage.trace_layers(layers, spec, ["a", "b"])
    setting = stage.StageSetting(micro_batches=4, stashed=4, remat=True, first=False, last=False)
    mem = stage.stage_memory(traces, spec, setting)
    assert mem.stashed_activations == 4 * 8 * 16 * 4
    assert mem.recompute == 2 * 8 * 16 * 4


def test_transformer_l_83_9b_at_k128_is_planned():
    params, _ = experiment.resolve_params(
        "mt.gpipe_paper.TransformerL_3",
        gin_bindings=["TransformerL_3.num_layers=1663", "TransformerL_3.num_stages=128",
                      "TransformerL_3.num_micro_batches=32", "TransformerL_3.remat='always'"],
        overrides="task.network.micro_batch_shape=[1, 1024],task.network.input_dtype='int32'")
    result = plan.plan_pipeline(params.task.network, params.train, device_memory=16 * 2 ** 30)
    assert len(result["devices"]) == 128
    # 1663 layers of 50,358,272 plus the 32,000 x 2048 embedding and the final norm (the softmax is outside).
    assert sum(d["params"] for d in result["devices"]) == 1663 * 50_358_272 + 32_000 * 2048 + 2 * 2048
    assert all(d["stashed_micro_batches"] == 32 for d in result["devices"])


@pytest.mark.parametrize("overrides, gin, compute", [
    ("", (), "float32"),
    ("task.fprop_dtype=bfloat16", (), "bfloat16"),  # docs/precision.md's switch: the task, inherited by the network
    ("task.network.fprop_dtype=float16", (), "float16"),
    ("", ("BlobsMlpGPipe.dtype='float64'",), "float64"),  # the experiment's own knob: variables and compute
], ids=["default", "task", "network", "experiment-knob"])
def test_every_precision_switch_is_the_plans_compute_dtype(overrides, gin, compute):
    """The plan computes in what the built network computes in, however the precision was set."""
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides=overrides, gin_bindings=gin)
    built = params.task.instantiate().network
    assert built.fprop_dtype.name == compute  # the reference: the layer the trainer would build
    report = inspection.inspect(params, overrides={}, device_memory=2 ** 30)
    assert report["memory"]["compute_dtype"] == compute
    assert f"compute {compute}," in inspection.format_report(report)
    # The activations are sized in it: the stashes are float32's scaled by the bytes of the compute dtype.
    default, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    stashes = [d["stashed_activations"] for d in report["memory"]["devices"]]
    in_float32 = [d["stashed_activations"] for d in inspection.inspect(default, overrides={})["memory"]["devices"]]
    assert any(in_float32) and stashes == [b * tf.as_dtype(compute).size // 4 for b in in_float32]


def test_the_task_precision_reaches_every_layer_of_the_pipeline_in_the_plan():
    """task.fprop_dtype=bfloat16 plans as if every layer of the pipeline said bfloat16 itself: layers whose output
    dtype is their own fprop_dtype (the embedding) are sized in it too, not only the pipeline's input."""
    key = "mt.gpipe_paper.TransformerLTinyOffline"
    inherited, _ = experiment.resolve_params(key, overrides="task.fprop_dtype=bfloat16")
    explicit = experiment.resolve_params(key)[0].copy()
    explicit.task.network.fprop_dtype = "bfloat16"
    for layer in [*explicit.task.network.layers, explicit.task.softmax]:  # the loss head inherits it too
        layer.fprop_dtype = "bfloat16"
    planned = [inspection.inspect(p, overrides={})["memory"]["devices"] for p in (inherited, explicit)]
    assert planned[0] == planned[1]


def test_the_loss_head_is_planned_on_the_micro_batches_it_runs_on():
    """FillDrain and 1F1B run the head on one micro-batch at a time, Unrolled on all M outputs at once; the last
    stage keeps 2 output-sized tensors (1F1B), M output gradients and one output (FillDrain), or every output and
    its gradient (Unrolled)."""
    from gpipe_tf.memory.head import task_head
    m = 4
    params, _ = experiment.resolve_params("mt.gpipe_paper.TransformerLTinyOffline",
                                          gin_bindings=[f"TransformerLTinyOffline.num_micro_batches={m}"])
    last = {}
    for schedule in ("fill_drain", "one_f_one_b", "unrolled"):
        p = params.copy()
        p.task.network.schedule = schedule
        result = plan.plan_pipeline(p.task.network, p.train, head=task_head(p.task, "task.network"))
        last[schedule] = result["stages"][-1]
        assert result["schedule"] == schedule
    assert last["fill_drain"]["loss_head"] == last["one_f_one_b"]["loss_head"] > 0
    assert last["unrolled"]["loss_head"] == m * last["fill_drain"]["loss_head"]
    # Same stage, same received input and returned gradient: the boundaries differ by the kept outputs only.
    out = (last["unrolled"]["boundary_buffers"] - last["one_f_one_b"]["boundary_buffers"]) // (2 * m - 2)
    assert out > 0
    assert last["fill_drain"]["boundary_buffers"] - last["one_f_one_b"]["boundary_buffers"] == (m - 1) * out
    # FillDrain's head ends before its backward loop starts: the peak is the larger phase, not their sum (1F1B,
    # whose loss runs beside the backward passes, adds them).
    fd, one = last["fill_drain"], last["one_f_one_b"]
    static = fd["weights"] + fd["gradient_sums"] + fd["optimizer_slots"] + fd["ema"] + fd["boundary_buffers"]
    assert one["forward_working"] == 0 and fd["forward_working"] > fd["loss_head"]
    # Unrolled's head weight gradient may run beside the stage's backward: added to it.
    assert last["unrolled"]["forward_working"] == 0
    assert fd["peak"] == static + max(fd["stashed_activations"] + fd["recompute"] + fd["backward_working"],
                                      fd["stashed_activations"] + fd["optimizer_early"] + fd["forward_working"],
                                      fd["optimizer_update"])
    assert one["peak"] - one["boundary_buffers"] - one["stashed_activations"] == (
        static - fd["boundary_buffers"] + one["recompute"] + one["backward_working"] + one["loss_head"])


_MLP_BF16 = ("toy.classifier.BlobsMlpGPipe", ["BlobsMlpGPipe.hidden_dims=(64, 64, 64, 64)",
                                             "BlobsMlpGPipe.input_dim=64", "BlobsMlpGPipe.dropout_rate=0.0",
                                             "BlobsMlpGPipe.batch_size=32"])


def _mlp_plan(schedule, remat="never", m=8, k=2, fprop_dtype="bfloat16"):
    model, gin = _MLP_BF16
    params, _ = experiment.resolve_params(model, gin_bindings=gin, overrides=(
        f"task.network.num_stages={k},task.network.num_micro_batches={m},task.network.remat='{remat}',"
        f"task.network.schedule={schedule},task.fprop_dtype={fprop_dtype}"))
    pipe = dict(find_pipelines(params.task))["task.network"]  # the task's precision inherited, as inspect plans
    return plan.plan_pipeline(pipe, params.train)


def test_mixed_precision_holds_the_weight_casts_each_schedule_makes():
    """A stage's bfloat16 casts of its weights: one per stashed micro-batch in fill-drain's loop, one per micro-batch
    in a windowed loop (each iteration casts as the loop starts), one in unrolled's loop-free graph; with remat
    none is stashed (the recompute casts once)."""
    m = 8
    plans = {name: _mlp_plan(name, m=m) for name in ("fill_drain", "one_f_one_b", "unrolled")}
    for s in range(2):
        fd, one, unrolled = (plans[name]["stages"][s] for name in ("fill_drain", "one_f_one_b", "unrolled"))
        cast = fd["params"] * 2  # a bfloat16 copy of the stage's float32 weights
        assert fd["stashed_micro_batches"] == unrolled["stashed_micro_batches"] == m
        assert fd["stashed_activations"] - unrolled["stashed_activations"] == (m - 1) * cast
        per_micro_batch = (unrolled["stashed_activations"] - cast) // m
        window = one["stashed_micro_batches"]
        assert window < m
        assert one["stashed_activations"] == window * per_micro_batch + m * cast
    remat = _mlp_plan("fill_drain", remat="always", m=m)
    assert all(s["stashed_activations"] < s["params"] * 2 for s in remat["stages"])


def test_a_device_with_several_chunks_runs_one_chunks_backward_at_a_time():
    """An interleaved device holds every chunk's weights, stashes and early optimizer temporaries, but the working
    memory of one chunk's backward (its layer gradient, kernel scratch, recompute) at a time: less than the sum of
    its chunks' peaks."""
    model, gin = _MLP_BF16
    params, _ = experiment.resolve_params(model, gin_bindings=gin, overrides=(
        "task.network.num_stages=2,task.network.num_micro_batches=4,task.network.remat='always',"
        "task.network.schedule=interleaved,train.optimizer=gpipe_tf.training.optimizers.Adam"))
    result = plan.plan_pipeline(params.task.network, params.train)
    assert result["virtual_stages"] == 2
    for row in result["devices"]:
        chunks = [s for s in result["stages"] if s["stage"] in row["stages"]]
        assert len(chunks) == 2
        persistent = sum(c["weights"] + c["gradient_sums"] + c["optimizer_slots"] + c["ema"] + c["boundary_buffers"]
                         for c in chunks)
        held = sum(c["stashed_activations"] + c["optimizer_early"] for c in chunks)
        working = max(c["recompute"] + c["backward_working"] - c["optimizer_early"] + c["loss_head"] for c in chunks)
        update = sum(c["optimizer_update"] for c in chunks)
        assert row["peak"] == persistent + max(held + working, update)
        assert row["peak"] < sum(c["peak"] for c in chunks)
