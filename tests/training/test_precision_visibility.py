"""A run says which precision it computes in: one console line when training starts and HParams columns, so a
bfloat16 and a float32 run no longer look the same; and a stage whose gradients all underflow to zero is named in a
warning with the fix."""

import sys

import pytest

from gpipe_tf import experiment
from gpipe_tf.training import hparams, zero_gradients
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.learner import Learner, describe_precision
from gpipe_tf.training.loss_scale import loss_scale_params
from tests.helpers import trainer_process
from tests.helpers.event_files import session_hparams
from tests.helpers.paths import ROOT


@pytest.mark.parametrize("overrides, expected", [
    ("", {"weight_dtype": "float32", "compute_dtype": "float32", "loss_scale": "none"}),
    ("task.fprop_dtype=bfloat16", {"weight_dtype": "float32", "compute_dtype": "bfloat16", "loss_scale": "none"}),
    ("task.fprop_dtype=float16", {"weight_dtype": "float32", "compute_dtype": "float16",
                                  "loss_scale": "dynamic from 32768"}),
    ("task.fprop_dtype=float16,train.loss_scale.method=fixed,train.loss_scale.initial_scale=128.0",
     {"weight_dtype": "float32", "compute_dtype": "float16", "loss_scale": "fixed 128"}),
    ("task.softmax.fprop_dtype=bfloat16", {"weight_dtype": "float32", "compute_dtype": "bfloat16+float32",
                                           "loss_scale": "none"}),
])
def test_the_learner_names_its_weight_and_compute_dtypes_and_loss_scaling(overrides, expected):
    params = experiment.resolve("toy.classifier.BlobsMlp", overrides=overrides).params
    learner = Learner(params.task.instantiate(), params.train)
    assert learner.precision == expected
    assert describe_precision(learner.precision) == (
        f"precision: weights {expected['weight_dtype']}, compute {expected['compute_dtype']}, "
        f"loss scaling {expected['loss_scale']}")
    resolved = experiment.resolve("toy.classifier.BlobsMlp", overrides=overrides)
    values = hparams.hparams_of(resolved.params, resolved.knobs, learner.precision)
    assert {name: values[f"precision.{name}"] for name in expected} == expected


