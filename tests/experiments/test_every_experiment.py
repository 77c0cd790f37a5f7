"""Every registered experiment resolves and can be inspected from Params alone; published sizes hold."""

import pytest

from gpipe_tf import experiment, inspection, model_registry
from gpipe_tf.gpipe.batch_shapes import micro_batch_shapes
from gpipe_tf.gpipe.pipeline import find_pipelines

PUBLISHED = {  # trainable parameters, no aux head ([GP], [AMB]; tolerance as in issue 5)
    "image.amoebanet.AmoebaNetB_18_512_ImageNet480": (557e6, 0.01),
    "image.amoebanet.AmoebaNetD_18_208": (82e6, 0.015),
    "image.amoebanet.AmoebaNetD_18_416": (318e6, 0.015),
    "image.amoebanet.AmoebaNetD_18_544": (542e6, 0.015),
}


@pytest.mark.parametrize("key", model_registry.list_models())
def test_every_experiment_resolves_and_inspects(key):
    params, _ = experiment.resolve_params(key)
    report = inspection.inspect(params)
    assert report["total_params"] > 0
    if report["stages"]:
        assert sum(s["params"] for s in report["stages"]) <= report["total_params"]
        assert all(s["params"] > 0 for s in report["stages"])
    if key in PUBLISHED:
        published, tolerance = PUBLISHED[key]
        assert abs(report["total_params"] - published) <= tolerance * published, report["total_params"]
    # The memory plan needs no flag: the experiment sizes its pipeline's micro-batch from its own training batch.
    pipelines = find_pipelines(params.task)
    assert (report.get("memory") is not None) == bool(pipelines), report.get("estimate_notes")
    for _, pipe in pipelines:
        shapes, _ = micro_batch_shapes(pipe.micro_batch_shape)
        assert {s[0] * pipe.num_micro_batches for s in shapes} == {params.input.train.batch_size}
    if report.get("memory") is not None:
        # Every parameter of the task is on a device of the plan: the pipeline's, and the loss head's on the last
        # chunk's device (e.g. Transformer-L_3's 65.5M-parameter softmax).
        memory = report["memory"]
        assert sum(d["params"] for d in memory["devices"]) == report["total_params"], memory["head"]


def test_a_translation_pipelines_suggestion_pastes_back_and_fits():
    """A pipeline fed several tensors (the translation network's 4-tuple) is planned, and the smallest change
    that fits rescales every one of its micro-batch shapes in an override that resolves and fits."""
    budget = 20 * 2 ** 20
    params, _ = experiment.resolve_params("mt.number_words.NumbersTiny")
    plan = inspection.inspect(params, overrides={}, device_memory=budget)["memory"]
    assert plan["fits"] is False and plan["suggestion"] is not None
    changed, _ = experiment.resolve_params("mt.number_words.NumbersTiny", overrides=plan["suggestion"]["params"])
    (_, pipe), = find_pipelines(changed.task)
    rows = changed.input.train.batch_size // pipe.num_micro_batches
    assert pipe.micro_batch_shape == [[rows, 16]] * 4
    assert inspection.inspect(changed, overrides={}, device_memory=budget)["memory"]["fits"] is True


@pytest.mark.exhaustive(covered_by=(
    "tests/layers/test_amoebanet_layers.py::test_gpipe_equals_sequential",
    "tests/experiments/test_every_experiment.py::test_every_experiment_resolves_and_inspects",
))
def test_tiny_amoebanet_trains_a_few_pipelined_steps(tmp_path):
    from gpipe_tf.training import logdir as logdir_lib
    from gpipe_tf.training.controller import Controller

    params, _ = experiment.resolve_params("image.amoebanet.AmoebaNetTinyOffline", overrides="train.max_steps=3")
    logdir_lib.prepare(str(tmp_path), params)
    metrics = Controller(params, str(tmp_path), log=lambda s: None).train()
    assert metrics["loss"] > 0 and (tmp_path / "timeline.png").exists()
