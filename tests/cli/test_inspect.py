"""--mode=inspect explains what it cannot estimate, echoes the command's overrides and the balance criterion, and
plans memory per device against --device_memory."""

import json
import os
import sys
import textwrap

import pytest

from gpipe_tf import experiment, inspection
from tests.helpers import tiers, trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import assert_user_error, one_error_line

KEY = "mt.gpipe_paper.TransformerLTinyOffline"


def test_transformer_activations_are_explained_without_a_shape_and_estimated_with_one():
    params = experiment.resolve_params(KEY)[0].copy()
    params.task.network.micro_batch_shape = None  # a pipeline of one's own that does not say (the experiment does)
    report = inspection.inspect(params)
    assert all(s["activation_bytes_estimate"] is None for s in report["stages"])
    text = inspection.format_report(report)
    assert "note: activations and memory '-': memory plan: task.network.micro_batch_shape is not set" in text, text
    assert "--params=task.network.micro_batch_shape=" in text

    shaped, _ = experiment.resolve_params(
        KEY, overrides="task.network.micro_batch_shape=[4, 16],task.network.input_dtype='int32'")
    report = inspection.inspect(shaped)
    assert report["estimate_notes"] == []
    # Stage 0 (no remat, fill-drain stashes all M=4): per micro-batch the embedding's output and the first layer's
    # activations (its input ids are a slice of the mini-batch it holds), with x = one [4, 16, 64] float32 tensor:
    # two layer norms 2x each,
    # the scaled q, k, v, context and output 5x, the softmax [4, 4, 16, 16] (1x), the FFN's ReLU output 4x and its
    # output 1x.
    x = 4 * 16 * 64 * 4
    layer = 4 * x + 5 * x + 4 * 4 * 16 * 16 * 4 + 4 * x + x
    assert report["stages"][0]["activation_bytes_estimate"] == 4 * (x + layer)
    assert report["memory"]["devices"][0]["stashed_activations"] == 4 * (x + layer)


def test_balance_criterion_is_stated():
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    text = inspection.format_report(inspection.inspect(params))
    assert ("balance: balance_by='params', the contiguous split minimizing the largest stage's parameter count; "
            "stage costs 4,160 .. 5,248") in text, text
    explicit, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides="task.network.balance=[2, 4]")
    assert "balance: explicit balance=[2, 4]" in inspection.format_report(inspection.inspect(explicit))


def test_trainer_inspect_echoes_the_overrides():
    result = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe",
                                  "--mode=inspect", "--gin_param=BlobsMlpGPipe.num_micro_batches=2",
                                  "--params=train.learning_rate=0.5"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert "overrides --gin_param: BlobsMlpGPipe.num_micro_batches=2" in lines, result.stdout
    assert "overrides --params: train.learning_rate=0.5" in lines, result.stdout
    assert "pipeline task.network: K=2 M=2 remat=always" in lines, result.stdout


SHAPED = "--params=task.network.micro_batch_shape=[4, 16],task.network.input_dtype='int32'"


def test_device_memory_plan_and_suggestion():
    result = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED,
                                  "--device_memory=5.2MiB"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "memory per device (predicted; schedule fill_drain" in out, out
    assert "does NOT fit: 1 of 2 devices exceed 5.2 MiB" in out, out
    # 1F1B holds K - k = 2 and 1 micro-batches instead of 4 (fill-drain already runs the loss head on one
    # micro-batch at a time): the first candidate, and it fits.
    suggestion = "smallest change that fits with 15% headroom: schedule 1F1B (largest peak "
    override = "--params=task.network.schedule='one_f_one_b'"
    assert suggestion in out and out.rstrip().endswith(override), out
    # The suggested override, added as printed, is accepted and makes the plan fit.
    taken = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED, override,
                                 "--device_memory=5.2MiB"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert taken.returncode == 0, taken.stderr
    assert "memory per device (predicted; schedule one_f_one_b" in taken.stdout, taken.stdout
    assert "fits: every device's peak is within 5.2 MiB" in taken.stdout, taken.stdout
    as_json = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED,
                                   "--device_memory=5.2MiB", "--json"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300)
    memory = json.loads(as_json.stdout)["memory"]
    assert memory["fits"] is False and memory["device_memory"] == round(5.2 * 2 ** 20)
    assert [d["fits"] for d in memory["devices"]] == [True, False]
    assert memory["suggestion"]["change"] == "schedule 1F1B"


@pytest.mark.parametrize("value", tiers.sample(["16XB", "lots", "-1GiB"], keep=["16XB"]))
def test_bad_device_memory_is_one_line_exit_2(value):
    result = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED,
                                  f"--device_memory={value}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert_user_error(result, f"--device_memory='{value}' is not a memory size", "GiB")


OPAQUE = textwrap.dedent('''\
    """An experiment with a layer that cannot say what it keeps for its backward pass."""
    from gpipe_tf import model_registry
    from gpipe_tf.layers.base_layer import BaseLayer
    from gpipe_tf.layers.linear import Linear
    from gpipe_tf.params.toy.classifier import BlobsMlpGPipe


    class OpaqueLinear(Linear):
        @classmethod
        def activation_bytes(cls, p, input_spec):
            return BaseLayer.activation_bytes.__func__(cls, p, input_spec)


    @model_registry.register
    class OpaqueMlp(BlobsMlpGPipe):
        def task(self):
            p = super().task()
            layers = list(p.network.layers)
            first = layers[0]
            layers[0] = OpaqueLinear.params().set(name=first.name, input_dim=first.input_dim,
                                                  output_dim=first.output_dim, activation=first.activation)
            p.network.layers = layers
            return p
    ''')


