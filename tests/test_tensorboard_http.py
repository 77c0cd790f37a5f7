"""The real TensorBoard server, started on 127.0.0.1 against a trained logdir, serves our scalars over HTTP."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.summaries import read_scalars


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url, deadline):
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


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
        deadline = time.time() + 90
        while True:
            tags = get_json(f"{base}/scalars/tags", deadline)
            if "train" in tags and "loss" in tags["train"]:
                break
            assert time.time() < deadline, tags
            time.sleep(1)
        for tag in ("loss", "learning_rate", "grad_norm", "var_norm", "examples_per_sec", "steps_per_sec",
                    "step_time"):
            assert tag in tags["train"], (tag, tags["train"])
        query = urllib.parse.urlencode({"tag": "loss", "run": "train"})
        served = get_json(f"{base}/scalars/scalars?{query}", deadline)
        expected = read_scalars(os.path.join(logdir, "train"))["loss"]
        assert [(step, round(value, 5)) for _, step, value in served] == [(s, round(v, 5)) for s, v in expected]
        text_tags = get_json(f"{base}/text/tags", deadline)
        assert {"params", "partition", "schedule"} <= set(text_tags.get("train", [])), text_tags
        image_tags = get_json(f"{base}/images/tags", deadline)
        assert any(tag.startswith("schedule/") for tag in image_tags.get("train", {})), image_tags
    finally:
        server.terminate()
        server.wait(timeout=30)
