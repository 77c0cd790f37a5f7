"""Experiments: knobs, gin bindings and dotted overrides, with their precedence and errors."""

import pytest

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError

KEY = "toy.classifier.BlobsMlp"


def test_defaults_build_a_full_tree():
    params, _ = experiment.resolve_params(KEY)
    assert params.model == KEY
    assert params.is_frozen
    assert params.get("task.softmax.num_classes") == 8
    assert params.input.dev.num_batches == 20
    assert params.eval.datasets == ["dev", "test"]


def test_precedence_defaults_then_gin_then_params(tmp_path):
    gin_file = tmp_path / "exp.gin"
    gin_file.write_text("BlobsMlp.learning_rate = 0.5\nBlobsMlp.num_classes = 4\n")
    params, operative = experiment.resolve_params(
        KEY, [str(gin_file)], ["BlobsMlp.hidden_dims = (32,)"], "train.learning_rate=0.25")
    assert params.train.learning_rate == 0.25          # --params beats gin
    assert params.task.softmax.num_classes == 4        # gin beats the default
    assert params.task.softmax.input_dim == 32
    assert "num_classes = 4" in operative


def test_gin_knob_typo_suggests_the_knob():
    with pytest.raises(ConfigError, match="no knob 'hiden_dims'; did you mean 'hidden_dims'"):
        experiment.resolve_params(KEY, gin_bindings=["BlobsMlp.hiden_dims = (32,)"])


def test_bad_gin_syntax_is_a_config_error():
    with pytest.raises(ConfigError, match="bad gin config"):
        experiment.resolve_params(KEY, gin_bindings=["BlobsMlp.hidden_dims = (("])


def test_override_typo_and_wrong_type():
    with pytest.raises(ParamsError, match="did you mean"):
        experiment.resolve_params(KEY, overrides="train.learning_rat=0.1")
    with pytest.raises(ParamsError, match="learning_rate"):
        experiment.resolve_params(KEY, overrides="train.learning_rate=fast")


def test_several_experiments_resolve_in_one_process():
    """gin locks its registry after parsing; a second experiment must still register its knobs."""
    first, _ = experiment.resolve_params(KEY)
    second, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe",
                                          gin_bindings=["BlobsMlpGPipe.remat = 'never'"])
    assert first.model == KEY and second.task.network.remat == "never"


ADAMW = "gpipe_tf.training.optimizers.AdamW"


def test_setting_the_optimizer_class_it_already_has_keeps_its_fields():
    # The optimizer an experiment made AdamW with its own weight decay (here: the overrides before), named again in
    # the form docs/trainer.md#overrides shows, with a field of its own after it.
    experiment_set = f"train.optimizer.cls={ADAMW},train.optimizer.weight_decay=0.05,train.optimizer.decay_exclude=bias"
    resolved = experiment.resolve(KEY, overrides=f"{experiment_set},train.optimizer={ADAMW},"
                                                 "train.optimizer.beta2=0.98")
    optimizer = resolved.params.train.optimizer
    assert (optimizer.weight_decay, optimizer.decay_exclude, optimizer.beta2) == (0.05, "bias", 0.98)
    assert resolved.notes == ()
    # Another class starts from its defaults; the one note names what differed from AdamW's.
    resolved = experiment.resolve(KEY, overrides=f"{experiment_set},train.optimizer=gpipe_tf.training.optimizers.Adam")
    assert resolved.params.train.optimizer.beta2 == 0.999 and "weight_decay" not in resolved.params.train.optimizer
    assert len(resolved.notes) == 1
    assert "reset: weight_decay=0.05, decay_exclude='bias'" in resolved.notes[0], resolved.notes


def test_overriding_the_micro_batch_count_keeps_the_experiments_batch():
    """--params task.network.num_micro_batches=M rescales the micro_batch_shape the experiment derived from its
    batch (the memory plan sizes activations by it), with a note; an explicit shape, or a count the batch does not
    split into, is the user's to give."""
    key = "toy.classifier.BlobsMlpGPipe"
    default = experiment.resolve(key).params.task.network
    batch = default.micro_batch_shape[0] * default.num_micro_batches
    resolved = experiment.resolve(key, overrides="task.network.num_micro_batches=8")
    network = resolved.params.task.network
    assert network.micro_batch_shape == [batch // 8, *default.micro_batch_shape[1:]]
    assert any("rescaled task.network.micro_batch_shape" in note for note in resolved.notes), resolved.notes
    explicit = experiment.resolve(key, overrides="task.network.num_micro_batches=8,"
                                                 "task.network.micro_batch_shape=[3, 5]").params.task.network
    assert explicit.micro_batch_shape == [3, 5]
    with pytest.raises(ConfigError, match=r"does not split into 7; use a divisor of it, or set "
                                          r"task\.network\.micro_batch_shape too"):
        experiment.resolve(key, overrides="task.network.num_micro_batches=7")