def test_unestimable_layer_is_one_line_exit_2(tmp_path):
    (tmp_path / "memexp_opaque.py").write_text(OPAQUE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    args = [sys.executable, "trainer.py", "--module=memexp_opaque", "--model=memexp_opaque.OpaqueMlp",
            "--mode=inspect", "--device_memory=1GiB"]
    result = trainer_process.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert_user_error(result, "layer_0 (OpaqueLinear) cannot estimate its memory from Params",
                      "OpaqueLinear.activation_bytes is missing")
    # Without --device_memory the report says so in a note instead.
    result = trainer_process.run(args[:-1], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "note: activations and memory '-': memory plan: layer_0 (OpaqueLinear)" in result.stdout, result.stdout


def test_capacity_table_per_stage_count():
    result = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED,
                                  "--device_memory=8MiB", "--capacity=num_layers", "--capacity_devices=4", "--json"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["capacity"]
    assert [r["num_stages"] for r in rows] == [1, 2, 4] and all(r["value"] for r in rows), rows
    assert "capacity: K=4: num_layers=" in result.stderr, result.stderr
    text = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED,
                                "--device_memory=8MiB", "--capacity=num_layers", "--capacity_devices=4", "--quiet"],
                               cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    table = text.stdout.splitlines()[-4:]
    assert table[0].split() == ["K", "num_layers", "params", "largest", "peak", "note"], text.stdout
    assert [line.split()[:2] for line in table[1:]] == [[str(r["num_stages"]), f"{r['value']:,}"] for r in rows]


def test_capacity_needs_device_memory():
    result = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", "--mode=inspect", SHAPED,
                                  "--capacity=num_layers"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert_user_error(result, "--capacity=num_layers needs --device_memory", "--device_memory=16GiB")


def inspect_blobs(*args):
    return trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", "--mode=inspect",
                                *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.exhaustive(covered_by=(
    "tests/memory/test_capacity.py::test_a_batch_size_knob_proposes_only_batch_sizes_the_trainer_accepts",
))
def test_the_batch_size_capacity_proposes_trains(tmp_path):
    # issue 35 item 4: the largest batch size --capacity=batch_size proposes is one the trainer trains with.
    result = inspect_blobs("--device_memory=8MiB", "--capacity=batch_size", "--capacity_devices=2", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)["capacity"]
    k2 = next(r for r in rows if r["num_stages"] == 2)
    trained = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe",
                                   f"--logdir={tmp_path / 'run'}", "--max_steps=1", "--quiet",
                                   f"--gin_param=BlobsMlpGPipe.batch_size={k2['value']}"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert k2["note"].startswith("multiples of 4: batch sizes the trainer accepts"), rows


@pytest.mark.exhaustive(covered_by=(
    "tests/pipeline/test_plan.py::test_too_few_layers_for_the_chunks_advises_a_setting_that_plans",
))
def test_interleaved_over_too_few_layers_advises_a_setting_that_plans():
    # issue 35 item 11: more virtual stages than layers advised "use num_stages <= 0".
    schedule = "--params=task.network.schedule=interleaved,task.network.schedule.virtual_stages="
    line = one_error_line(inspect_blobs("--quiet", schedule + "7"))
    assert line == ("trainer.py: error: task.network.num_stages=2 x schedule.virtual_stages=7 = 14 chunks must be "
                    "between 1 and the number of layers (6); use schedule.virtual_stages <= 3"), line
    advised = inspect_blobs(schedule + "3")
    assert advised.returncode == 0, advised.stderr[-2000:]
    assert "pipeline task.network: K=2 x 3 chunks per device (chunk devices 0 1 0 1 0 1) M=4" in advised.stdout, \
        advised.stdout


def test_accelerator_prints_the_speed_plan_and_its_json():
    result = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe",
                                  "--mode=inspect", "--accelerator=a100", "--accelerator_devices=4", "--json"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    speed = json.loads(result.stdout)["speed"]
    assert speed["accelerator"] == "a100" and speed["device_memory"] == 80 * 2 ** 30
    assert {r["num_stages"] for r in speed["rows"]} == {1, 2, 4}
    fastest = speed["fastest"]
    assert fastest["fits"] and fastest["step_seconds"] == min(r["step_seconds"] for r in speed["rows"])
    text = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe",
                                "--mode=inspect", "--accelerator=a100", "--accelerator_devices=4"],
                               cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "speed plan on 4 x a100: float32 156 TFLOP/s" in text.stdout, text.stdout
    own = fastest["params"] == speed["current"]["params"]  # the same arithmetic in both runs: the same fastest
    assert ("fastest that fits: the experiment's own configuration" if own else f"--params={fastest['params']}") in (
        text.stdout), text.stdout


@pytest.mark.parametrize("flags,fragments", [
    (["--mode=inspect", "--accelerator=tpu_v9"], ["--accelerator='tpu_v9' is not a preset", "tpu_v3", "h100"]),
    (["--mode=inspect", "--accelerator_flops=1e14"], ["--accelerator_bandwidth=bytes/s"]),
    (["--mode=train", "--accelerator=tpu_v3"], ["use them with --mode=inspect, not --mode=train"]),
])
def test_bad_accelerator_flags_are_one_line_exit_2(flags, fragments):
    result = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", *flags],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert_user_error(result, *fragments)
