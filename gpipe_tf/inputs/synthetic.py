"""Generated classification data: a Gaussian mixture with several clusters per class.

Every example is a pure function of (seed, example index) drawn with stateless RNG, so the stream is
identical on every run, a checkpointed iterator resumes at the exact example, and splits with different
seeds never share examples (they are independent draws from one distribution). Several clusters per class
make the classes not linearly separable, so a hidden layer has something to learn.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs.base_input import BaseInput


class GaussianMixtureInput(BaseInput):
    """Batches {'inputs': float [B, input_dim], 'labels': int32 [B]} from a fixed Gaussian mixture."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: the mixture's shape and noise."""
        p = super().params()
        p.define("input_dim", 16, "Feature dimension.")
        p.define("num_classes", 8, "Number of classes.")
        p.define("clusters_per_class", 3, "Gaussian clusters per class.")
        p.define("center_scale", 2.0, "Standard deviation of the cluster centers.")
        p.define("noise", 1.0, "Standard deviation of each cluster.")
        p.define("mixture_seed", 7, "Seed of the cluster centers: keep it equal across train/dev/test.")
        p.define("dtype", "float32", "dtype of 'inputs'.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        if p.input_dim <= 0 or p.num_classes < 2 or p.clusters_per_class < 1:
            raise ParamsError(f"need input_dim > 0, num_classes >= 2, clusters_per_class >= 1; got "
                              f"{p.input_dim}, {p.num_classes}, {p.clusters_per_class}")
        num_clusters = p.num_classes * p.clusters_per_class
        self._centers = tf.random.stateless_normal(
            [num_clusters, p.input_dim], [p.mixture_seed, 0], stddev=p.center_scale, dtype=tf.float64)

    def _batch(self, index: tf.Tensor) -> dict[str, tf.Tensor]:
        p = self.p
        seed = tf.stack([tf.constant(p.seed, tf.int64), index])
        cluster = tf.random.stateless_uniform([p.batch_size], seed, 0, p.num_classes * p.clusters_per_class,
                                              dtype=tf.int64)
        noise = tf.random.stateless_normal([p.batch_size, p.input_dim], seed + [0, 1 << 40], stddev=p.noise,
                                           dtype=tf.float64)
        inputs = tf.gather(self._centers, cluster) + noise
        return {"inputs": tf.cast(inputs, p.dtype), "labels": tf.cast(cluster % p.num_classes, tf.int32)}

    def dataset(self) -> tf.data.Dataset:
        """Batch i is drawn from seed (p.seed, i); finite when num_batches is set."""
        count = -1 if self.p.num_batches is None else self.p.num_batches
        return tf.data.Dataset.range(count if count > 0 else 2**62).map(self._batch)
