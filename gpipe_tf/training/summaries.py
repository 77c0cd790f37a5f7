"""TensorBoard summary writers, one per job directory (logdir/train, logdir/eval_<dataset>)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import tensorflow as tf
from tensorflow.core.util import event_pb2


class SummaryWriter:
    """Writes scalar and text summaries to one TensorBoard run directory."""

    def __init__(self, logdir: str, job: str) -> None:
        self.path = os.path.join(logdir, job)
        self._writer = tf.summary.create_file_writer(self.path)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes each value as a scalar at `step`."""
        with self._writer.as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)

    def text(self, step: int, name: str, text: str) -> None:
        """Writes a text summary (markdown; shown in TensorBoard's Text tab)."""
        with self._writer.as_default(step=step):
            # Four-space indentation makes TensorBoard render the text verbatim.
            tf.summary.text(name, "\n".join("    " + line for line in text.splitlines()))

    def image(self, step: int, name: str, image: tf.Tensor) -> None:
        """Writes a uint8 image batch [N, H, W, C] (shown in TensorBoard's Images tab)."""
        with self._writer.as_default(step=step):
            tf.summary.image(name, image)

    def flush(self) -> None:
        """Flushes pending events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()


def read_scalars(job_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Reads every scalar from the event files in `job_dir`: tag -> [(step, value), ...] in file order.

    TF2 writes scalars as tensor summaries, so values are decoded from `tensor`, not `simple_value`.
    """
    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(f for f in os.listdir(job_dir) if "tfevents" in f)
    for name in files:
        for record in tf.data.TFRecordDataset(os.path.join(job_dir, name)):
            event = event_pb2.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars" or value.HasField("simple_value"):
                    scalar = (value.simple_value if value.HasField("simple_value")
                              else float(tf.make_ndarray(value.tensor)))
                    out.setdefault(value.tag, []).append((event.step, scalar))
    return out
