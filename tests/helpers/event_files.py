"""Reading what a run wrote for TensorBoard: the events of a logdir's event files and its HParams session."""

import os
from collections.abc import Iterator

import tensorflow as tf
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorflow.core.util import event_pb2


def events(directory) -> Iterator[event_pb2.Event]:
    """Every event of the event files directly in `directory`."""
    for name in sorted(f for f in os.listdir(directory) if "tfevents" in f):
        for record in tf.data.TFRecordDataset(os.path.join(directory, name)):
            yield event_pb2.Event.FromString(record.numpy())


def session_hparams(logdir) -> dict:
    """{name: value} of the HParams session that a run started in `logdir`."""
    for event in events(logdir):
        for value in event.summary.value:
            if (value.metadata.plugin_data.plugin_name == hparams_metadata.PLUGIN_NAME
                    and value.tag == hparams_metadata.SESSION_START_INFO_TAG):
                info = hparams_metadata.parse_session_start_info_plugin_data(value.metadata.plugin_data.content)
                return {name: getattr(v, v.WhichOneof("kind")) for name, v in info.hparams.items()}
    raise AssertionError(f"no HParams session in {logdir}")