@pytest.mark.exhaustive(covered_by=(
    "tests/training/test_precision_visibility.py::test_the_learner_names_its_weight_and_compute_dtypes_and_loss_scaling",
))
def test_a_float16_trainer_run_prints_its_precision_and_writes_it_to_hparams(tmp_path):
    logdir = str(tmp_path / "run")
    result = trainer_process.run(
        [sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", f"--logdir={logdir}", "--max_steps=2",
         "--params=task.fprop_dtype=float16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("precision:")]
    assert lines == ["precision: weights float32, compute float16, loss scaling dynamic from 32768"], result.stdout
    values = session_hparams(logdir)
    assert values["precision.compute_dtype"] == "float16" and values["precision.loss_scale"] == "dynamic from 32768"
    assert values["precision.weight_dtype"] == "float32"


def test_stages_group_the_variables_of_each_pipeline_stage_and_those_outside():
    params = experiment.resolve("toy.classifier.BlobsMlpGPipe", overrides="task.network.fprop_dtype=float16").params
    task = params.task.instantiate()
    variables = list(task.trainable_variables)
    stages = zero_gradients.stages_of(task, variables)
    named = {stage.name: ({variables[i].name[:-2] for i in stage.indices}, stage.float16) for stage in stages}
    assert named == {
        "stage 0 of classifier/network": ({f"classifier/network/fc{j}/{v}" for j in (0, 1) for v in "wb"}, True),
        "stage 1 of classifier/network": ({"classifier/network/fc2/w", "classifier/network/fc2/b"}, True),
        "the layers outside the pipeline": ({"classifier/softmax/w", "classifier/softmax/b"}, False)}
    plain = experiment.resolve("toy.classifier.BlobsMlp").params.task.instantiate()
    assert [(s.name, len(s.indices)) for s in zero_gradients.stages_of(plain, plain.trainable_variables)] == [
        ("the model", 6)]


def test_the_watch_warns_once_per_run_of_zero_steps_naming_the_stage_and_the_fix():
    stages = [zero_gradients.StageGradients("stage 0 of net", (0, 1, 2), True),
              zero_gradients.StageGradients("stage 1 of net", (3,), False)]
    names = ["net/a/w", "net/a/b", "net/b/w", "net/c/w"]
    watch = zero_gradients.ZeroGradientWatch(stages, names, "none", loss_scale_params(), steps_in_a_row=3)
    masks = [[True, True, True, False]] * 4 + [[True, False, True, True]] + [[True, True, True, True]] * 3
    said = {step: watch.observe(step, mask) for step, mask in enumerate(masks, start=11)}
    assert said == {11: [], 12: [], 13: [
        "warning: every gradient of stage 0 of net (net/a/w, net/a/b and 1 more) was exactly zero in steps 11-13 (3 in "
        "a row), so its weights do not train: its float16 gradients underflow (magnitudes below 6e-8 round to zero) as "
        "the run computes in float16 without loss scaling: turn it on, --params=train.loss_scale.method=dynamic "
        "(docs/precision.md#float16-and-loss-scaling)"], 14: [], 15: [], 16: [], 17: [
        "warning: every gradient of stage 1 of net (net/c/w) was exactly zero in steps 15-17 (3 in a row), so its "
        "weights do not train: nothing of the loss reaches it: look for a dead activation (ReLU units that never "
        "fire), a stop_gradient or a zero loss weight"], 18: [
        "warning: every gradient of stage 0 of net (net/a/w, net/a/b and 1 more) was exactly zero in steps 16-18 (3 in "
        "a row), so its weights do not train: its float16 gradients underflow (magnitudes below 6e-8 round to zero) as "
        "the run computes in float16 without loss scaling: turn it on, --params=train.loss_scale.method=dynamic "
        "(docs/precision.md#float16-and-loss-scaling)"]}
    fixed = loss_scale_params().set(method="fixed", initial_scale=1e-9)
    assert zero_gradients.fix_for(stages[0], "fixed", fixed).endswith(
        "at the fixed loss scale 1e-09: raise train.loss_scale.initial_scale, or set train.loss_scale.method=dynamic "
        "(docs/precision.md#float16-and-loss-scaling)")


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_resume_console.py::test_float16_gradients_that_underflow_are_named_with_the_fix",
    "tests/training/test_precision_visibility.py::test_the_watch_warns_once_per_run_of_zero_steps_naming_the_stage_and_the_fix",
))
@pytest.mark.parametrize("loss_scale", ["none", "dynamic"])
def test_float16_gradients_that_underflow_in_training_are_named_and_loss_scaling_cures_them(tmp_path, loss_scale):
    # A softmax with tiny weights sends float16 gradients below 6e-8 into the pipeline: they round to zero there
    # (the learning rate keeps the weights tiny, so it stays so for every step).
    p, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides=(
        "task.fprop_dtype=float16,train.max_steps=6,train.save_interval_steps=6,train.learning_rate=1e-9,"
        f"train.loss_scale.method={loss_scale}"))
    logdir_lib.prepare(str(tmp_path), p)
    lines = []
    controller = Controller(p, str(tmp_path), log=lines.append)
    controller.prepare_training()
    w = controller.task.softmax.vars["w"]
    w.assign(w * 1e-7)
    controller.train()
    warnings = [line for line in lines if line.startswith("warning: every gradient")]
    if loss_scale == "dynamic":
        assert warnings == []
        return
    fix = ("so its weights do not train: its float16 gradients underflow (magnitudes below 6e-8 round to zero) as the "
           "run computes in float16 without loss scaling: turn it on, --params=train.loss_scale.method=dynamic "
           "(docs/precision.md#float16-and-loss-scaling)")
    assert warnings == [
        "warning: every gradient of stage 0 of classifier/network (classifier/network/fc0/b, classifier/network/fc0/w "
        f"and 2 more) was exactly zero in steps 1-5 (5 in a row), {fix}",
        "warning: every gradient of stage 1 of classifier/network (classifier/network/fc2/b, classifier/network/fc2/w) "
        f"was exactly zero in steps 1-5 (5 in a row), {fix}"]
