"""The speed plan: each chunk's work from Params against hand counts, the predicted step against GPipe's
(M + K - 1)(F + B) on equal stages, the search's ranking and memory verdicts, and the device presets' errors."""

import dataclasses
import math

import pytest

from gpipe_tf import experiment, model_registry
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.pipeline import GPipe, find_pipelines
from gpipe_tf.gpipe.plan import make_plan
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.softmax import SoftmaxCrossEntropy
from gpipe_tf.memory.head import Head, task_head
from gpipe_tf.memory.plan import optimizer_memory
from gpipe_tf.speed import accelerators, search
from gpipe_tf.speed.accelerators import Accelerator
from gpipe_tf.speed.costs import chunk_work
from gpipe_tf.speed.step import predict_step

# 1 GFLOP/s at 100% of peak, 1 GB/s to memory; a link that costs nothing unless a test says so.
DEVICE = Accelerator("test", {"float32": 1e9}, memory_bytes=2 ** 30, memory_bandwidth=1e9, link_bandwidth=1e30,
                     link_latency=0.0, efficiency=1.0)


def _train():
    return experiment.resolve_params("toy.classifier.BlobsMlpGPipe")[0].train


def _pipe(widths, balance, micro_batch_shape=(2, 8), num_micro_batches=4, **kwargs):
    layers = [Linear.params().set(name=f"l{j}", input_dim=a, output_dim=b)
              for j, (a, b) in enumerate(zip(widths, widths[1:]))]
    return GPipe.params().set(layers=layers, num_stages=len(balance), balance=list(balance),
                              num_micro_batches=num_micro_batches, micro_batch_shape=list(micro_batch_shape),
                              **kwargs)


def test_chunk_work_counts_each_chunks_flops_weights_and_boundaries_by_hand():
    pipe = _pipe([8, 16, 16, 16, 4], [1, 3])
    head = Head((("task.softmax", SoftmaxCrossEntropy.params().set(input_dim=4, num_classes=3)),))
    plan = make_plan(pipe, num_replicas=None, measure=None)
    first, last = chunk_work(pipe, plan, "float32", head)
    # A [2, 8] micro-batch: chunk 0 is 8 -> 16 (2 rows x 8 x 16 multiply-adds), it sends [2, 16] float32 on.
    assert (first.forward_flops, first.params, first.output_bytes, first.input_bytes) == (
        2 * 2 * 8 * 16, 8 * 16 + 16, 2 * 16 * 4, 0)
    # Chunk 1: 16 -> 16 -> 16 -> 4, then the head's 4 -> 3 logits, on the device that runs it.
    assert last.forward_flops == 2 * 2 * (16 * 16 * 2 + 16 * 4 + 4 * 3)
    assert last.params == 2 * (16 * 16 + 16) + 16 * 4 + 4 + 4 * 3 + 3
    assert (last.output_bytes, last.input_bytes) == (0, 2 * 16 * 4)
    # In bfloat16 the boundary tensors are half the bytes.
    assert chunk_work(pipe, plan, "bfloat16", head)[1].input_bytes == 2 * 16 * 2


