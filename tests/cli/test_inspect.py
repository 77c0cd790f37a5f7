"""--mode=inspect explains what it cannot estimate, echoes the command's overrides and the balance criterion."""

import subprocess
import sys

from gpipe_tf import experiment, inspection
from tests.helpers.paths import ROOT

KEY = "mt.gpipe_paper.TransformerLTinyOffline"


def test_transformer_activations_are_explained_and_estimated_once_the_shape_is_given():
    params, _ = experiment.resolve_params(KEY)
    report = inspection.inspect(params)
    assert all(s["activation_bytes_estimate"] is None for s in report["stages"])
    text = inspection.format_report(report)
    assert "note: activations '-': task.network.micro_batch_shape is not set" in text, text
    assert "--params=task.network.micro_batch_shape=" in text

    shaped, _ = experiment.resolve_params(
        KEY, overrides="task.network.micro_batch_shape=[4, 16],task.network.input_dtype='int32'")
    report = inspection.inspect(shaped)
    assert report["estimate_notes"] == []
    # Stage 0 (no remat, M=4): the embedding's and the first layer's [4, 16, 64] float32 outputs, per micro-batch.
    assert report["stages"][0]["activation_bytes_estimate"] == 4 * 2 * (4 * 16 * 64 * 4)


def test_balance_criterion_is_stated():
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    text = inspection.format_report(inspection.inspect(params))
    assert ("balance: balance_by='params', the contiguous split minimizing the largest stage's parameter count; "
            "stage costs 4,160 .. 5,248") in text, text
    explicit, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides="task.network.balance=[2, 4]")
    assert "balance: explicit balance=[2, 4]" in inspection.format_report(inspection.inspect(explicit))


def test_trainer_inspect_echoes_the_overrides():
    result = subprocess.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", "--mode=inspect",
                             "--gin_param=BlobsMlpGPipe.num_micro_batches=2", "--params=train.learning_rate=0.5"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert "overrides --gin_param: BlobsMlpGPipe.num_micro_batches=2" in lines, result.stdout
    assert "overrides --params: train.learning_rate=0.5" in lines, result.stdout
    assert "pipeline task.network: K=2 M=2 remat=always" in lines, result.stdout
