"""The real TensorBoard server, started on 127.0.0.1 against a trained logdir, serves our scalars over HTTP."""

import json
import os
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.summaries import read_scalars
from tests.helpers.waiting import poll


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture()
def logdir(tmp_path):
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe",
                                          overrides="train.max_steps=20,train.summary_interval_steps=5")
    logdir_lib.prepare(str(tmp_path), params)
    Controller(params, str(tmp_path), log=lambda s: None).train()
    return str(tmp_path)


def test_tensorboard_serves_the_training_scalars(logdir):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}", "--host=127.0.0.1",
                               f"--port={port}", "--reload_interval=1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/data/plugin"
        tags = poll(lambda: get_json(f"{base}/scalars/tags"), lambda tags: "loss" in tags.get("train", {}),
                    "TensorBoard serving the train loss tag")
        for tag in ("loss", "learning_rate", "grad_norm", "var_norm", "examples_per_sec", "steps_per_sec",
                    "step_time"):
            assert tag in tags["train"], (tag, tags["train"])
        query = urllib.parse.urlencode({"tag": "loss", "run": "train"})
        served = get_json(f"{base}/scalars/scalars?{query}")
        expected = read_scalars(os.path.join(logdir, "train"))["loss"]
        assert [(step, round(value, 5)) for _, step, value in served] == [(s, round(v, 5)) for s, v in expected]
        text_tags = get_json(f"{base}/text/tags")
        assert {"params", "partition", "pipeline_timeline"} <= set(text_tags.get("train", [])), text_tags
        image_tags = get_json(f"{base}/images/tags")
        assert any(tag.startswith("pipeline_timeline/") for tag in image_tags.get("train", {})), image_tags
    finally:
        server.terminate()
        server.wait(timeout=30)