@pytest.mark.parametrize("remat", ["never", "always"])
@pytest.mark.parametrize("k,m", [(1, 1), (1, 4), (2, 4), (4, 8)])
def test_equal_stages_take_gpipes_m_plus_k_minus_1_cells_plus_the_update(k, m, remat):
    pipe = _pipe([16] * 9, [8 // k] * k, micro_batch_shape=(2, 16), num_micro_batches=m, remat=remat)
    train = _train()
    step = predict_step(pipe, train, DEVICE)
    per_chunk = 8 // k
    compute = per_chunk * 2 * 2 * 16 * 16 / 1e9  # seconds of one chunk's forward of one micro-batch
    params = per_chunk * (16 * 16 + 16)
    sums = 3 * params * 4 / 1e9 if m > 1 else 0.0  # read the sum and the gradient, write the sum
    backward = 2 * compute + (compute if remat == "always" else 0.0) + sums
    update = params * 4 * (3 + 2 * optimizer_memory(train.optimizer).slots) / 1e9
    assert step["pipeline_seconds"] == pytest.approx((m + k - 1) * (compute + backward), rel=1e-9)
    assert step["update_seconds"] == pytest.approx(update, rel=1e-9)
    assert step["step_seconds"] == pytest.approx(step["pipeline_seconds"] + update, rel=1e-9)
    assert step["bubble"] == pytest.approx((k - 1) / (m + k - 1), abs=1e-9)
    assert step["examples_per_second"] == pytest.approx(2 * m / step["step_seconds"])


def test_a_transfer_is_charged_to_the_sending_cells():
    slow_link = Accelerator("link", {"float32": 1e9}, 2 ** 30, 1e9, link_bandwidth=1e6, link_latency=1e-3,
                            efficiency=1.0)
    pipe = _pipe([16] * 3, [1, 1], micro_batch_shape=(2, 16), num_micro_batches=1)
    (f0, b0), (f1, b1) = predict_step(pipe, _train(), slow_link)["chunk_seconds"]
    compute, send = 2 * 2 * 16 * 16 / 1e9, 1e-3 + 2 * 16 * 4 / 1e6
    assert (f0, f1) == pytest.approx((compute + send, compute))  # the output goes forward from chunk 0
    assert (b0, b1) == pytest.approx((2 * compute, 2 * compute + send))  # its gradient comes back from chunk 1


def test_the_search_ranks_what_fits_by_predicted_step_and_keeps_the_batch():
    pipe = _pipe([16] * 9, [4, 4], micro_batch_shape=(4, 16), num_micro_batches=2)
    free_memory_traffic = dataclasses.replace(DEVICE, memory_bandwidth=1e30)
    plan = search.speed_plan(pipe, _train(), free_memory_traffic, num_devices=4, device_memory=2 ** 30)
    rows = plan["rows"]
    assert plan["current"]["num_stages"] == 2 and plan["current"]["num_micro_batches"] == 2
    assert {r["batch"] for r in rows} == {8}
    assert {r["num_stages"] for r in rows} == {1, 2, 4}
    assert {r["num_micro_batches"] for r in rows} == {1, 2, 4, 8}
    fitting = [r["step_seconds"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting) and plan["fastest"]["step_seconds"] == min(fitting)
    # Free transfers and sums, equal layers: the most devices and micro-batches win, and the override selects them.
    best = plan["fastest"]
    assert (best["num_stages"], best["num_micro_batches"]) == (4, 8), best
    assert "task.network.num_stages=4" in best["params"] and "task.network.num_micro_batches=8" in best["params"]
    text = "\n".join(search.format_speed_plan(plan))
    assert f"--params={best['params']}" in text, text

    unshaped = pipe.copy().set(micro_batch_shape=None)
    with pytest.raises(ConfigError, match=r"task.network.micro_batch_shape is not set.*--params=task.network"):
        search.speed_plan(unshaped, _train(), DEVICE, num_devices=4)

    tight = search.speed_plan(pipe, _train(), DEVICE, num_devices=4, device_memory=1024)
    assert tight["fastest"] is None and not any(r["fits"] for r in tight["rows"])
    assert "no configuration fits" in "\n".join(search.format_speed_plan(tight))


def test_every_registered_pipeline_predicts_its_own_step_from_the_experiment_alone():
    checked = 0
    for key in model_registry.list_models():
        params, _ = experiment.resolve_params(key)
        for path, pipe in find_pipelines(params.task)[:1]:
            step = predict_step(pipe, params.train, accelerators.accelerator("tpu_v3"),
                                task_head(params.task, path), path)
            assert step["step_seconds"] > 0 and math.isfinite(step["step_seconds"]), key
            assert 0 <= step["bubble"] < 1, (key, step["bubble"])
            checked += 1
    assert checked >= 10


def test_presets_and_custom_devices():
    assert set(accelerators.PRESETS) >= {"tpu_v2", "tpu_v3", "p100", "v100", "a100", "h100"}
    for device in accelerators.PRESETS.values():
        assert device.source and device.assumes and device.peak_flops["float32"] > 0
    v3 = accelerators.resolve("tpu_v3", flops=1e14)
    assert v3.flops_per_second("bfloat16") == 1e14 * v3.efficiency and v3.memory_bytes == 16 * 2 ** 30
    own = accelerators.resolve(None, flops=2e14, bandwidth=5e10)
    assert (own.link_bandwidth, own.flops_per_second("float16")) == (5e10, 2e14 * own.efficiency)
    with pytest.raises(ConfigError, match=r"--accelerator='tpu_v9' is not a preset; use one of tpu_v2, tpu_v3"):
        accelerators.resolve("tpu_v9")
    with pytest.raises(ConfigError, match="both --accelerator_flops=FLOP/s and --accelerator_bandwidth"):
        accelerators.resolve(None, flops=2e14)
    with pytest.raises(ConfigError, match=r"--accelerator_bandwidth=-1.0 is invalid: give a positive number"):
        accelerators.resolve("a100", bandwidth=-1.0)


def test_a_vs_turn_sends_nothing_and_each_device_updates_after_its_own_last_cell():
    slow_link = Accelerator("link", {"float32": 1e9}, 2 ** 30, 1e6, link_bandwidth=1e6, link_latency=1e-3,
                            efficiency=1.0)
    pipe = _pipe([16] * 5, [1, 1, 1, 1], micro_batch_shape=(2, 16), num_micro_batches=1, schedule="zero_bubble_v")
    pipe.set(num_stages=2)  # 4 chunks on 2 devices: 0, 1 | 1, 0
    step = predict_step(pipe, _train(), slow_link)
    compute, send = 2 * 2 * 16 * 16 / 1e9, 1e-3 + 2 * 16 * 4 / 1e6
    forwards = [f for f, _ in step["chunk_seconds"]]
    backwards = [b for _, b in step["chunk_seconds"]]
    assert forwards == pytest.approx([compute + send, compute, compute + send, compute])
    assert backwards == pytest.approx([2 * compute, 2 * compute + send, 2 * compute, 2 * compute + send])
    # M=1 runs the chunks one after another: device 1 (chunks 1, 2) ends before device 0's last backward, and its
    # update overlaps that backward; device 0's update ends the step.
    update = 2 * (16 * 16 + 16) * 4 * (3 + 2 * optimizer_memory(_train().optimizer).slots) / 1e6
    assert step["pipeline_seconds"] == pytest.approx(sum(forwards) + sum(backwards))
    assert step["step_seconds"] == pytest.approx(step["pipeline_seconds"] + update)
    assert step["update_seconds"] == pytest.approx(update)


def test_a_device_whose_update_is_longer_ends_the_step_from_its_own_last_cell():
    pipe = _pipe([16, 16, 512], [1, 1], micro_batch_shape=(2, 16), num_micro_batches=1)  # stage 1: 32x the weights
    step = predict_step(pipe, _train(), DEVICE)
    (f0, b0), (f1, b1) = step["chunk_seconds"]
    per_weight = 4 * (3 + 2 * optimizer_memory(_train().optimizer).slots) / 1e9
    device_0_ends, device_1_ends = f0 + f1 + b1 + b0, f0 + f1 + b1
    expected = max(device_0_ends + (16 * 16 + 16) * per_weight, device_1_ends + (16 * 512 + 512) * per_weight)
    assert step["step_seconds"] == pytest.approx(expected)
    assert expected < device_0_ends + (16 * 512 + 512) * per_weight  # not the makespan plus the largest update


def test_the_printed_override_selects_the_configuration_it_was_predicted_for():
    # An explicit balance of the experiment's K: the fastest configuration on 4 devices has another K, so its
    # override must clear the balance (and keep the batch) for the run to be the one predicted.
    key = "toy.classifier.BlobsMlpGPipe"
    params, _ = experiment.resolve_params(key, overrides="task.network.balance=[2, 4]")
    path, pipe = find_pipelines(params.task)[0]
    plan = search.speed_plan(pipe, params.train, accelerators.accelerator("a100"), 4, head=task_head(params.task, path),
                             path=path)
    fastest = plan["fastest"]
    assert fastest["num_stages"] != 2 and "task.network.balance=None" in fastest["params"], fastest
    chosen, _ = experiment.resolve_params(key, overrides=f"task.network.balance=[2, 4],{fastest['params']}")
    _, run = find_pipelines(chosen.task)[0]
    again = predict_step(run, chosen.train, accelerators.accelerator("a100"), task_head(chosen.task, path), path)
    assert again["step_seconds"] == pytest.approx(fastest["step_seconds"], rel=1e-12)
    assert again["batch"] == fastest["batch"]
