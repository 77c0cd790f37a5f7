"""Every registered experiment resolves and can be inspected from Params alone; published sizes hold."""

import pytest

from gpipe_tf import experiment, inspection, model_registry

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
