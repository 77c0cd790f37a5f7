"""Image classification batches from TFDS: CIFAR-10, CIFAR-100 and ImageNet 2012 (ILSVRC).

The dataset must already be prepared in `data_dir` (this project's machines have no internet); a missing one
raises `DatasetNotPreparedError` at construction, in well under a second, saying how to prepare it. ImageNet
can also be prepared here from the two ILSVRC tar files via `manual_dir`.

Determinism: file order, the shuffle buffer and every augmentation are seeded from `seed`. Augmentations use
stateless ops seeded from (seed, position of the example in the stream), so the same seed gives the same
batches on every run, the next epoch is augmented differently, and a checkpointed iterator resumes exactly.
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf
import tensorflow_datasets as tfds

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs.base_input import BaseInput
from gpipe_tf.inputs.tfds_prepare import DatasetNotPreparedError, ensure_prepared, prepare_hint


@dataclasses.dataclass(frozen=True)
class _DatasetSpec:
    num_classes: int
    image_size: int
    mean: tuple[float, float, float]  # per channel, of pixels scaled to [0, 1]
    std: tuple[float, float, float]
    jpeg: bool  # images stay JPEG bytes until cropped, so only the crop is decoded


# Channel statistics are the usual published values for each training set.
_DATASETS = {
    "cifar10": _DatasetSpec(10, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), jpeg=False),
    "cifar100": _DatasetSpec(100, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), jpeg=False),
    "imagenet2012": _DatasetSpec(1000, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), jpeg=True),
}

_CIFAR_PAD = 4
_IMAGENET_MANUAL_FILES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")


def _spec(dataset: str) -> _DatasetSpec:
    if dataset not in _DATASETS:
        raise ParamsError(f"dataset={dataset!r} is not supported; choose from {sorted(_DATASETS)}")
    return _DATASETS[dataset]


def num_classes(dataset: str) -> int:
    """Number of label classes of a supported TFDS image dataset."""
    return _spec(dataset).num_classes


def default_image_size(dataset: str) -> int:
    """The usual square input resolution for a supported dataset (32 for CIFAR, 224 for ImageNet)."""
    return _spec(dataset).image_size


def _prepare_hint(dataset: str, data_dir: str | None) -> str:
    if dataset == "imagenet2012":
        target = f" --data_dir={data_dir}" if data_dir else ""
        return ("ImageNet cannot be downloaded automatically: put " + " and ".join(_IMAGENET_MANUAL_FILES)
                + " in a folder DIR and set manual_dir=DIR (it is then prepared here, offline; this takes hours "
                f"for the full set), or run `tfds build imagenet2012 --manual_dir=DIR{target}`.")
    return prepare_hint(dataset, data_dir)


class TfdsImageInput(BaseInput):
    """Batches {'inputs': float [B, S, S, 3] normalized per channel, 'labels': int32 [B]} from a TFDS split.

    Training (`training=True`): files and examples are shuffled and the split repeats; CIFAR is padded by 4
    pixels, randomly cropped back and randomly flipped; ImageNet gets a random-resized crop (area 8%-100%,
    aspect 3/4-4/3) and a random flip. Evaluation: CIFAR is only resized (if image_size is not 32); ImageNet
    takes the central `eval_crop_fraction` square and resizes it. Evaluation inputs make one pass in file
    order when num_batches is set, ending early if the split holds fewer than num_batches full batches.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: CIFAR-10's training split with augmentation."""
        p = super().params()
        p.define("dataset", "cifar10", f"TFDS dataset name: one of {sorted(_DATASETS)}.")
        p.define("split", "train", "TFDS split, e.g. 'train', 'test', 'validation' or a slice 'train[:90%]'.")
        p.define("data_dir", None, "TFDS data_dir holding the prepared dataset; None = TFDS's default.")
        p.define("manual_dir", None, "imagenet2012 only: folder with the ILSVRC2012 tars, to prepare offline.")
        p.define("image_size", None, "Output height and width; None = the dataset's default (32 or 224).")
        p.define("training", True, "Augment, shuffle and repeat (training) or not (evaluation).")
        p.define("shuffle_buffer", 10_000, "Examples in the shuffle buffer when training; <= 1 disables it. "
                 "Checkpointed iterators store the whole buffer.")
        p.define("eval_crop_fraction", 0.875, "imagenet2012 evaluation: side of the central crop over the "
                 "image's shorter side.")
        p.define("dtype", "float32", "dtype of 'inputs'.")
        p.define("download", False, "Let TFDS download (and prepare) a missing dataset; needs internet.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        p = self.p
        self._spec = _spec(p.dataset)
        self.image_size = p.image_size if p.image_size is not None else self._spec.image_size
        if self.image_size <= 0:
            raise ParamsError(f"image_size={p.image_size} must be > 0")
        if not 0.0 < p.eval_crop_fraction <= 1.0:
            raise ParamsError(f"eval_crop_fraction={p.eval_crop_fraction} must be in (0, 1]")
        self._dtype = tf.as_dtype(p.dtype)
        if not self._dtype.is_floating:
            raise ParamsError(f"dtype={p.dtype!r} must be a floating-point dtype")
        if p.manual_dir is not None and p.dataset != "imagenet2012":
            raise ParamsError(f"manual_dir is only used by imagenet2012, not {p.dataset!r}")
        self._builder = tfds.builder(p.dataset, data_dir=p.data_dir)
        self._ensure_prepared()
        try:
            self.num_examples = self._builder.info.splits[p.split].num_examples
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{p.dataset}: bad split {p.split!r}: {e}") from e
        if self.num_examples < p.batch_size:
            # drop_remainder would give no batch at all (and a repeated empty split never yields).
            raise ConfigError(f"{p.dataset} split {p.split!r} has {self.num_examples} examples, fewer than "
                              f"batch_size={p.batch_size}")

    def _ensure_prepared(self) -> None:
        p = self.p
        if self._builder.is_prepared():
            return
        if p.dataset == "imagenet2012" and p.manual_dir is not None:
            missing = [f for f in _IMAGENET_MANUAL_FILES if not tf.io.gfile.exists(os.path.join(p.manual_dir, f))]
            if len(missing) == len(_IMAGENET_MANUAL_FILES):
                raise DatasetNotPreparedError(
                    f"imagenet2012 is not prepared in data_dir={p.data_dir!r} (looked in {self._builder.data_dir}) "
                    f"and manual_dir={p.manual_dir!r} holds none of {list(_IMAGENET_MANUAL_FILES)}. "
                    + _prepare_hint(p.dataset, p.data_dir))
        ensure_prepared(self._builder, p.data_dir, p.download, _prepare_hint(p.dataset, p.data_dir), p.manual_dir)

    def _normalize(self, image: tf.Tensor) -> tf.Tensor:
        mean = tf.constant(self._spec.mean, tf.float32)
        std = tf.constant(self._spec.std, tf.float32)
        return tf.cast((image / 255.0 - mean) / std, self._dtype)

    def _resize(self, image: tf.Tensor) -> tf.Tensor:
        size = [self.image_size, self.image_size]
        # Antialiasing keeps large ImageNet crops from aliasing when shrunk; it is a no-op when upsampling.
        return tf.image.resize(image, size, method="bilinear", antialias=True)

    def _cifar(self, image: tf.Tensor, seeds: tf.Tensor) -> tf.Tensor:
        image = tf.cast(image, tf.float32)
        if self.image_size != self._spec.image_size:
            image = self._resize(image)
        if self.p.training:
            size = self.image_size
            padded = tf.pad(image, [[_CIFAR_PAD, _CIFAR_PAD], [_CIFAR_PAD, _CIFAR_PAD], [0, 0]])
            image = tf.image.stateless_random_crop(padded, [size, size, 3], seed=seeds[0])
            image = tf.image.stateless_random_flip_left_right(image, seed=seeds[1])
        return image

    def _imagenet(self, jpeg: tf.Tensor, seeds: tf.Tensor) -> tf.Tensor:
        shape = tf.image.extract_jpeg_shape(jpeg)
        if self.p.training:
            whole_image = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4])
            begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
                shape, whole_image, seed=seeds[0], min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3),
                area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
            window = tf.stack([begin[0], begin[1], size[0], size[1]])
        else:
            side = tf.cast(self.p.eval_crop_fraction * tf.cast(tf.minimum(shape[0], shape[1]), tf.float32),
                           tf.int32)
            window = tf.stack([(shape[0] - side + 1) // 2, (shape[1] - side + 1) // 2, side, side])
        # Decoding only the window is much cheaper than decoding the whole photo and then cropping.
        image = self._resize(tf.cast(tf.image.decode_and_crop_jpeg(jpeg, window, channels=3), tf.float32))
        if self.p.training:
            image = tf.image.stateless_random_flip_left_right(image, seed=seeds[1])
        return image

    def _preprocess(self, index: tf.Tensor, example: tuple[tf.Tensor, tf.Tensor]) -> dict[str, tf.Tensor]:
        image, label = example
        seeds = tf.random.experimental.stateless_split(tf.stack([tf.constant(self.p.seed, tf.int64), index]), 2)
        image = self._imagenet(image, seeds) if self._spec.jpeg else self._cifar(image, seeds)
        image = tf.ensure_shape(image, [self.image_size, self.image_size, 3])
        return {"inputs": self._normalize(image), "labels": label}

    def dataset(self) -> tf.data.Dataset:
        """Batches of this split; repeats forever when training or when num_batches is None."""
        p = self.p
        read_config = tfds.ReadConfig(shuffle_seed=p.seed, shuffle_reshuffle_each_iteration=True,
                                      try_autocache=False)  # an in-memory cache would bloat iterator checkpoints
        decoders = {"image": tfds.decode.SkipDecoding()} if self._spec.jpeg else None
        ds = self._builder.as_dataset(split=p.split, shuffle_files=p.training, read_config=read_config,
                                      decoders=decoders)
        # Dropping the other features before the shuffle keeps the buffer small.
        ds = ds.map(lambda ex: (ex["image"], tf.cast(ex["label"], tf.int32)))
        if p.training and p.shuffle_buffer > 1:
            ds = ds.shuffle(p.shuffle_buffer, seed=p.seed, reshuffle_each_iteration=True)
        if p.training or p.num_batches is None:
            ds = ds.repeat()
        # Counting after repeat gives every epoch fresh (yet reproducible) augmentation seeds.
        ds = ds.enumerate().map(self._preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.batch(p.batch_size, drop_remainder=True)
        if p.num_batches is not None:
            ds = ds.take(p.num_batches)
        options = tf.data.Options()
        options.deterministic = True
        return ds.prefetch(tf.data.AUTOTUNE).with_options(options)
