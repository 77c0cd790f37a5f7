"""Generated image classification data that needs no download: noisy coloured gratings.

Class c is a sinusoidal grating with its own orientation, spatial frequency and colour. Each image draws a
random phase, brightness, contrast, small orientation/frequency jitter and Gaussian pixel noise. The random
phase makes every class's mean image flat, so no linear function of the pixels separates the classes, while
a small convnet (oriented filters, a nonlinearity and pooling) learns them quickly.

Every image is a pure function of (seed, example index) drawn with stateless RNG, so the stream is the same
on every run and for every batch size, a checkpointed iterator resumes exactly, and splits that use
different seeds (e.g. train 1, test 2) are independent draws from the same class definitions.
"""

from __future__ import annotations

import math

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs.base_input import BaseInput

# Five orientations 36 degrees apart stay easy to tell apart at 32x32 even with jitter and noise; more
# classes add frequency levels instead of crowding orientations.
_MAX_ORIENTATIONS = 5
_MAX_FREQUENCY_LEVELS = 6
_MIN_CYCLES, _MAX_CYCLES = 2.0, 7.0  # cycles per image: well below Nyquist (image_size / 2) at 16 pixels
_JITTER = 0.15  # fraction of the gap between neighbouring classes


def _class_table(num_classes: int) -> tuple[list[float], list[float], list[list[float]]]:
    """Per class: orientation (radians), frequency (cycles per image) and per-channel grating weights."""
    num_orientations = min(num_classes, _MAX_ORIENTATIONS)
    num_levels = math.ceil(num_classes / num_orientations)
    orientations, frequencies, colours = [], [], []
    for c in range(num_classes):
        orientations.append(math.pi * (c % num_orientations) / num_orientations)
        level = c // num_orientations
        ratio = _MAX_CYCLES / _MIN_CYCLES
        frequencies.append(_MIN_CYCLES * ratio ** (level / (num_levels - 1)) if num_levels > 1 else 4.0)
        # A hue wheel: neighbouring classes get different colours, so colour is a third (nonlinear) cue.
        hue = 2.0 * math.pi * c / num_classes
        colours.append([0.6 + 0.4 * math.cos(hue + 2.0 * math.pi * k / 3.0) for k in range(3)])
    return orientations, frequencies, colours


class GeneratedImageInput(BaseInput):
    """Batches {'inputs': float [B, S, S, 3] (roughly in [-1, 1]), 'labels': int32 [B]} of noisy gratings."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: 10 classes of 32x32 RGB images."""
        p = super().params()
        p.define("num_classes", 10, f"Number of classes, 2..{_MAX_ORIENTATIONS * _MAX_FREQUENCY_LEVELS}.")
        p.define("image_size", 32, "Image height and width (>= 16).")
        p.define("noise", 0.5, "Standard deviation of the Gaussian pixel noise (grating amplitudes are 0.1-0.7).")
        p.define("dtype", "float32", "dtype of 'inputs'.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        max_classes = _MAX_ORIENTATIONS * _MAX_FREQUENCY_LEVELS
        if not 2 <= p.num_classes <= max_classes:
            raise ParamsError(f"num_classes={p.num_classes} must be in [2, {max_classes}]")
        if p.image_size < 16:
            raise ParamsError(f"image_size={p.image_size} must be >= 16 so that the gratings are resolved")
        if p.noise < 0:
            raise ParamsError(f"noise={p.noise} must be >= 0")
        self._dtype = tf.as_dtype(p.dtype)
        if not self._dtype.is_floating:
            raise ParamsError(f"dtype={p.dtype!r} must be a floating-point dtype")
        orientations, frequencies, colours = _class_table(p.num_classes)
        self._orientations = tf.constant(orientations, tf.float32)
        self._frequencies = tf.constant(frequencies, tf.float32)
        self._colours = tf.constant(colours, tf.float32)
        self._orientation_gap = math.pi / min(p.num_classes, _MAX_ORIENTATIONS)
        # Pixel centres in [0, 1): frequencies are in cycles per image, whatever image_size is.
        coords = (tf.range(p.image_size, dtype=tf.float32) + 0.5) / p.image_size
        self._y, self._x = tf.meshgrid(coords, coords, indexing="ij")

    def example(self, index: tf.Tensor) -> dict[str, tf.Tensor]:
        """Example `index` of this seed's stream: {'inputs': [S, S, 3], 'labels': int32 []}."""
        p = self.p
        seeds = tf.random.experimental.stateless_split(
            tf.stack([tf.constant(p.seed, tf.int64), tf.cast(index, tf.int64)]), 3)
        label = tf.random.stateless_uniform([], seeds[0], 0, p.num_classes, dtype=tf.int32)
        # u: orientation jitter, frequency jitter, phase, brightness, contrast.
        u = tf.random.stateless_uniform([5], seeds[1])
        theta = tf.gather(self._orientations, label) + (2.0 * u[0] - 1.0) * _JITTER * self._orientation_gap
        cycles = tf.gather(self._frequencies, label) * (1.0 + (2.0 * u[1] - 1.0) * _JITTER)
        phase = 2.0 * math.pi * u[2]
        brightness = 0.4 * u[3] - 0.2
        contrast = 0.4 + 0.3 * u[4]
        along = self._x * tf.cos(theta) + self._y * tf.sin(theta)
        grating = tf.sin(2.0 * math.pi * cycles * along + phase)
        image = brightness + contrast * grating[:, :, None] * tf.gather(self._colours, label)
        image += tf.random.stateless_normal(tf.shape(image), seeds[2], stddev=p.noise)
        return {"inputs": tf.cast(image, self._dtype), "labels": label}

    def dataset(self) -> tf.data.Dataset:
        """Example i of batch b is example b * batch_size + i; finite when num_batches is set."""
        p = self.p
        if p.num_batches is None:
            indices = tf.data.Dataset.counter()
        else:
            indices = tf.data.Dataset.range(p.num_batches * p.batch_size)
        ds = indices.map(self.example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(p.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
