"""Tiny fake source files for the real TFDS image builders, so they can prepare offline in tests.

Each writer lays files out exactly as the builder expects to find them after download/extraction (or in
`manual_dir` for imagenet2012) and returns what was written, so tests can compare labels and pixels. The
layouts follow the builders shipped with tensorflow-datasets 4.9:
`image_classification/cifar.py` and `datasets/imagenet2012/imagenet2012_dataset_builder.py`.
"""

from __future__ import annotations

import io
import os
import tarfile
import unittest.mock
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

CIFAR_SIZE = 32


def _cifar_records(rng: np.random.Generator, count: int,
                   label_ranges: list[int]) -> tuple[bytes, np.ndarray, np.ndarray]:
    """`count` binary CIFAR records: one byte per label, then 3072 image bytes in channel-major order."""
    labels = np.stack([rng.integers(0, n, size=count) for n in label_ranges], axis=1).astype(np.uint8)
    images = rng.integers(0, 256, size=(count, CIFAR_SIZE, CIFAR_SIZE, 3), dtype=np.uint8)
    chw = images.transpose(0, 3, 1, 2).reshape(count, -1)
    return np.concatenate([labels, chw], axis=1).tobytes(), labels, images


def write_cifar(root: str, dataset: str, train_per_file: int, test_count: int, seed: int = 0) -> dict:
    """Writes the extracted CIFAR-10/100 binary archive under `root`.

    Returns {'train': (labels, images), 'test': (labels, images)} in file order, labels being the fine
    label (CIFAR-100 coarse labels are written too but not returned).
    """
    rng = np.random.default_rng(seed)
    if dataset == "cifar10":
        folder = os.path.join(root, "cifar-10-batches-bin")
        train_files = [f"data_batch_{i}.bin" for i in range(1, 6)]
        test_file = "test_batch.bin"
        label_files = {"batches.meta.txt": [f"class{i}" for i in range(10)]}
        label_ranges = [10]
    elif dataset == "cifar100":
        folder = os.path.join(root, "cifar-100-binary")
        train_files = ["train.bin"]
        test_file = "test.bin"
        label_files = {"coarse_label_names.txt": [f"coarse{i}" for i in range(20)],
                       "fine_label_names.txt": [f"fine{i}" for i in range(100)]}
        label_ranges = [20, 100]  # the record stores the coarse label byte first
    else:
        raise ValueError(dataset)
    os.makedirs(folder, exist_ok=True)
    for name, names in label_files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write("\n".join(names) + "\n")
    written = {}
    for split, files, count in (("train", train_files, train_per_file), ("test", [test_file], test_count)):
        all_labels, all_images = [], []
        for name in files:
            data, labels, images = _cifar_records(rng, count, label_ranges)
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
            all_labels.append(labels[:, -1])
            all_images.append(images)
        written[split] = (np.concatenate(all_labels), np.concatenate(all_images))
    return written


@contextmanager
def offline_downloads(path: str) -> Iterator[None]:
    """Makes every TFDS download resolve to `path` (already "extracted"), never touching the network."""
    def fake(self: tfds.download.DownloadManager, url_or_urls: Any) -> Any:
        del self
        return tfds.core.utils.map_nested(lambda _: path, url_or_urls)

    with unittest.mock.patch.object(tfds.download.DownloadManager, "download_and_extract", fake), \
            unittest.mock.patch.object(tfds.download.DownloadManager, "download", fake), \
            unittest.mock.patch.object(tfds.download.DownloadManager, "extract", fake):
        yield


def prepare_offline(builder: tfds.core.DatasetBuilder, source_dir: str) -> None:
    """Runs the real `builder`'s preparation on the files already written in `source_dir`."""
    with offline_downloads(source_dir):
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))


def prepare_cifar(dataset: str, data_dir: str, source_dir: str, train_per_file: int = 8,
                  test_count: int = 12, seed: int = 0) -> dict:
    """Writes fake CIFAR files into `source_dir` and runs the real builder into `data_dir`."""
    written = write_cifar(source_dir, dataset, train_per_file, test_count, seed)
    prepare_offline(tfds.builder(dataset, data_dir=data_dir), source_dir)
    return written


def _jpeg(rng: np.random.Generator, height: int, width: int) -> bytes:
    """A smooth random colour image as JPEG bytes (smooth so decoding noise stays small)."""
    corners = rng.integers(0, 256, size=(2, 2, 3)).astype(np.float64)
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    image = (corners[0, 0] * (1 - y) * (1 - x) + corners[0, 1] * (1 - y) * x
             + corners[1, 0] * y * (1 - x) + corners[1, 1] * y * x)
    buffer = io.BytesIO()
    Image.fromarray(image.astype(np.uint8)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def imagenet_label_names() -> list[str]:
    """The 1000 synsets, in label-index order, from the builder's own package file."""
    path = tfds.core.tfds_path("datasets/imagenet2012/labels.txt")
    return path.read_text().split()


def imagenet_validation_synsets(count: int) -> list[str]:
    """Synsets the builder assigns to the first `count` validation images (sorted by file name)."""
    path = tfds.core.tfds_path("datasets/imagenet2012/validation_labels.txt")
    return path.read_text().split()[:count]


def write_imagenet_manual_dir(manual_dir: str, synsets: list[str], per_class: int, val_count: int,
                              seed: int = 0) -> dict:
    """Writes ILSVRC2012_img_train.tar (one tar per synset) and ILSVRC2012_img_val.tar into `manual_dir`.

    The builder reads class names and validation labels from its own package files, so the train archive
    may hold any subset of the 1000 synsets, and the validation archive's i-th file (sorted by name) gets
    the i-th line of the package's validation_labels.txt. Returns {file_name: label_index} per split.
    """
    rng = np.random.default_rng(seed)
    index = {name: i for i, name in enumerate(imagenet_label_names())}
    os.makedirs(manual_dir, exist_ok=True)
    train = {}
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_train.tar"), "w") as outer:
        for synset in synsets:
            inner_bytes = io.BytesIO()
            with tarfile.open(fileobj=inner_bytes, mode="w") as inner:
                for k in range(per_class):
                    name = f"{synset}_{k}.JPEG"
                    # Varied sizes and aspect ratios exercise the crop logic.
                    _add_bytes(inner, name, _jpeg(rng, int(rng.integers(70, 120)), int(rng.integers(70, 120))))
                    train[name] = index[synset]
            _add_bytes(outer, f"{synset}.tar", inner_bytes.getvalue())
    validation = {}
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_val.tar"), "w") as tar:
        for k, synset in enumerate(imagenet_validation_synsets(val_count)):
            name = f"ILSVRC2012_val_{k + 1:08d}.JPEG"
            _add_bytes(tar, name, _jpeg(rng, int(rng.integers(70, 120)), int(rng.integers(70, 120))))
            validation[name] = index[synset]
    return {"train": train, "validation": validation}


def prepare_imagenet(data_dir: str, manual_dir: str, synsets: list[str], per_class: int = 6,
                     val_count: int = 10, seed: int = 0) -> dict:
    """Writes a tiny manual_dir and runs the real imagenet2012 builder on it into `data_dir`."""
    written = write_imagenet_manual_dir(manual_dir, synsets, per_class, val_count, seed)
    builder = tfds.builder("imagenet2012", data_dir=data_dir)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=False))
    return written
