"""Configuration errors found only while tf.function traces a step keep their type: a ParamsError, not
TensorFlow's StagingError, so callers catching ParamsError see it, with its one-line message."""

import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training.controller import Controller


def test_a_batch_that_m_does_not_divide_in_a_traced_train_step_is_a_params_error(tmp_path):
    params = experiment.resolve("toy.classifier.BlobsMlpGPipe", overrides="input.train.batch_size=62").params
    controller = Controller(params, str(tmp_path / "run"), log=lambda line: None, quiet=True)
    with pytest.raises(ParamsError) as info:
        controller.prepare_training()  # traces the train step on a batch of 62 with M=4
    assert type(info.value) is ParamsError
    assert str(info.value) == "batch size 62 is not divisible by num_micro_batches=4; valid values: [1, 2, 31, 62]"


@pytest.mark.parametrize("autograph", [False, True])  # the trainer's way, and a layer converted by AutoGraph
def test_a_params_or_config_error_raised_in_any_traced_function_passes_through_unchanged(autograph):
    def raises(error):
        @tf.function(autograph=autograph)
        def step(x):
            if x.shape[0] == 3:
                raise error
            return x

        return step

    for error in (ParamsError("bad value x=3; use 4"), ConfigError("bad flag; use --y")):
        with pytest.raises(type(error)) as info:
            raises(error)(tf.zeros([3]))
        assert info.value is error and str(info.value) == str(error)
