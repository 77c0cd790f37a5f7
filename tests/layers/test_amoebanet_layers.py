"""AmoebaNet layers: counts and shapes from Params match the built model; GPipe equals Sequential; drop path."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.layers.amoebanet import Cell, DropPath, amoebanet_layers, set_drop_path_step
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.sequential import Sequential
from tests.helpers import tiers

B, M, IMAGE, CLASSES = 8, 4, 16, 10
RNG = np.random.default_rng(3)
DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def tiny(genotype="D", stem="cifar", **kwargs):
    # The ImageNet stem cells run at F/4: F=16 keeps c3x3's fs/4 bottleneck at least 1 channel wide.
    return amoebanet_layers(genotype, 1, 8 if stem == "cifar" else 16, CLASSES, IMAGE, stem, **kwargs)


def build_sequential(layers):
    return Sequential.params().set(name="net", dtype="float64", layers=layers).instantiate()


def images(batch=B):
    return tf.constant(RNG.normal(size=(batch, IMAGE, IMAGE, 3)))


@pytest.mark.parametrize("genotype,stem", [("A", "cifar"), ("B", "imagenet"), ("D", "cifar")])
def test_counts_and_specs_from_params_match_the_built_model(genotype, stem):
    layers = tiny(genotype, stem, drop_path_keep_prob=0.8)
    seq = build_sequential(layers)
    for lp, layer in zip(layers, seq.children.values()):
        built = sum(int(np.prod(v.shape)) for v in layer.trainable_variables)
        assert lp.cls.num_params(lp) == built, lp.cls.__name__
    spec = tf.TensorSpec([2, IMAGE, IMAGE, 3], tf.float64)
    x = tf.zeros(spec.shape, spec.dtype)
    ctx = FPropContext(training=True, seed=tf.constant([1, 2], tf.int64))
    for lp, (name, layer) in zip(layers, seq.children.items()):
        assert lp.cls.flops(lp, spec) > 0
        spec, x = lp.cls.output_spec(lp, spec), layer.fprop(seq.theta[name], x, ctx)
        real = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), x)
        assert spec == real, lp.cls.__name__
    assert x.shape == (2, CLASSES)
    unknown_batch = tf.TensorSpec([None, IMAGE, IMAGE, 3], tf.float64)
    assert Sequential.output_spec(seq.p, unknown_batch).shape.as_list() == [None, CLASSES]


def make_pipe(layers, balance=None):
    # K=2, M=4 with rematerialization, as issue 5's acceptance asks.
    return GPipe.params().set(name="net", dtype="float64", layers=layers, num_stages=2, num_micro_batches=M,
                              balance=balance, balance_by="flops", micro_batch_shape=[B // M, IMAGE, IMAGE, 3],
                              input_dtype="float64", devices=DEVICES, remat="always").instantiate()


def by_name(variables, grads):
    return {v.name: g for v, g in zip(variables, grads)}


def stem_cell_head(layers):
    """The stem, the first cell and the head: a 3-layer list that traces quickly."""
    return layers[:2] + [layers[-1].copy().set(input_dim=Cell.output_dim(layers[1]))]


# Eager runs cover the whole tiny model; a traced (tf.function) run, the way training runs it, takes ~10 s even
# for three layers on this machine, so it covers a shortened list.
@pytest.mark.parametrize("training,traced,drop", tiers.sample(
    [(False, False, False), (True, False, False), (True, False, True), (True, True, True)],
    keep=[(False, False, False), (True, False, True)]))
def test_gpipe_equals_sequential(training, traced, drop):
    # With drop path and the head's dropout on, the pipeline folds the micro-batch index into the seed, so the
    # reference feeds micro-batch i with the same per-micro-batch context.
    layers = tiny("D", drop_path_keep_prob=0.6 if drop else 1.0, dropout_rate=0.3 if drop else 0.0)
    # The stem alone on stage 0 puts its (x, x) pair on a stage boundary: the first cell ignores the second entry,
    # whose gradient must stay zero rather than double the first's.
    balance = [1, 2] if traced else None
    if traced:
        layers = stem_cell_head(layers)
    pipe, seq = make_pipe(layers, balance), build_sequential(layers)
    assert len(pipe.stage_layers) == 2
    x = images()
    ctx = FPropContext(training=training, seed=tf.constant([5, 7], tf.int64), aux={} if training else None)

    def pipelined():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(pipe.fprop(pipe.theta, x, ctx)))
        with placement.colocate_gradients():
            return loss, tape.gradient(loss, pipe.trainable_variables), dict(ctx.aux or {})

    def reference():
        # Training: micro-batch statistics, so feed the micro-batches one by one. Inference: moving statistics,
        # so the whole batch at once is the same computation.
        parts = ([(x[i * B // M:(i + 1) * B // M], pipe.micro_batch_context(ctx, i, True)) for i in range(M)]
                 if training else [(x, ctx)])
        aux = {}
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.square(seq.fprop(seq.theta, part, c))) for part, c in parts])
        for _, c in parts:
            for path, stats in (c.aux or {}).items():
                aux[path] = stats if path not in aux else tf.nest.map_structure(tf.add, aux[path], stats)
        return loss, tape.gradient(loss, seq.trainable_variables), aux

    if traced:
        pipelined = tf.function(pipelined, autograph=False)
    (lp, gp, pipe_aux), (ls, gs, aux) = pipelined(), reference()
    np.testing.assert_allclose(lp.numpy(), ls.numpy(), rtol=1e-9)
    gp, gs = by_name(pipe.trainable_variables, gp), by_name(seq.trainable_variables, gs)
    assert gp.keys() == gs.keys()
    for name in gs:
        np.testing.assert_allclose(gp[name].numpy(), gs[name].numpy(), rtol=1e-9, atol=1e-9, err_msg=name)
    if training:
        assert aux and aux.keys() == pipe_aux.keys()
        for path in aux:
            for a, b in zip(pipe_aux[path], aux[path]):
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-9)


def test_drop_path_is_per_example_deterministic_and_off_outside_training():
    layer = DropPath.params().set(keep_prob=0.5, dtype="float64").instantiate()
    x = tf.constant(RNG.uniform(1.0, 2.0, size=(64, 3, 3, 2)))
    train = [FPropContext(training=True, seed=tf.constant([1, s], tf.int64)) for s in (0, 0, 1)]
    a, b, c = (layer(x, ctx).numpy() for ctx in train)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    kept = np.all(a != 0, axis=(1, 2, 3))
    assert 0 < kept.sum() < 64 and np.all(a[~kept] == 0)
    np.testing.assert_allclose(a[kept], x.numpy()[kept] / 0.5)
    np.testing.assert_array_equal(layer(x, FPropContext(training=False)).numpy(), x.numpy())
    off = DropPath.params().set(keep_prob=1.0).instantiate()
    assert off(tf.ones([2, 1]), FPropContext(training=True)).numpy().tolist() == [[1.0], [1.0]]


def test_drop_path_ramps_in_with_the_step():
    layer = DropPath.params().set(keep_prob=0.5, burn_in_steps=10, dtype="float64").instantiate()
    assert layer.vars["global_step"].trainable is False
    x = tf.ones([256, 1, 1, 1], tf.float64)
    ctx = FPropContext(training=True, seed=tf.constant([2, 3], tf.int64))
    np.testing.assert_array_equal(layer(x, ctx).numpy(), x.numpy())  # step 0: keep probability 1
    set_drop_path_step(layer, 5)  # keep probability 0.75
    out = layer(x, ctx).numpy()
    assert set(np.unique(out)) == {0.0, 1 / 0.75} and 0.6 < np.mean(out != 0) < 0.9
