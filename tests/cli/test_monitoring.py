"""What TensorBoard shows of a run: HParams (knobs, pipeline settings, final metrics), memory scalars on CPU, a
readable timeline picture, and logdir/operative_config.gin; and a real TensorBoard server listing the run in its
HParams plugin. One trainer process trains and evaluates a pipelined run; the tests read what it wrote."""

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import tensorflow as tf
from tensorboard.plugins.hparams import metadata as hparams_metadata

from gpipe_tf import experiment
from gpipe_tf.training.summaries import read_scalars
from tests.helpers import trainer_process
from tests.helpers.event_files import events
from tests.helpers.paths import ROOT
from tests.helpers.waiting import poll

KEY = "toy.classifier.BlobsMlpGPipe"
STEPS = 10


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("monitoring") / "lr0.01")
    # No TF_CPU_ALLOCATOR_USE_BFC from outside, and oneDNN off as on CPUs without AVX-512, where TensorFlow's
    # default CPU allocator keeps no statistics: the trainer must choose the BFC allocator itself.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    result = trainer_process.run(
        [sys.executable, "trainer.py", f"--model={KEY}", f"--logdir={logdir}", "--mode=train_and_eval",
         f"--max_steps={STEPS}", "--quiet", "--gin_param=BlobsMlpGPipe.learning_rate=0.01",
         "--params=train.summary_interval_steps=5,train.eval_interval_steps=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


def test_operative_config_holds_every_knob_and_reproduces_the_run(run):
    text = open(os.path.join(run, "operative_config.gin")).read()
    knobs = experiment.resolve(KEY).knobs
    bound = dict(re.findall(r"^BlobsMlpGPipe\.(\w+) = (.+)$", text, flags=re.M))
    assert set(bound) == set(knobs), text
    assert bound["learning_rate"] == "0.01" and bound["num_stages"] == "2", text
    # As a gin file it gives back the run's Params.
    again = experiment.resolve(KEY, gin_files=[os.path.join(run, "operative_config.gin")],
                               overrides=f"train.max_steps={STEPS},train.summary_interval_steps=5,"
                                         "train.eval_interval_steps=0")
    assert again.params.to_text() == open(os.path.join(run, "params.txt")).read().rstrip("\n")


def test_hparams_session_lists_knobs_pipeline_and_final_metrics(run):
    session, config = None, None
    for event in events(run):
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name != hparams_metadata.PLUGIN_NAME:
                continue
            content = value.metadata.plugin_data.content
            if value.tag == hparams_metadata.SESSION_START_INFO_TAG:
                session = hparams_metadata.parse_session_start_info_plugin_data(content)
            elif value.tag == hparams_metadata.EXPERIMENT_TAG:
                config = hparams_metadata.parse_experiment_plugin_data(content)
    assert session is not None and config is not None
    values = {name: getattr(v, v.WhichOneof("kind")) for name, v in session.hparams.items()}
    assert values["model"] == KEY and values["learning_rate"] == 0.01 and values["hidden_dims"] == "(64, 64, 64)"
    assert values["pipeline.num_stages"] == 2 and values["pipeline.num_micro_batches"] == 4
    assert values["pipeline.remat"] == "always" and values["pipeline.schedule"] == "FillDrain"
    assert values["train.optimizer"] == "Adam" and values["input.train.batch_size"] == 64
    assert {h.name for h in config.hparam_infos} == set(values)
    tags = [m.name.tag for m in config.metric_infos]
    assert tags == ["train/loss", "eval_dev/accuracy", "eval_dev/loss", "eval_test/accuracy", "eval_test/loss"]
    # The final values sit beside the session, equal to what the run's own summaries hold at the last step.
    final = read_scalars(run)
    for tag in tags:
        job, name = tag.split("/")
        assert final[tag] == [read_scalars(os.path.join(run, job))[name][-1]], tag


def test_memory_scalars_on_cpu(run):
    scalars = read_scalars(os.path.join(run, "train"))
    for device in ("CPU:0", "CPU:1"):  # two logical CPUs: the pipeline's two stages
        peaks = scalars[f"memory/peak_mb/{device}"]
        assert [step for step, _ in peaks] == [5, 10] and all(value > 0 for _, value in peaks), peaks


def test_schedule_summary_image_is_large_enough_to_read(run):
    images = [(value.tag, value.tensor) for event in events(os.path.join(run, "train")) for value in event.summary.value
              if value.metadata.plugin_data.plugin_name == "images"]
    assert [tag for tag, _ in images] == ["pipeline_timeline/classifier/network"]
    width, height, png = tf.make_ndarray(images[0][1])
    picture = tf.io.decode_png(png).numpy()
    assert (int(width), int(height)) == (picture.shape[1], picture.shape[0])
    assert picture.shape[1] >= 1000 and picture.shape[0] >= 150, picture.shape
    file_picture = tf.io.decode_png(open(os.path.join(run, "timeline.png"), "rb").read()).numpy()
    assert (file_picture == picture).all()


def _post_json(url, body, timeout=10):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _get_json(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def test_tensorboard_server_lists_the_run_in_its_hparams_plugin(run, tmp_path):
    # --port=0: the server picks a free port and prints its address; read it from its log file (bounded wait).
    log_path = tmp_path / "tensorboard.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", f"--logdir={run}", "--host=127.0.0.1",
                                   "--port=0", "--reload_interval=1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def address():
            assert server.poll() is None, f"TensorBoard exited: {log_path.read_text()[-2000:]}"
            return re.search(r"http://127\.0\.0\.1:(\d+)/", log_path.read_text())

        port = int(poll(address, bool, "TensorBoard printing its address").group(1))
        base = f"http://127.0.0.1:{port}/data"

        def hparams():
            listing = _get_json(f"{base}/plugins_listing")
            groups = _post_json(f"{base}/plugin/hparams/session_groups", {
                "startIndex": 0, "sliceSize": 10,
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]})
            return listing, groups

        _, groups = poll(hparams, lambda got: got[0]["hparams"]["enabled"] and bool(got[1].get("sessionGroups")) and
                         len(got[1]["sessionGroups"][0].get("metricValues", [])) == 5,
                         "TensorBoard's HParams plugin listing the run with its 5 metrics", interval_s=1.0)
        (group,) = groups["sessionGroups"]
        assert group["name"] == "lr0.01"
        assert group["hparams"]["model"] == KEY and group["hparams"]["pipeline.num_stages"] == 2
        served = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        expected = {tag: values[-1][1] for tag, values in read_scalars(run).items()}
        assert served.keys() == expected.keys()
        for tag, value in expected.items():
            assert served[tag] == pytest.approx(value, rel=1e-6), tag
        experiment_info = _post_json(f"{base}/plugin/hparams/experiment", {"experimentName": ""})
        assert {"learning_rate", "pipeline.num_micro_batches"} <= {h["name"] for h in experiment_info["hparamInfos"]}
    finally:
        server.terminate()
        server.wait(timeout=30)
