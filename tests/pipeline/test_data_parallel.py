"""Data parallelism: D replicas of a K-stage pipeline equal one un-pipelined model on the same global batch."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment, workers
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.schedules import SCHEDULES
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers import stateless_random
from gpipe_tf.tasks.classifier import ClassifierTask
from gpipe_tf.training import replicas
from gpipe_tf.training.learner import Learner
from gpipe_tf.training.replicas import replica_home_devices
from tests.helpers import tiers, trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_runs import checkpoint_values

KEY = "toy.classifier.BlobsMlpGPipe"


def train(num_replicas, num_stages, num_micro_batches, steps=5, dropout=0.0, schedule="fill_drain"):
    params, _ = experiment.resolve_params(KEY, gin_bindings=[f"BlobsMlpGPipe.dropout_rate = {dropout}"])
    p = params.copy()
    p.task.network.set(num_stages=num_stages, num_micro_batches=num_micro_batches, schedule=schedule,
                       micro_batch_shape=[64 // (num_micro_batches * num_replicas), 16])
    layout = replicas.ReplicaLayout(local_replicas=num_replicas)
    with placement.replicas(num_replicas):
        task = p.task.instantiate()
    layout.attach_devices(replica_home_devices(task, num_replicas))
    learner = Learner(task, p.train, layout)
    batches = iter(p.input.train.instantiate().dataset())
    losses = [float(learner.train_step(next(batches))["loss"]) for _ in range(steps)]
    return task, losses, [v.numpy() for v in task.trainable_variables]


def relative(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_replica_stage_mapping():
    assert placement.replica_stage_devices(2, 2, "cpu") == [["/device:CPU:0",
                                                             "/device:CPU:1"],
                                                            ["/device:CPU:2",
                                                             "/device:CPU:3"]]
    assert placement.replica_stage_devices(1, 2, "workers") == [[
        "/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"]]
    with pytest.raises(ParamsError, match="one trainer per replica"):
        placement.replica_stage_devices(2, 2, "workers")


def test_two_replicas_of_two_stages_equal_one_unpipelined_model():
    _, ref_losses, ref_vars = train(1, 1, 1)
    task, losses, got_vars = train(2, 2, 2)
    # The partition table shows where each replica runs each stage.
    assert [row.device.split() for row in task.network.partition_rows] == [
        [f"/device:CPU:{d}" for d in (0, 2)],
        [f"/device:CPU:{d}" for d in (1, 3)]]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trained: the comparison is not between two untouched models
    for got, ref in zip(got_vars, ref_vars):
        assert relative(got, ref) < 1e-5


@pytest.mark.parametrize("schedule", tiers.sample(
    ["one_f_one_b", "interleaved", "zero_bubble_v", ("zero_bubble", True), ("fill_drain", True)],
    keep=["interleaved", ("fill_drain", True)],
    ids=["one_f_one_b", "interleaved", "zero_bubble_v", "zero_bubble+batched_w", "fill_drain+batched_w"], single=True))
def test_two_replicas_of_a_loss_in_pipeline_schedule_equal_one_unpipelined_model(schedule):
    if isinstance(schedule, tuple):  # with batched weight gradients
        schedule = SCHEDULES[schedule[0]].params().set(batch_weight_gradients=schedule[1])
    _, ref_losses, ref_vars = train(1, 1, 1)
    _, losses, got_vars = train(2, 2, 2, schedule=schedule)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, ref in zip(got_vars, ref_vars):
        assert relative(got, ref) < 1e-5


def test_each_replica_folds_its_global_index_into_the_step_seed(monkeypatch):
    params, _ = experiment.resolve_params(KEY)
    p = params.copy()
    layout = replicas.ReplicaLayout(local_replicas=2)
    with placement.replicas(2):
        task = p.task.instantiate()
    layout.attach_devices(replica_home_devices(task, 2))
    seeds = []
    original = type(task).loss_and_gradients

    def recording(self, batch, ctx):
        seeds.append(ctx.seed)
        return original(self, batch, ctx)

    monkeypatch.setattr(type(task), "loss_and_gradients", recording)
    learner = Learner(task, p.train, layout)

    @tf.function(autograph=False)
    def traced_seeds(batch):
        learner._train_step(batch)
        return seeds[-2:]

    got = [s.numpy() for s in traced_seeds(next(iter(p.input.train.instantiate().dataset())))]
    step_seed = tf.constant([p.train.seed, 0], tf.int64)
    for g in range(2):
        np.testing.assert_array_equal(got[g], stateless_random.fold_in(step_seed, g).numpy())
    assert not np.array_equal(got[0], got[1])


class WeightedClassifier(ClassifierTask):
    """A classifier whose loss weighs each example by batch['weights'] (as MT weighs real target tokens)."""

    def compute_loss(self, theta, batch, ctx):
        features = self.network.fprop(theta["network"], batch["inputs"], ctx)
        xent = self.softmax.xent(self.softmax.fprop(theta["softmax"], features, ctx), batch["labels"])
        weight = tf.reduce_sum(batch["weights"])
        loss = tf.math.divide_no_nan(tf.reduce_sum(xent * batch["weights"]), weight)
        return loss, {"loss": (loss, weight)}


def test_replicas_combine_by_their_slices_loss_weights():
    """Slices with different numbers of real examples: D=2 still takes the step of one model on the batch."""
    params, _ = experiment.resolve_params(KEY, gin_bindings=["BlobsMlpGPipe.dropout_rate = 0.0"])
    batch = dict(next(iter(params.input.train.instantiate().dataset())))
    # The first replica's slice is mostly padding: 24 of its 32 examples weigh 0.
    batch["weights"] = tf.concat([tf.zeros([24]), tf.ones([40])], 0)
    results = []
    for d in (1, 2):
        p = params.copy()
        p.task.cls = WeightedClassifier
        layout = replicas.ReplicaLayout(local_replicas=d)
        with placement.replicas(d):
            task = p.task.instantiate()
        layout.attach_devices(replica_home_devices(task, d))
        learner = Learner(task, p.train, layout)
        losses = [float(learner.train_step(batch)["loss"]) for _ in range(3)]
        results.append((losses, [v.numpy() for v in task.trainable_variables]))
    (ref_losses, ref_vars), (losses, got_vars) = results
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, ref in zip(got_vars, ref_vars):
        assert relative(got, ref) < 1e-5


def test_batch_not_divisible_by_replicas_names_the_fix():
    params, _ = experiment.resolve_params(KEY)
    p = params.copy()
    p.task.network.set(num_stages=1, num_micro_batches=1, micro_batch_shape=None)
    layout = replicas.ReplicaLayout(local_replicas=3)
    with placement.replicas(3):
        task = p.task.instantiate()
    layout.attach_devices(replica_home_devices(task, 3))
    learner = Learner(task, p.train, layout)
    batch = next(iter(p.input.train.instantiate().dataset()))
    # Raised while tracing (autograph re-wraps it); the trainer checks the input's batch size before that.
    with pytest.raises(Exception, match="global batch size 64 is not divisible by the 3 data-parallel replicas"):
        learner.train_step(batch)


def test_layout_errors(monkeypatch):
    with pytest.raises(ConfigError, match="must be >= 1"):
        replicas.make_layout(0)
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ConfigError, match="is not a tf.distribute cluster config"):
        replicas.make_layout(1)
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", '
                                    '"index": 0}}')
    with pytest.raises(ConfigError, match="one pipeline replica per process"):
        replicas.make_layout(2)
    with pytest.raises(ConfigError, match="--task_index=2"):
        replicas.write_tf_config(["a:1", "b:2"], 2)
    layout = replicas.ReplicaLayout(local_replicas=2)
    with pytest.raises(ConfigError, match="distinct first-stage device"):
        layout.attach_devices(["/device:CPU:0", "/device:CPU:0"])


def trainer(*args, **kwargs):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return trainer_process.Popen([sys.executable, "trainer.py", f"--model={KEY}", *args], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"trainer did not finish: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return out


def two_workers(logdir, max_steps):
    hosts = ",".join(f"127.0.0.1:{port}" for port in workers.free_ports(2))
    procs = [trainer(f"--logdir={logdir}", "--logical_devices=2", f"--worker_hosts={hosts}", f"--task_index={i}",
                     f"--max_steps={max_steps}", "--params=train.log_interval_steps=1")
             for i in range(2)]
    try:
        return [finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.exhaustive(covered_by=(
    "tests/pipeline/test_data_parallel.py::test_two_replicas_of_two_stages_equal_one_unpipelined_model",
    "tests/pipeline/test_workers.py::test_two_worker_processes_compute_the_same_gradients",
))
def test_two_worker_processes_equal_one_process_with_two_replicas(tmp_path):
    """Two trainer processes (MultiWorkerMirroredStrategy over gRPC), each a K=2 pipeline on its own two
    logical CPUs, sharing a logdir, stopped after 3 steps and resumed to 5: the same as one process with
    D=2, K=2 on four logical CPUs."""
    single = trainer(f"--logdir={tmp_path / 'single'}", "--logical_devices=4", "--num_replicas=2", "--max_steps=5")
    finish(single)
    shared = tmp_path / "multi"
    first = two_workers(shared, 3)
    resumed = two_workers(shared, 5)
    chief, other = resumed
    assert "resumed from" in chief and "at step 3" in chief
    assert "resumed from" in other and "worker 1 of 2" in other
    # Both workers saw the same reduced loss; only the chief wrote checkpoints (steps 3 and 5).
    def losses(out):
        return [line.split()[:3] for line in out.splitlines() if line.startswith("step ")]
    assert losses(chief) == losses(other) and len(losses(chief)) == 2
    assert "step 1/3" in first[0] and "step 1/3" in first[1]
    ckpts = sorted(f for f in os.listdir(shared / "checkpoints") if f.endswith(".index"))
    assert ckpts == ["ckpt-3.index", "ckpt-5.index"]
    ref, got = checkpoint_values(tmp_path / "single"), checkpoint_values(shared)
    assert ref.keys() == got.keys()
    for name in ref:
        if name.startswith("save_counter"):  # how many checkpoints each run wrote: 1 vs 2
            continue
        if np.issubdtype(ref[name].dtype, np.floating):
            assert relative(got[name], ref[name]) < 1e-5, name
        else:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    assert int(got["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == 5


def test_trainer_rejects_batch_not_divisible_by_replicas(tmp_path):
    proc = trainer(f"--logdir={tmp_path}", "--logical_devices=6", "--num_replicas=3", "--max_steps=1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "input.train.batch_size=64 is not divisible by the 3 data-parallel replicas" in err


@pytest.mark.exhaustive(covered_by=(
    "tests/pipeline/test_workers.py::test_two_worker_processes_compute_the_same_gradients",
))
def test_stages_on_local_worker_processes_match_logical_devices(tmp_path):
    """--local_stage_workers=2: stage k runs in TF server process k (gRPC transfers), same result."""
    finish(trainer(f"--logdir={tmp_path / 'local'}", "--max_steps=3"))
    out = finish(trainer(f"--logdir={tmp_path / 'servers'}", "--local_stage_workers=2", "--max_steps=3"))
    assert "pipeline stages on 2 TF servers" in out
    table = (tmp_path / "servers" / "partition.txt").read_text()
    assert "/job:worker/replica:0/task:1/device:CPU:0" in table
    ref, got = checkpoint_values(tmp_path / "local"), checkpoint_values(tmp_path / "servers")
    assert ref.keys() == got.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_training_failures.py::test_sigterm_saves_a_checkpoint_and_exits_zero",
))
def test_a_signal_to_one_worker_stops_both_at_the_same_step_with_a_checkpoint(tmp_path):
    hosts = ",".join(f"127.0.0.1:{port}" for port in workers.free_ports(2))
    procs = [trainer(f"--logdir={tmp_path}", "--logical_devices=2", f"--worker_hosts={hosts}", f"--task_index={i}",
                     "--max_steps=100000", "--params=train.log_interval_steps=1,train.save_interval_steps=100000")
             for i in range(2)]
    try:
        for line in procs[1].stdout:
            if line.startswith("step 20/"):
                procs[1].send_signal(signal.SIGTERM)
                break
        chief, other = (finish(p, timeout=120) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    stopped = [line for line in chief.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and "a signal to another worker" in stopped[0], chief[-2000:]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert f"stopped by signal SIGTERM at step {step}; the chief saved a checkpoint" in other
    assert os.path.exists(tmp_path / "checkpoints" / f"ckpt-{step}.index")


@pytest.mark.exhaustive(covered_by=(
    "tests/pipeline/test_data_parallel.py::test_two_replicas_of_two_stages_equal_one_unpipelined_model",
    "tests/pipeline/test_pipeline.py::test_checkpoints_do_not_depend_on_k_or_schedule",
))
def test_a_single_replica_checkpoint_resumes_with_two_replicas(tmp_path):
    no_dropout = "--gin_param=BlobsMlpGPipe.dropout_rate=0.0"
    finish(trainer(f"--logdir={tmp_path / 'ref'}", no_dropout, "--max_steps=5"))
    finish(trainer(f"--logdir={tmp_path / 'dp'}", no_dropout, "--max_steps=3"))
    out = finish(trainer(f"--logdir={tmp_path / 'dp'}", no_dropout, "--logical_devices=4", "--num_replicas=2",
                         "--max_steps=5"))
    assert "resumed from" in out and "data parallel: 2 replicas" in out
    ref, got = checkpoint_values(tmp_path / "ref"), checkpoint_values(tmp_path / "dp")
    for name in ref:
        if np.issubdtype(ref[name].dtype, np.floating):
            assert relative(got[name], ref[name]) < 1e-5, name
