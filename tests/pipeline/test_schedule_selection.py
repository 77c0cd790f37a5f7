"""Choosing a pipeline's schedule: every form docs/pipeline.md#setting-the-schedule lists (the `cls` path with
the class's own fields after it, a short name or a class path in --params, the experiments' `schedule` knob
through gin), and the one name the run's HParams, params.txt and console then show for it. One real trainer run
checks the files and the console."""

import os
import sys

import pytest

from gpipe_tf import experiment
from gpipe_tf.gpipe.fill_drain import FillDrain
from gpipe_tf.gpipe.interleaved import Interleaved
from gpipe_tf.gpipe.one_f_one_b import OneForwardOneBackward
from gpipe_tf.gpipe.schedules import schedule_name
from gpipe_tf.gpipe.unrolled import Unrolled
from gpipe_tf.gpipe.zero_bubble import ZeroBubble
from gpipe_tf.gpipe.zero_bubble_v import ZeroBubbleV
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training import hparams
from tests.helpers import trainer_process
from tests.helpers.event_files import session_hparams
from tests.helpers.paths import ROOT

KEY = "toy.classifier.BlobsMlpGPipe"
PATHS = {"fill_drain": "gpipe_tf.gpipe.fill_drain.FillDrain", "unrolled": "gpipe_tf.gpipe.unrolled.Unrolled",
         "one_f_one_b": "gpipe_tf.gpipe.one_f_one_b.OneForwardOneBackward",
         "interleaved": "gpipe_tf.gpipe.interleaved.Interleaved",
         "zero_bubble": "gpipe_tf.gpipe.zero_bubble.ZeroBubble",
         "zero_bubble_v": "gpipe_tf.gpipe.zero_bubble_v.ZeroBubbleV"}
CLASSES = {"fill_drain": FillDrain, "unrolled": Unrolled, "one_f_one_b": OneForwardOneBackward,
           "interleaved": Interleaved, "zero_bubble": ZeroBubble, "zero_bubble_v": ZeroBubbleV}


def _schedule(overrides="", bindings=(), key=KEY):
    return experiment.resolve(key, gin_bindings=bindings, overrides=overrides).params.task.network.schedule


@pytest.mark.parametrize("name", sorted(PATHS))
@pytest.mark.parametrize("form", ["cls", "name", "quoted name", "class path"])
def test_every_schedule_is_settable_by_every_override_form(name, form):
    key = "task.network.schedule"
    text = {"cls": f"{key}.cls={PATHS[name]}", "name": f"{key}={name}", "quoted name": f"{key}='{name}'",
            "class path": f"{key}={PATHS[name]}"}[form]
    # The node becomes the class's own default Params: no field of FillDrain's is left behind.
    assert _schedule(text) == CLASSES[name].params()


@pytest.mark.parametrize("form", ["task.network.schedule.cls=gpipe_tf.gpipe.interleaved.Interleaved",
                                  "task.network.schedule=interleaved"])
def test_the_new_class_fields_are_settable_after_it_in_the_same_string(form):
    # The command line of docs/pipeline.md#setting-the-schedule: the new class's field after the class, in one
    # string, is that class's field (not an unknown param of the schedule it replaces).
    schedule = _schedule(f"{form},task.network.schedule.virtual_stages=3")
    assert schedule.cls is Interleaved and schedule.virtual_stages == 3
    # FillDrain's knob under FillDrain, after naming it.
    schedule = _schedule("task.network.schedule=fill_drain,task.network.schedule.parallel_iterations=2")
    assert schedule.cls is FillDrain and schedule.parallel_iterations == 2
    # Unrolled has no parallel_iterations: setting it after switching is refused, naming what is defined.
    with pytest.raises(ParamsError, match="unknown param 'task.network.schedule.parallel_iterations'"):
        _schedule("task.network.schedule=unrolled,task.network.schedule.parallel_iterations=2")
    # Nor have the schedules whose loop does not honour it (their loop runs M iterations at once, ordered by
    # their order data): 1F1B has no knob, Interleaved only virtual_stages.
    for name in ("one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v"):
        with pytest.raises(ParamsError, match="unknown param 'task.network.schedule.parallel_iterations'"):
            _schedule(f"task.network.schedule={name},task.network.schedule.parallel_iterations=2")


@pytest.mark.parametrize("name", ["fill_drain", "one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v"])
def test_batched_weight_gradients_are_set_from_the_command_line(name):
    schedule = _schedule(f"task.network.schedule={name},task.network.schedule.batch_weight_gradients=True")
    assert schedule.cls is CLASSES[name] and schedule.batch_weight_gradients is True
    v = "virtual_stages=2, " if name == "interleaved" else ""
    assert schedule_name(schedule) == f"{CLASSES[name].__name__}({v}batch_weight_gradients=True)"


def test_naming_the_schedule_a_pipeline_already_has_keeps_its_fields_in_every_form():
    # Interleaved with v=3, then named again: by name (whose default is v=2), quoted name, class path and cls.
    chosen = "task.network.schedule=interleaved,task.network.schedule.virtual_stages=3"
    for form in ("task.network.schedule=interleaved", "task.network.schedule='interleaved'",
                 f"task.network.schedule={PATHS['interleaved']}", f"task.network.schedule.cls={PATHS['interleaved']}"):
        resolved = experiment.resolve(KEY, overrides=f"{chosen},{form}")
        assert resolved.params.task.network.schedule == Interleaved.params().set(virtual_stages=3), form
        assert resolved.notes == (), form
    # Another schedule starts from its defaults, and the note says what was reset.
    resolved = experiment.resolve(KEY, overrides=f"{chosen},task.network.schedule=one_f_one_b")
    assert resolved.params.task.network.schedule == OneForwardOneBackward.params()
    assert resolved.notes == ("note: --params task.network.schedule=one_f_one_b replaces Interleaved by "
                              "OneForwardOneBackward at its defaults, so what was set on Interleaved is reset: "
                              "virtual_stages=3 (set OneForwardOneBackward's fields after the class in --params)",)


