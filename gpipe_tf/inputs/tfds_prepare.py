"""Making sure a TFDS dataset is prepared before an input reads it, with an error that says how to prepare it.

This project's machines have no internet, and `tfds.load` on a missing dataset retries the network for minutes.
Inputs therefore check `builder.is_prepared()` first and, unless they may download, fail at once (in well under
a second) with a `DatasetNotPreparedError` naming the dataset, the data_dir and the command that prepares it.
"""

from __future__ import annotations

import tensorflow_datasets as tfds

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError

__all__ = ["DatasetNotPreparedError", "prepare_hint", "ensure_prepared", "tfds_builder", "num_split_examples"]


class DatasetNotPreparedError(ConfigError):
    """The TFDS dataset is not in data_dir and may not (or cannot) be downloaded here."""


def prepare_hint(dataset: str, data_dir: str | None) -> str:
    """How to prepare `dataset` (a TFDS name, 'name/config' allowed) for `data_dir`, as a sentence or two."""
    target = f" --data_dir={data_dir}" if data_dir else ""
    folder = dataset.split("/")[0]
    return (f"Run `tfds build {dataset}{target}` on a machine with internet and copy the resulting "
            f"'{folder}' folder into data_dir here, or set download=True where the network is reachable.")


def ensure_prepared(builder: tfds.core.DatasetBuilder, data_dir: str | None, download: bool,
                    hint: str, manual_dir: str | None = None) -> None:
    """Returns at once if `builder`'s data is prepared; else prepares it if allowed, or raises.

    Preparation is allowed with `download` (TFDS downloads the sources) or with `manual_dir` (the sources are
    already there, as for ImageNet). Otherwise raises DatasetNotPreparedError ending with `hint`.
    """
    if builder.is_prepared():
        return
    if not download and manual_dir is None:
        raise DatasetNotPreparedError(
            f"TFDS dataset {builder.info.full_name.rsplit('/', 1)[0]!r} is not prepared in data_dir={data_dir!r} "
            f"(looked in {builder.data_dir}) and download=False. {hint}")
    config = tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=download)
    builder.download_and_prepare(download_config=config)


def tfds_builder(dataset: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """The TFDS builder of `dataset` ('name' or 'name/config'), prepared or not; ParamsError if TFDS has none."""
    try:
        return tfds.builder(dataset, data_dir=data_dir)
    except ValueError as e:  # DatasetNotFoundError, or a bad config name
        raise ParamsError(f"dataset={dataset!r} is not a TFDS dataset here: {str(e).splitlines()[0]}") from None


def num_split_examples(builder: tfds.core.DatasetBuilder, dataset: str, split: str) -> int:
    """Examples in `split` (a name or a slice such as 'test[:50%]') of a prepared builder; ConfigError if bad."""
    try:
        return builder.info.splits[split].num_examples
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{dataset}: bad split {split!r}: {e}") from e
