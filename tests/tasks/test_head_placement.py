"""The loss head's variables live on the device that runs it: the last chunk's device of a pipelined network
(`BaseTask.create_head`), so the memory plan's last-chunk device holds its weights, gradient sums and slots."""

import pytest
import tensorflow as tf

from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.layers.linear import Linear
from gpipe_tf.tasks.classifier import ClassifierTask
from gpipe_tf.tasks.translation import TranslationTask


def _device(name: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


@pytest.mark.parametrize("schedule,last_device", [("fill_drain", 1), ("one_f_one_b", 1), ("zero_bubble_v", 0)])
def test_the_softmax_lives_on_the_last_chunks_device(schedule, last_device):
    layers = [Linear.params().set(input_dim=4, output_dim=4) for _ in range(4)]
    network = GPipe.params().set(layers=layers, num_stages=2, num_micro_batches=2, device_kind="cpu",
                                 schedule=schedule)
    p = ClassifierTask.params().set(name="task", network=network)
    p.softmax.set(input_dim=4, num_classes=3)
    task = p.instantiate()
    # ZeroBubbleV's V ends on device 0: its last chunk, which runs the loss, is there.
    assert tf.DeviceSpec.from_string(task.network.devices[-1]).device_index == last_device
    assert {_device(v.device) for v in task.softmax.variables} == {_device(task.network.devices[-1])}


def test_an_unpipelined_head_is_placed_as_any_child():
    network = Linear.params().set(input_dim=4, output_dim=4)
    p = ClassifierTask.params().set(name="task", network=network)
    p.softmax.set(input_dim=4, num_classes=3)
    task = p.instantiate()
    assert {_device(v.device) for v in task.softmax.variables} == {_device(v.device) for v in task.network.variables}


def test_the_translation_tasks_head_is_its_softmax_from_params():
    p = TranslationTask.params().set(name="t", vocab_size=11, model_dim=8, num_heads=2, hidden_dim=16,
                                     label_smoothing=0.2)
    [(name, softmax)] = TranslationTask.head_params(p)
    assert name == "softmax" and (softmax.input_dim, softmax.num_classes, softmax.label_smoothing) == (8, 11, 0.2)
    task = p.instantiate()
    assert task.softmax.p.num_classes == 11
    assert TranslationTask.num_params(p) == sum(int(tf.size(v)) for v in task.trainable_variables)