def test_unrolled_has_no_batched_weight_gradients():
    with pytest.raises(ParamsError, match="unknown param 'task.network.schedule.batch_weight_gradients'"):
        _schedule("task.network.schedule=unrolled,task.network.schedule.batch_weight_gradients=True")


def test_a_bad_schedule_name_or_class_is_one_line_naming_the_choices():
    with pytest.raises(ParamsError) as info:
        _schedule("task.network.schedule=interleave")
    message = str(info.value)
    assert "'interleave'" in message and "fill_drain, interleaved, one_f_one_b, spmd, unrolled" in message
    assert "\n" not in message
    with pytest.raises(ParamsError, match="os.path.join has no params"):
        _schedule("task.network.schedule=os.path.join")


@pytest.mark.parametrize("name", sorted(PATHS))
def test_the_experiment_knob_takes_every_name_through_gin(name):
    assert _schedule(bindings=[f"BlobsMlpGPipe.schedule='{name}'"]) == CLASSES[name].params()
    numbers = [f"NumbersTiny.schedule='{name}'", "NumbersTiny.num_stages=2"]
    assert _schedule(bindings=numbers, key="mt.number_words.NumbersTiny") == CLASSES[name].params()


def test_a_schedule_knob_without_a_pipeline_is_refused():
    with pytest.raises(ParamsError, match=r"BlobsMlp.schedule='interleaved' needs a pipeline"):
        _schedule(bindings=["BlobsMlp.schedule='interleaved'"], key="toy.classifier.BlobsMlp")


def test_hparams_name_the_schedule_that_runs_once():
    # The knob still says fill_drain while --params replaced the schedule: only the schedule that runs is shown.
    resolved = experiment.resolve(KEY, overrides="task.network.schedule=interleaved,"
                                                 "task.network.schedule.virtual_stages=3")
    values = hparams.hparams_of(resolved.params, resolved.knobs)
    assert values["pipeline.schedule"] == "Interleaved(virtual_stages=3)"
    assert [name for name in values if "schedule" in name] == ["pipeline.schedule"]
    resolved = experiment.resolve(KEY, gin_bindings=["BlobsMlpGPipe.schedule='one_f_one_b'"])
    values = hparams.hparams_of(resolved.params, resolved.knobs)
    assert values["pipeline.schedule"] == "OneForwardOneBackward"
    assert [name for name in values if "schedule" in name] == ["pipeline.schedule"]


@pytest.mark.exhaustive(covered_by=(
    "tests/pipeline/test_schedule_selection.py::test_hparams_name_the_schedule_that_runs_once",
    "tests/pipeline/test_schedule_selection.py::test_every_schedule_is_settable_by_every_override_form",
))
def test_a_trainer_run_shows_the_schedule_that_ran_in_hparams_params_txt_and_console(tmp_path):
    logdir = str(tmp_path / "run")
    result = trainer_process.run(
        [sys.executable, "trainer.py", f"--model={KEY}", f"--logdir={logdir}", "--max_steps=2",
         "--params=task.network.schedule.cls=gpipe_tf.gpipe.interleaved.Interleaved,"
         "task.network.schedule.virtual_stages=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "schedule=Interleaved(virtual_stages=3)" in result.stdout, result.stdout
    text = open(os.path.join(logdir, "params.txt")).read()
    lines = [line for line in text.splitlines() if line.startswith("task.network.schedule")]
    assert lines == ["task.network.schedule : InstantiableParams(gpipe_tf.gpipe.interleaved.Interleaved)",
                     "task.network.schedule.batch_weight_gradients : 'auto'",
                     "task.network.schedule.virtual_stages : 3"]
    values = session_hparams(logdir)
    assert values["pipeline.schedule"] == "Interleaved(virtual_stages=3)"
    assert [name for name in values if "schedule" in name] == ["pipeline.schedule"]


@pytest.mark.parametrize("before, after", [("fill_drain", "unrolled"), ("unrolled", "interleaved"),
                                           ("interleaved", "one_f_one_b")])
def test_a_run_may_resume_with_another_schedule_whose_fields_differ(tmp_path, before, after):
    # Switching gives the new class's own fields (Unrolled has no parallel_iterations, Interleaved adds
    # virtual_stages): fields only one side has are as math-neutral as the schedule itself.
    from gpipe_tf.training import logdir as logdir_lib

    logdir = str(tmp_path / "run")
    os.makedirs(os.path.join(logdir, "checkpoints"))
    open(os.path.join(logdir, "checkpoints", "ckpt-4.index"), "w").close()
    old = experiment.resolve(KEY, overrides=f"task.network.schedule={before}").params
    logdir_lib.write_params(logdir, old)
    logdir_lib.check_compatible(logdir, experiment.resolve(KEY, overrides=f"task.network.schedule={after}").params,
                                training=True)
