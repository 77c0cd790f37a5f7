"""Weight EMA: the update rule against NumPy, its wiring into the train step, placement on a pipeline's stage
devices, and evaluation and export reading the averages."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training import exporter
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.adafactor import Adafactor
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.evaluator import Evaluator
from gpipe_tf.training.optimizers import Adam, AdamW
from gpipe_tf.training.summaries import read_scalars
from gpipe_tf.training.weight_ema import WeightEma

KEY = "toy.classifier.BlobsMlpGPipe"
FLOAT64 = ["BlobsMlpGPipe.dtype='float64'", "BlobsMlpGPipe.dropout_rate=0.0"]


def np_ema(trajectory, decay):
    """The first value, then average = decay * average + (1 - decay) * value."""
    average = trajectory[0]
    for value in trajectory[1:]:
        average = decay * average + (1 - decay) * value
    return average


def pipeline_params(optimizer=None, **train):
    params, _ = experiment.resolve_params(KEY, gin_bindings=FLOAT64)
    p = params.copy()
    if optimizer is not None:
        p.train.optimizer = optimizer
    p.train.set(**train)
    return p.freeze()


def test_update_matches_numpy_and_the_swap_restores_the_weights():
    rng = np.random.default_rng(3)
    trajectory = rng.normal(size=(6, 2, 3))
    var = tf.Variable(tf.zeros([2, 3], tf.float64), name="ema_unit/w")
    ema = WeightEma([var], 0.7)

    @tf.function(autograph=False)
    def step(value):
        var.assign(value)
        ema.update()

    for value in trajectory:
        step(tf.constant(value))
    want = np_ema(trajectory, 0.7)
    np.testing.assert_allclose(ema.average_of(var).numpy(), want, rtol=1e-14)
    assert int(ema.updates.numpy()) == 6
    with ema.averaged_weights():
        np.testing.assert_array_equal(var.numpy(), ema.average_of(var).numpy())
    np.testing.assert_array_equal(var.numpy(), trajectory[-1])
    # The checkpointed state is the averages and the count, not a second copy of the weights.
    assert {v.name for v in ema.variables} == {"ema/updates:0", "ema_unit/w/ema:0"}


@pytest.mark.parametrize("decay", [-0.1, 1.0, float("nan"), True])
def test_decay_out_of_range_is_named(decay):
    with pytest.raises(ParamsError, match="train.ema_decay="):
        WeightEma([tf.Variable([1.0], name="ema_bad/w")], decay)


def test_train_step_averages_the_updated_weights_and_skips_non_finite_steps(tmp_path):
    p = pipeline_params(ema_decay=0.6, max_steps=10)
    logdir_lib.prepare(str(tmp_path), p)
    controller = Controller(p, str(tmp_path), log=lambda line: None)
    controller.restore()
    learner = controller.learner
    trajectory = []
    for _ in range(4):
        learner.train_step(next(controller.train_iterator), tf.constant(False))
        trajectory.append([v.numpy() for v in learner.variables_to_train])
    batch = next(controller.train_iterator)
    poisoned = dict(batch, inputs=tf.fill(tf.shape(batch["inputs"]), tf.constant(np.nan, batch["inputs"].dtype)))
    out = learner.train_step(poisoned, tf.constant(False))
    assert bool(out["nonfinite"]) and int(learner.ema.updates.numpy()) == 4
    for i, var in enumerate(learner.variables_to_train):
        want = np_ema([weights[i] for weights in trajectory], 0.6)
        np.testing.assert_allclose(learner.ema.average_of(var).numpy(), want, rtol=1e-12, atol=1e-15,
                                   err_msg=var.name)


@pytest.mark.parametrize("optimizer", [AdamW.params(), Adafactor.params().set(min_dim_size_to_factor=8, beta1=0.9)],
                         ids=["adamw", "adafactor"])
def test_slots_and_averages_live_on_their_stage_device_and_updates_never_cross(tmp_path, optimizer):
    p = pipeline_params(optimizer, ema_decay=0.9)
    logdir_lib.prepare(str(tmp_path), p)
    controller = Controller(p, str(tmp_path), log=lambda line: None)
    controller.prepare_training()
    learner = controller.learner
    variables = learner.variables_to_train
    assert len({v.device for v in variables}) == 2  # the two stages' devices
    owned = {}  # id of a weight's, slot's or average's handle -> the weight's device
    for var in variables:
        slots = learner.optimizer.slots[var.name[:-2].replace("/", ".")].values()
        assert slots
        for state in (var, *slots, learner.ema.average_of(var)):
            assert state.device == var.device, (var.name, state.name)
            owned[id(state.handle)] = var.device
    # In the traced step, every write to a weight, slot or average runs on that variable's device.
    graph = learner.train_step.get_concrete_function(next(controller.train_iterator), tf.constant(False)).graph
    outer = {id(internal): id(external) for external, internal in graph.captures}
    per_device = {var.device: 0 for var in variables}
    for func_graph in [graph, *[f.graph for f in graph._functions.values()]]:
        inner = {id(internal): outer.get(id(external), id(external)) for external, internal in func_graph.captures}
        for op in func_graph.get_operations():
            if op.type in ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp"):
                handle = op.inputs[0]
                device = owned.get(inner.get(id(handle), outer.get(id(handle))))
                if device is not None:
                    assert tf.DeviceSpec.from_string(op.device) == tf.DeviceSpec.from_string(device), op.name
                    per_device[device] += 1
    assert all(count > 0 for count in per_device.values()), per_device


@pytest.fixture(scope="module")
def trained_with_ema(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("ema_run"))
    p = pipeline_params(ema_decay=0.8, max_steps=30, save_interval_steps=30, eval_interval_steps=0)
    logdir_lib.prepare(logdir, p)
    controller = Controller(p, logdir, log=lambda line: None)
    controller.train(evaluate_every=0)
    return logdir, p, controller


def test_train_and_eval_evaluates_the_averages_and_trains_on_its_own_weights(trained_with_ema):
    logdir, p, controller = trained_with_ema
    task, ema = controller.task, controller.learner.ema
    trained = [v.numpy() for v in task.trainable_variables]
    reported = read_scalars(f"{logdir}/eval_dev")["loss"][-1]
    assert reported[0] == 30
    evaluator = Evaluator(task, "dev", p.input.dev)
    raw_loss = evaluator.run()["loss"]
    with ema.averaged_weights():
        averaged_loss = evaluator.run()["loss"]
    assert reported[1] == pytest.approx(averaged_loss, rel=1e-6)
    assert abs(raw_loss - averaged_loss) > 1e-4
    for var, value in zip(task.trainable_variables, trained):
        np.testing.assert_array_equal(var.numpy(), value)
    # The eval job reads the checkpoint's averages the same way, also without train.ema_decay set.
    without = p.copy()
    without.train.ema_decay = 0.0
    lines = []
    by_step = Controller(without.freeze(), logdir, log=lines.append).evaluate()
    assert by_step[30]["dev"]["loss"] == pytest.approx(averaged_loss, rel=1e-12)
    assert f"using the weight averages (30 updates) of {logdir}/checkpoints/ckpt-30" in lines


def test_export_serves_the_averaged_weights(trained_with_ema, tmp_path):
    logdir, p, controller = trained_with_ema
    inputs = next(iter(p.input.dev.instantiate().dataset()))["inputs"]
    with controller.learner.ema.averaged_weights():
        want = exporter.classifier_logits(controller.task, inputs).numpy()
    raw = exporter.classifier_logits(controller.task, inputs).numpy()
    lines = []
    target = exporter.export(p.task.instantiate(), p, logdir, lines.append, export_dir=str(tmp_path / "export"))
    served = tf.saved_model.load(target).signatures["serving_default"](inputs=inputs)["logits"].numpy()
    np.testing.assert_allclose(served, want, rtol=1e-10, atol=1e-12)
    assert np.abs(served - raw).max() > 1e-6
    assert any(line.startswith("using the weight averages (30 updates)") for line in lines)


def test_averages_asked_of_a_checkpoint_without_them_is_a_config_error(tmp_path):
    p = pipeline_params(Adam.params(), max_steps=2, save_interval_steps=2)
    logdir_lib.prepare(str(tmp_path), p)
    Controller(p, str(tmp_path), log=lambda line: None).train()
    with_ema = p.copy()
    with_ema.train.ema_decay = 0.9
    with pytest.raises(ConfigError, match="holds no weight averages .*train.ema_decay=0"):
        Controller(with_ema.freeze(), str(tmp_path), log=lambda line: None).evaluate()


def test_averaging_turned_on_when_resuming_starts_from_the_resumed_run(tmp_path):
    logdir = str(tmp_path)
    first = pipeline_params(max_steps=2, save_interval_steps=2)
    logdir_lib.prepare(logdir, first)
    Controller(first, logdir, log=lambda line: None).train()
    p = pipeline_params(max_steps=4, save_interval_steps=2, ema_decay=0.5)
    lines = []
    controller = Controller(p, logdir, log=lines.append)
    assert controller.restore() == f"{logdir}/checkpoints/ckpt-2"
    assert f"weight averages (train.ema_decay=0.5) start now: {logdir}/checkpoints/ckpt-2 holds none" in lines
    learner = controller.learner
    trajectory = []
    for _ in range(2):
        learner.train_step(next(controller.train_iterator), tf.constant(False))
        trajectory.append([v.numpy() for v in learner.variables_to_train])
    assert int(learner.ema.updates.numpy()) == 2
    for i, var in enumerate(learner.variables_to_train):
        np.testing.assert_allclose(learner.ema.average_of(var).numpy(), np_ema([w[i] for w in trajectory], 0.5),
                                   rtol=1e-12, atol=1e-15)
